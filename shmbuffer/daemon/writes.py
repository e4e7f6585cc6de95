"""The daemon's write ops: ``reserve`` (with a piggybacked commit), ``commit``, ``abort`` and a
remote writer's ``write``.

A reservation bumps the generation stamp of its rows *before* the writer learns which rows it
got, and is journaled before the reply hands them out; a commit is journaled before the reply
acknowledges it. A reserve is decided once (``Container.plan``: its rows, evictions, the writers
it would lap and flow control's say), checked against leases and the checkpoint, and carried out
from that one plan (``Container.reserve``). While a checkpoint is being written, a reserve first
has the checkpoint save the rows of its cut it is about to hand out (``checkpoint.py``). A local
writer's reservation is pinned to its process (``pins.py``): kept past its TTL and past its
connection while that process lives, and committed or aborted by any connection of that process.
A reserve that would evict leased episodes, lap a writer still copying (one stalled included,
named), whose rows that checkpoint cannot save yet, or that flow control holds back raises
:class:`~shmbuffer.daemon.state.Deferred` having changed nothing but its piggybacked commits,
which are done at once and left out of the request it parks (``Deferred.retry``).
A reserve sent ``ahead`` (a streaming writer's next reservation, asked for before it copies the
current one) is never deferred: where it would be, it is answered with reservation 0. It is
also answered with 0 where it would evict episodes of a registry holding more than
:data:`AHEAD_MAX_LIVE`: a reservation ahead that goes unused is aborted with ``written=0``,
and publishing its evictions again (``EpisodeRegistry.restore``) is O(evicted) when they are
the oldest, as a lone writer's are, but one vectorised rebuild of the registry, O(live episodes),
when writers commit out of order (milliseconds at :data:`AHEAD_MAX_LIVE` episodes, an order of
magnitude more at 1M: ``docs/architecture.md``).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from shmbuffer.daemon.clients import Client
from shmbuffer.daemon.journal import record_bytes
from shmbuffer.daemon.pins import Pin
from shmbuffer.daemon.records import commit_bytes, meta_bytes, meta_payload, reserve_bytes
from shmbuffer.daemon.state import DaemonState, Deferred, Frames, Reply
from shmbuffer.errors import (
    InvalidArgumentError,
    LimitExceededError,
    NotFoundError,
    OutOfSpaceError,
    PermissionDeniedError,
    SchemaError,
)
from shmbuffer.ring.container import Plan, Reservation
from shmbuffer.storage import rows
from shmbuffer.storage.stamps import restamp_restored, stamp_reservation
from shmbuffer.wire.protocol import (
    decode_f64,
    encode_i64,
    episode_split,
    payload_sizes,
)

#: A RESERVE record evicts at most two ranges (a wrap).
_RESERVE_BYTES = record_bytes(4 + 2 * 2)

#: Live episodes above which a reserve ``ahead`` that would evict any is not granted: giving
#: one back unused (the writer's next write differs, it idles, flushes or closes) may restore
#: its evictions in O(live episodes) (module docstring), a pause the loop can take at this size.
AHEAD_MAX_LIVE = 65_536


def wire_priority(value: bytes | float | int | None) -> float | np.ndarray | None:
    """A request's ``priority`` field: f64 bytes (one value per item) or one number."""
    if isinstance(value, bytes):
        return decode_f64(value)
    return None if value is None else float(value)


class WriteOps(DaemonState):
    def op_reserve(
        self, client: Client, fields: dict[str, Any], frames: Frames, now: float
    ) -> Reply:
        """Commit what it piggybacks, then reserve. Should the reserve wait, what is parked is
        the request without its commits (``Deferred.retry``, their episodes kept for the
        reply), so a retry does not commit twice; the request itself is never changed."""
        commits = [fields["commit"]] if "commit" in fields else []
        commits += fields.get("commits", [])
        committed: list[int] | None = fields.get("_committed")  # a retry: done before it
        split = episode_split(fields)
        if commits:
            self._checked_priority(fields, split)  # a bad one refuses the request whole
            owned = [self._owned(client, r) for r in commits]
            metas = self._commit_metas(fields, commits)  # the same
            # Room for every record first, so a full disk refuses them all, not some.
            room = sum(commit_bytes(len(r.episodes), client.writer) for r in owned)
            self._journal_room(room + _RESERVE_BYTES)
            committed = [ep for r in commits for ep in self._commit(client, r, meta=metas.get(r))]
        # Reservation 0 says "not now": the writer reserves again, waiting, when its write comes.
        reply: dict[str, Any] = {"reservation": 0, "ranges": []}
        ahead = bool(fields.get("ahead"))
        try:
            if self.bytes is not None:  # compressed columns: their bytes planned first
                self._reserve_packed(client, fields, split, now, reply)
            else:
                plan = self.container.plan(fields["rows"], split, fields.get("tables"))
            if self.bytes is None and (not ahead or self._ahead_cheap_to_return(plan)):
                reservation = self._reserve(client, fields, plan, now)
                reply = {
                    "reservation": reservation.id,
                    "ranges": [list(r) for r in reservation.ranges],
                }
                if fields.get("count", 1) > 1:
                    reply["more"] = self._more_ahead(client, fields, split, now)
        except Deferred as wait:
            if not ahead:
                if not commits:
                    raise
                rest = {k: v for k, v in fields.items() if k not in ("commit", "commits")}
                raise wait.retrying({**rest, "_committed": committed}) from None
            # Asked for ahead of the write that fills it: never parked (it would hold up the
            # writes queued behind it for a write that may never come).
        if committed is not None:
            reply["committed"] = committed
        return reply, []

    def _reserve_packed(
        self,
        client: Client,
        fields: dict[str, Any],
        split: int | list[int],
        now: float,
        reply: dict[str, Any],
    ) -> None:
        """A reserve of a buffer with compressed columns (``daemon/packing.py``): its chunks'
        bytes planned, the episodes they overwrite evicted with the rows, a writer still
        copying chunks there waited for; ``reply`` filled with the rows and the offsets."""
        assert self.bytes is not None
        sizes = self.bytes.check(fields, split if isinstance(split, list) else [0] * split)
        byte_plan, busy = self.bytes.plan(sizes)
        plan = self.container.plan(fields["rows"], split, fields.get("tables"), byte_plan[2])
        plan = self.bytes.with_busy(plan, busy, self.container)
        reservation = self._reserve(client, fields, plan, now)
        offsets = self.bytes.reserve(reservation, byte_plan, self.generations)
        reply["reservation"] = reservation.id
        reply["ranges"] = [list(r) for r in reservation.ranges]
        reply["offsets"] = encode_i64(np.asarray(offsets, np.int64))

    def _more_ahead(
        self, client: Client, fields: dict[str, Any], split: int | list[int], now: float
    ) -> list[Any]:
        """``[id, ranges]`` of up to ``count - 1`` more reservations of the same shape, each
        an ordinary one, granted while nothing would hold them back: one writer's next writes
        reserved with one message (protocol 1.5). The first that cannot be had ends them."""
        more: list[Any] = []
        for _ in range(fields["count"] - 1):
            try:
                plan = self.container.plan(fields["rows"], split, fields.get("tables"))
                if not self._ahead_cheap_to_return(plan):
                    break
                reservation = self._reserve(client, fields, plan, now)
            except (Deferred, LimitExceededError, OutOfSpaceError):
                break
            more.append([reservation.id, [list(r) for r in reservation.ranges]])
        return more

    def _ahead_cheap_to_return(self, plan: Plan) -> bool:
        """Whether a reserve ``ahead`` may be granted: not if it would evict episodes of a
        registry of more than AHEAD_MAX_LIVE, whose abort (should it go unused) would stall
        the loop rebuilding the registry. One that evicts nothing (a ring not yet full) costs
        nothing to give back."""
        registry = self.container.registry
        if len(registry) <= AHEAD_MAX_LIVE:
            return True
        return not any(registry.overlapping(start, stop) for start, stop in plan.evict)

    def _reserve(
        self, client: Client, fields: dict[str, Any], plan: Plan, now: float, pin: bool = True
    ) -> Reservation:
        """Carry out ``plan`` (``fields``' rows, planned against the ring as it is) for
        ``client``, or raise Deferred having changed nothing; ``pin``: pinned to its process
        where the transport vouches for one (False: the daemon copies the rows itself)."""
        if self.segment is None:
            raise SchemaError("the buffer has no schema yet: send 'define_schema' first")
        if len(client.reservations) >= self.config.max_reservations_per_client:
            raise LimitExceededError(
                f"client {client.id} holds {len(client.reservations)} open reservations "
                f"(limit {self.config.max_reservations_per_client}); commit or abort some"
            )
        priority = self._checked_priority(fields, plan.lengths)  # before anything is evicted
        deadline = now + fields.get("timeout_ms", 30_000) / 1000
        evict = plan.evict
        leased = len(self.leases) and self.leases.pinned(  # no lease, no lookup: the hot path
            ep.id for s, e in evict for ep in self.container.registry.overlapping(s, e)
        )
        if leased:
            raise Deferred(f"rows are leased by readers (episodes {leased[:5]})", deadline)
        if plan.busy:  # the ring lapped a writer that is still copying (or stalled: pins.py)
            raise Deferred(
                f"rows are still being written by {self._writers(plan.busy, now)}", deadline
            )
        if plan.blocked is not None:  # the rate limiter, or unconsumed FIFO rows: wait
            raise Deferred(
                f"cannot reserve {plan.num_rows} rows now: {plan.blocked}", deadline, "insert"
            )
        self._save_for_checkpoint(plan.ranges, deadline)  # a running checkpoint's rows first
        process = client.process if pin and not client.remote else None
        split = plan.lengths if plan.episodes > 1 and len(set(plan.lengths)) > 1 else None
        room = reserve_bytes(len(evict))
        if process is not None:  # the pin's fields too: its ranges, split and tables
            room += 8 * (6 + 2 * len(plan.ranges) + (0 if split is None else len(split)))
        self._journal_room(room)  # OutOfSpaceError: nothing done
        reservation = self.container.reserve(plan, owner=client.id)
        if priority is not None:
            self._priorities[reservation.id] = priority
        held = None
        if process is not None:
            tables = self.container.members_mask(plan.members)
            held = Pin(reservation.id, process, reservation.ranges, split or plan.episodes, tables)
            self.pins.add(held)
        self._journal_reserve(evict, held)  # before the reply hands out the rows
        stamp_reservation(self.generations, reservation.ranges)  # one stamp: storage/stamps.py
        reservation.deadline = now + self.config.reservation_ttl
        client.reservations.add(reservation.id)
        return reservation

    def _commit_metas(self, fields: dict[str, Any], commits: list[int]) -> dict[int, Any]:
        """A reserve's ``metas`` (``[reservation, meta]`` pairs of the commits it carries),
        each checked (InvalidArgumentError naming the name: nothing is committed)."""
        metas: dict[int, Any] = {}
        for reservation, meta in fields.get("metas", ()):
            if reservation not in commits:
                raise InvalidArgumentError(
                    f"field 'metas': reservation {reservation} is not among the commits this "
                    f"reserve carries ({commits})"
                )
            metas[reservation] = self.meta.check(meta)
        return metas

    def _checked_priority(self, fields: dict[str, Any], split: int | list[int]) -> Any:
        """A reserve's or write's ``priority`` as the commit will store it (None: none given);
        InvalidArgumentError if negative, NaN, of the wrong length or for a sampler without
        priorities."""
        if "priority" not in fields:
            return None
        return self.container.check_priority(
            fields["rows"], split, wire_priority(fields["priority"])
        )

    def _writers(self, busy: list[Reservation], now: float) -> str:
        """Who holds ``busy`` reservations, for the reason a lapping writer waits."""
        names = []
        for reservation in busy[:3]:
            held = self.pins.get(reservation.id)
            if held is not None:
                late = now - reservation.deadline
                name = held.describe()
                if held.orphaned is not None:
                    name += ", its connection gone, the process alive"
                elif late > 0:
                    name += f", stalled {late:.1f}s past its reservation TTL"
            else:
                owner = self.clients.by_id(reservation.owner)
                pid = "?" if owner is None else owner.pid
                name = f"writer pid {pid} (reservation {reservation.id})"
            names.append(name)
        more = f" and {len(busy) - 3} more" if len(busy) > 3 else ""
        return "; ".join(names) + more

    def _owned(self, client: Client, reservation_id: int) -> Reservation:
        reservation = self.container.reservations.get(reservation_id)
        if reservation is None:
            raise NotFoundError(
                f"no open reservation {reservation_id} (committed, aborted, or expired)"
            )
        if reservation.owner != client.id:
            held = self.pins.get(reservation_id)
            if held is None or held.orphaned is None or held.process != client.process:
                raise PermissionDeniedError(
                    f"reservation {reservation_id} belongs to another client"
                )
            # Pinned to this client's process, whose earlier connection is gone: its own.
            reservation.owner = client.id
            held.orphaned = None
            client.reservations.add(reservation_id)
        return reservation

    def _commit(
        self,
        client: Client,
        reservation_id: int,
        priority: Any = None,
        meta: dict[str, Any] | None = None,
    ) -> list[int]:
        """Publish a reservation's episodes with ``priority`` and ``meta`` (checked already:
        ``EpisodeMeta.check``), the writer and the commit time."""
        reservation = self._owned(client, reservation_id)
        if priority is None:  # what its reserve (or write) gave, if anything
            priority = self._priorities.get(reservation_id)
        # A writer's priorities are checked first (invalid_argument: nothing done) and go to
        # the journal as a PRIORITY record after the COMMIT, so a resume sets them again.
        given = self.container.commit_priorities(reservation.id, priority)
        # every table keeping priorities stores them (Container.commit): one record each
        keeping = [] if given is None else self._prioritized()
        extra = 0 if given is None else len(keeping) * record_bytes(2 + 2 * given.rows.size)
        # A commit the journal cannot hold is refused (out_of_space), never acknowledged: the
        # reservation stays open, so the writer may retry once there is room.
        writer = client.writer
        payload = meta_payload(meta) if meta else None
        if payload is not None:
            extra += meta_bytes(len(reservation.episodes), payload)
        self._journal_room(commit_bytes(len(reservation.episodes), writer) + extra)
        self.meta.next_writer = writer  # recorded by the commit itself
        try:
            ids = self.container.commit(reservation.id, priority)
        finally:
            self.meta.next_writer = None  # a refused commit must not hand it to the next
        if meta:
            self.meta.attach(ids, meta)  # cannot fail: checked
        self._priorities.pop(reservation_id, None)
        self.pins.pop(reservation_id)  # the COMMIT record of its episodes ends it on replay
        client.reservations.discard(reservation.id)
        self.counters.rows_committed += reservation.num_rows
        client.rows_committed += reservation.num_rows
        self.counters.episodes_committed += reservation.num_episodes  # not the entries
        tables = self.container.members_mask(reservation.members)
        self._journal_commit(  # before the reply acknowledges it
            ids, reservation.episodes, tables, self.meta.last_commit_time, writer, payload
        )
        if given is not None and self.journal is not None:
            for index in keeping:
                self.journal.append_priorities(given.rows, given.priority, index)
        return ids

    def _prioritized(self) -> list[int]:
        """The places of the tables that keep priorities (the journal names each)."""
        tables = self.container.tables.values()
        return [i for i, t in enumerate(tables) if t.sampler.has_priorities]

    def op_commit(
        self, client: Client, fields: dict[str, Any], frames: Frames, now: float
    ) -> Reply:
        priority = wire_priority(fields.get("priority"))  # replaces what the reserve gave
        meta = self.meta.check(fields["meta"]) if "meta" in fields else None
        return {"episodes": self._commit(client, fields["reservation"], priority, meta)}, []

    def op_abort(self, client: Client, fields: dict[str, Any], frames: Frames, now: float) -> Reply:
        self._abort(client, self._owned(client, fields["reservation"]), fields.get("written"))
        return {}, []

    def _abort(self, client: Client | None, reservation: Reservation, written: int | None) -> None:
        """Abort; with ``written`` (rows the writer's copy may have touched) what the
        reservation evicted from untouched rows is published again, and journaled."""
        if client is not None:
            client.reservations.discard(reservation.id)
        if self.bytes is not None:
            # Its writer may have copied chunks over the bytes of what it evicted: nothing
            # comes back (daemon/packing.py).
            self.bytes.abort(reservation.id)
            written = None
        self._priorities.pop(reservation.id, None)
        pinned = self.pins.pop(reservation.id) is not None
        if (written is not None or pinned) and self.journal is not None:
            restorable = len(reservation.evicted) + len(reservation.trimmed)
            room = record_bytes(1) if pinned else 0
            room += 0 if written is None else record_bytes(3 + 3 * restorable)
            try:
                self.journal.reserve(room)
            except OutOfSpaceError:
                # No room to journal it: keep them evicted, as before; a pin not ended in the
                # journal is held again by a resume only while its writer lives.
                written, pinned = None, False
            if pinned:
                self.journal.append_abort(reservation.id)
        c = self.container
        before = (c.pointer, c.rows_written)
        restored = c.abort(reservation.id, written)
        if restored:  # each episode's rows one stamp again (storage/stamps.py)
            restamp_restored(self.generations, [(e.start, e.end) for e in restored], c.ring.tail)
        if (restored or before != (c.pointer, c.rows_written)) and self.journal is not None:
            self.journal.append_restore(restored, c.pointer, c.rows_written)

    def op_write(self, client: Client, fields: dict[str, Any], frames: Frames, now: float) -> Reply:
        """A remote writer's rows arrive as frames; the daemon does the copy."""
        if self.bytes is not None:
            raise SchemaError(
                f"column {self.bytes.names} is stored compressed: its chunks are copied "
                "into bytes.bin by a local Writer, which a remote writer cannot do"
            )
        size = payload_sizes(frames)
        expected = fields["rows"] * (0 if self.schema is None else self.schema.row_nbytes)
        limit = self.config.max_payload_bytes
        if max(size, expected) > limit:
            raise LimitExceededError(
                f"op 'write': a payload of {max(size, expected):,} bytes "
                f"({fields['rows']:,} rows) exceeds the limit max_payload_bytes={limit:,}; "
                "write fewer rows per call"
            )
        leaves = self._leaves_from_frames(fields["rows"], frames)
        meta = self.meta.check(fields["meta"]) if "meta" in fields else None
        plan = self.container.plan(fields["rows"], episode_split(fields), fields.get("tables"))
        # Room for both records first (a sub-episode across the wrap is two), and for its
        # priorities (at most one per row): a full disk refuses the write whole, never after
        # its rows were copied.
        records = len(self._prioritized())
        extra = records * record_bytes(2 + 2 * fields["rows"]) if "priority" in fields else 0
        if meta:
            extra += meta_bytes(plan.episodes + 1, meta_payload(meta))
        self._journal_room(_RESERVE_BYTES + commit_bytes(plan.episodes + 1, client.writer) + extra)
        reservation = self._reserve(client, fields, plan, now, pin=False)
        assert self.segment is not None
        with rows.Progress(functools.partial(self._abort, client, reservation)) as progress:
            rows.write(
                self.segment.columns, self.segment.arrays, reservation.ranges, leaves, 0, progress
            )
        return {"episodes": self._commit(client, reservation.id, meta=meta)}, []

    def _leaves_from_frames(self, num_rows: int, frames: Frames) -> dict[Any, Any]:
        if self.schema is None:
            raise SchemaError("the buffer has no schema yet: send 'define_schema' first")
        fields = self.schema.fields
        if len(frames) != len(fields):
            raise SchemaError(
                f"expected {len(fields)} payload frames (one per key: "
                f"{['.'.join(f.key) for f in fields]}), got {len(frames)}"
            )
        leaves = {}
        for f, frame in zip(fields, frames, strict=True):
            expected = num_rows * f.row_nbytes
            if len(frame) != expected:
                raise SchemaError(
                    f"key {'.'.join(f.key)!r}: payload of {len(frame)} bytes, expected "
                    f"{expected} ({num_rows} rows of {f.dtype} {list(f.shape)})"
                )
            array = np.frombuffer(frame, dtype=np.uint8)
            leaves[f.key] = rows.from_bytes(array, f.dtype, (num_rows, *f.shape))
        return leaves
