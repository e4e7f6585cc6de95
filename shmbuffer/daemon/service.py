"""The daemon's state and what each request does to it, with no sockets in sight.

:class:`BufferService` owns the container (ring, registry, reservations), the shared segment,
the per-row generation stamps, leases and client records. The server feeds it validated
requests one at a time; a handler either returns reply fields (plus payload frames for remote
clients), raises a :class:`~shmbuffer.errors.ShmBufferError` that becomes an error reply, or
raises :class:`Deferred` when the request must wait (a reservation that would evict leased
episodes, or that the rate limiter or a FIFO sampler's unconsumed rows hold back; a sample the
limiter holds back, or one with nothing to consume yet), in which case the server retries it
later. A handler that defers has changed nothing, or only what it took out of ``fields`` so
that a retry does not do it twice (a piggybacked commit, a lease released first).

Generation stamps make copies provably untorn without a lease: every reservation bumps the
stamp of its rows *before* the writer learns which rows it got, and a sample reply carries the
stamps of the rows it names. A reader that copies those rows and then finds the same stamps
knows no writer touched them meanwhile; a mismatch means "sample again".
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from shmbuffer import rows
from shmbuffer.container import Container, EpisodeSample, Reservation, RowSample, SliceSample
from shmbuffer.daemon.clients import Client, ClientTable
from shmbuffer.daemon.config import DaemonConfig
from shmbuffer.daemon.journal import Journal, container_state, record_bytes, restore_container
from shmbuffer.daemon.leases import LeaseTable
from shmbuffer.daemon.security import segment_access
from shmbuffer.daemon.stats import Counters, RateMeter, client_figures
from shmbuffer.errors import (
    EmptyBufferError,
    InvalidArgumentError,
    LimitExceededError,
    NotFoundError,
    OutOfSpaceError,
    PermissionDeniedError,
    SchemaError,
    TornReadError,
    UnknownClientError,
    WaitTimeoutError,
)
from shmbuffer.protocol import (
    PROTOCOL_VERSION,
    decode_f64,
    decode_i64,
    encode_f64,
    encode_i64,
    episode_split,
    payload_sizes,
)
from shmbuffer.schema import Schema
from shmbuffer.segment import Segment, check_fits

log = logging.getLogger("shmbuffer.daemon")

Frames = list[bytes | memoryview]
#: What a handler returns: the reply's fields (``protocol.REPLIES`` lists them; the tests hold
#: real replies to it) and payload frames (rows for remote clients; usually none).
Reply = tuple[dict[str, Any], Frames]
#: An op of a client that said ``hello``: (its record, validated fields, payload, now).
Handler = Callable[[Client, dict[str, Any], Frames, float], Reply]
#: ``hello`` and ``ping``, which any identity may send: (identity, validated fields, now).
OpenHandler = Callable[[bytes, dict[str, Any], float], Reply]


class Deferred(Exception):
    """The request cannot proceed yet; retry it until ``deadline`` (monotonic seconds).

    ``blocked``: ``"insert"`` or ``"sample"`` when flow control holds it back (the rate
    limiter, or a FIFO sampler), so the time it waits counts in the limiter's figures; None
    for a wait on leases or on another writer."""

    def __init__(self, reason: str, deadline: float, blocked: str | None = None) -> None:
        super().__init__(reason)
        self.deadline = deadline
        self.blocked = blocked


#: A RESERVE record evicts at most two ranges (a wrap).
_RESERVE_BYTES = record_bytes(4 + 2 * 2)


def _commit_bytes(reservation: Reservation) -> int:
    return record_bytes(3 + 3 * len(reservation.episodes))


def wire_priority(value: bytes | float | int | None) -> float | np.ndarray | None:
    """A request's ``priority`` field: f64 bytes (one value per item) or one number."""
    if isinstance(value, bytes):
        return decode_f64(value)
    return None if value is None else float(value)


class BufferService:
    def __init__(self, config: DaemonConfig, segment: Segment | None = None) -> None:
        self.config = config
        if segment is None and config.schema is not None:
            # before any per-row allocation below
            check_fits(
                config.name, Schema.from_spec(config.schema), config.capacity, config.storage_dir
            )
        try:
            self.container = Container(
                config.capacity,
                mode=config.mode,
                unit=config.unit,
                sampler=config.make_sampler(),
                rate_limiter=config.make_rate_limiter(),
                seed=config.seed,
            )
        except MemoryError:
            raise OutOfSpaceError(
                f"capacity {config.capacity:,} rows: the daemon cannot allocate its per-row "
                f"bookkeeping (about {12 * config.capacity:,} bytes of memory)"
            ) from None
        self.leases = LeaseTable(config.lease_ttl)
        self.clients = ClientTable(config.max_clients, config.client_idle_ttl)
        self.counters = Counters()
        self.started = time.time()
        self.rates = RateMeter()
        #: Requests the server holds parked, by queue (it keeps this up to date, for stats).
        self.waiting = {"insert": 0, "sample": 0}
        #: Validated priorities of open reservations, for their commit (``reserve priority``).
        self._priorities: dict[int, Any] = {}
        #: iterate's shuffles are seeded with (this, epoch): every reader's k-th pass agrees,
        #: and agrees with an in-process Buffer of the same seed.
        entropy = np.random.SeedSequence(config.seed).entropy
        self._iterate_seed = int(entropy)  # type: ignore[arg-type]
        #: One handler per op of ``protocol.REQUESTS``, both tables together (an op is its
        #: table entry plus its handler; tests/test_handlers.py checks they match one to one).
        self.open_handlers: dict[str, OpenHandler] = {"hello": self.op_hello, "ping": self.op_ping}
        self.handlers: dict[str, Handler] = {
            "bye": self.op_bye,
            "stats": self.op_stats,
            "define_schema": self.op_define_schema,
            "reserve": self.op_reserve,
            "commit": self.op_commit,
            "abort": self.op_abort,
            "write": self.op_write,
            "sample": self.op_sample,
            "update_priorities": self.op_update_priorities,
            "iterate": self.op_iterate,
            "read": self.op_read,
            "release": self.op_release,
            "renew": self.op_renew,
            "clear": self.op_clear,
            "shutdown": self.op_shutdown,
            "checkpoint": self.op_checkpoint,
            "configure": self.op_configure,
        }
        #: Why admin ops are refused on this daemon's transport (set by the Server from
        #: ``security.admin_refusal``; None: the role is enough, as on the ipc socket).
        self.admin_refused: str | None = None
        self.segment = segment
        self.journal: Journal | None = None  # metadata log for --resume; see journal.py
        self.generations = (
            np.zeros(config.capacity, dtype=np.int64) if segment is None else segment.generations
        )
        if segment is None and config.schema is not None:
            self._create_segment(Schema.from_spec(config.schema))

    # -- segment ----------------------------------------------------------------------------

    @property
    def schema(self) -> Schema | None:
        return None if self.segment is None else self.segment.schema

    def _create_segment(self, schema: Schema) -> None:
        self.segment = Segment.create(
            self.config.name,
            schema,
            self.config.capacity,
            storage_dir=self.config.storage_dir,
            exist_ok=True,
            extra={"unit": self.config.unit, "mode": self.config.mode, "daemon_pid": os.getpid()},
            **segment_access(self.config.group),  # owner-only, or 0660 for --group
        )
        self.generations = self.segment.generations
        try:
            self._start_journal()
        except BaseException:  # no journal, no segment: a later schema must start over
            self.segment.close()
            Segment.unlink(self.config.name, self.config.storage_dir)
            self.segment = None
            raise
        log.info(
            "allocated %s: %d rows x %d bytes = %.1f MB (%s)",
            self.segment.path,
            self.config.capacity,
            schema.row_nbytes,
            self.segment.nbytes / 1e6,
            schema,
        )

    def segment_info(self) -> dict[str, Any] | None:
        if self.segment is None:
            return None
        return {
            "name": self.segment.name,
            "path": str(self.segment.path),
            # the root itself, never None: the default root is per user, so a --group member
            # would look for it in a folder of its own
            "storage_dir": str(self.segment.path.parent),
        }

    def buffer_info(self) -> dict[str, Any]:
        return {
            "name": self.config.name,
            "capacity": self.config.capacity,
            "unit": self.config.unit,
            "mode": self.config.mode,
            "schema": None if self.schema is None else self.schema.to_spec(),
            "segment": self.segment_info(),
            "lease_ttl": self.config.lease_ttl,
            "reservation_ttl": self.config.reservation_ttl,
            "max_payload_bytes": self.config.max_payload_bytes,
            "sampler": self.container.sampler.name,
            "max_times_sampled": self.container.sampler.max_times_sampled,
        }

    # -- dispatch ---------------------------------------------------------------------------

    def handle(
        self,
        identity: bytes,
        op: str,
        fields: dict[str, Any],
        frames: Frames,
        now: float,
        retry: bool = False,
    ) -> Reply:
        """Run one validated request (``protocol.validate_request``) of ``identity``;
        ``retry``: a parked request tried again (not counted as another message)."""
        if not retry:
            self.counters.messages += 1
        open_handler = self.open_handlers.get(op)
        if open_handler is not None:
            return open_handler(identity, fields, now)
        client = self.clients.get(identity)
        if client is None:
            raise UnknownClientError(
                f"op {op!r} from a client this daemon does not know: say 'hello' first (the "
                "daemon restarted, or forgot a client that held nothing after "
                f"{self.config.client_idle_ttl:.0f}s of silence); reconnect"
            )
        client.last_seen = now
        return self.handlers[op](client, fields, frames, now)

    # -- clients ----------------------------------------------------------------------------

    def op_hello(self, identity: bytes, fields: dict[str, Any], now: float) -> Reply:
        if identity not in self.clients and self.clients.full:
            self._reap(now)  # make room from clients that died without a 'bye'
        remote = fields.get("remote", False)
        client = self.clients.hello(
            identity, fields["role"], fields["pid"], fields["host"], remote, now
        )
        return {"client": client.id, "buffer": self.buffer_info(), "daemon_pid": os.getpid()}, []

    def op_ping(self, identity: bytes, fields: dict[str, Any], now: float) -> Reply:
        return {"pid": os.getpid(), "protocol": PROTOCOL_VERSION}, []

    def forget(self, identity: bytes) -> None:
        """Drop a client with everything it holds: its reservations are aborted (their rows
        were never published), its leases released."""
        client = self.clients.pop(identity)
        if client is None:
            return
        for rid in list(client.reservations):
            self.container.abort(rid)
            self._priorities.pop(rid, None)
        self.leases.release_owner(client.id)
        log.info("client %d (pid %d) gone", client.id, client.pid)

    def op_bye(self, client: Client, fields: dict[str, Any], frames: Frames, now: float) -> Reply:
        self.forget(client.identity)
        return {}, []

    def op_stats(self, client: Client, fields: dict[str, Any], frames: Frames, now: float) -> Reply:
        return {"stats": self.stats(now)}, []

    def op_define_schema(
        self, client: Client, fields: dict[str, Any], frames: Frames, now: float
    ) -> Reply:
        try:
            schema = Schema.from_spec(fields["schema"])
        except RecursionError:  # msgpack allows ~1000 levels; the spec walk does not
            raise SchemaError("schema spec: keys nested too deeply") from None
        if self.schema is None:
            self._create_segment(schema)
        elif schema != self.schema:
            raise SchemaError(f"the buffer's schema is {self.schema}, this writer's is {schema}")
        return {"buffer": self.buffer_info()}, []

    # -- writing ----------------------------------------------------------------------------

    def op_reserve(
        self, client: Client, fields: dict[str, Any], frames: Frames, now: float
    ) -> Reply:
        if "commit" in fields:  # commit the previous episode in the same round trip; kept
            # out of ``fields`` so a deferred retry does not commit twice
            self._checked_priority(fields)  # a bad one refuses the request whole, commit too
            reservation = self._owned(client, fields["commit"])
            # Room for both records first, so a full disk refuses the pair, not half of it.
            self._journal_room(_commit_bytes(reservation) + _RESERVE_BYTES)
            fields["_committed"] = self._commit(client, fields.pop("commit"))
        reservation = self._reserve(client, fields, now)
        reply = {"reservation": reservation.id, "ranges": [list(r) for r in reservation.ranges]}
        if "_committed" in fields:
            reply["committed"] = fields["_committed"]
        return reply, []

    def _reserve(self, client: Client, fields: dict[str, Any], now: float) -> Reservation:
        if self.segment is None:
            raise SchemaError("the buffer has no schema yet: send 'define_schema' first")
        if len(client.reservations) >= self.config.max_reservations_per_client:
            raise LimitExceededError(
                f"client {client.id} holds {len(client.reservations)} open reservations "
                f"(limit {self.config.max_reservations_per_client}); commit or abort some"
            )
        num_rows, num_sub = fields["rows"], episode_split(fields)
        priority = self._checked_priority(fields)  # refused before anything is evicted
        _, evict = self.container.plan(num_rows, num_sub)
        deadline = now + fields.get("timeout_ms", 30_000) / 1000
        leased = len(self.leases) and self.leases.pinned(  # no lease, no lookup: the hot path
            ep.id for s, e in evict for ep in self.container.registry.overlapping(s, e)
        )
        if leased:
            raise Deferred(f"rows are leased by readers (episodes {leased[:5]})", deadline)
        if self.container.conflicts(evict):  # the ring lapped a writer that is still copying
            raise Deferred("rows are still being written by another writer", deadline)
        # The rate limiter, or a FIFO sampler whose rows are not consumed yet: wait for readers.
        blocked = self.container.insert_blocker(num_rows, num_sub)
        if blocked is not None:
            raise Deferred(f"cannot reserve {num_rows} rows now: {blocked}", deadline, "insert")
        self._journal_room(record_bytes(4 + 2 * len(evict)))  # OutOfSpaceError: nothing done
        reservation = self.container.reserve(num_rows, num_sub, owner=client.id)
        if priority is not None:
            self._priorities[reservation.id] = priority
        self._journal_reserve(evict)  # before the reply hands out the rows
        for start, stop in reservation.ranges:
            self.generations[start:stop] += 1
        reservation.deadline = now + self.config.reservation_ttl
        client.reservations.add(reservation.id)
        return reservation

    def _checked_priority(self, fields: dict[str, Any]) -> Any:
        """A reserve's or write's ``priority`` as the commit will store it (None: none given);
        InvalidArgumentError if negative, NaN, of the wrong length or for a sampler without
        priorities."""
        if "priority" not in fields:
            return None
        return self.container.check_priority(
            fields["rows"], episode_split(fields), wire_priority(fields["priority"])
        )

    def _owned(self, client: Client, reservation_id: int) -> Reservation:
        reservation = self.container.reservations.get(reservation_id)
        if reservation is None:
            raise NotFoundError(
                f"no open reservation {reservation_id} (committed, aborted, or expired)"
            )
        if reservation.owner != client.id:
            raise PermissionDeniedError(f"reservation {reservation_id} belongs to another client")
        return reservation

    def _commit(self, client: Client, reservation_id: int, priority: Any = None) -> list[int]:
        reservation = self._owned(client, reservation_id)
        if priority is None:  # what its reserve (or write) gave, if anything
            priority = self._priorities.get(reservation_id)
        # A writer's priorities are checked first (invalid_argument: nothing done) and go to
        # the journal as a PRIORITY record after the COMMIT, so a resume sets them again.
        given = self.container.commit_priorities(reservation.id, priority)
        extra = 0 if given is None else record_bytes(1 + 2 * given.rows.size)
        # A commit the journal cannot hold is refused (out_of_space), never acknowledged: the
        # reservation stays open, so the writer may retry once there is room.
        self._journal_room(_commit_bytes(reservation) + extra)
        ids = self.container.commit(reservation.id, priority)
        self._priorities.pop(reservation_id, None)
        client.reservations.discard(reservation.id)
        self.counters.rows_committed += reservation.num_rows
        client.rows_committed += reservation.num_rows
        self.counters.episodes_committed += len(ids)
        self._journal_commit(ids, reservation.episodes)  # before the reply acknowledges it
        if given is not None and self.journal is not None:
            self.journal.append_priorities(given.rows, given.priority)
        return ids

    def op_commit(
        self, client: Client, fields: dict[str, Any], frames: Frames, now: float
    ) -> Reply:
        priority = wire_priority(fields.get("priority"))  # replaces what the reserve gave
        return {"episodes": self._commit(client, fields["reservation"], priority)}, []

    def op_abort(self, client: Client, fields: dict[str, Any], frames: Frames, now: float) -> Reply:
        self._abort(client, self._owned(client, fields["reservation"]), fields.get("written"))
        return {}, []

    def _abort(self, client: Client, reservation: Reservation, written: int | None) -> None:
        """Abort; with ``written`` (rows the writer's copy may have touched) what the
        reservation evicted from untouched rows is published again, and journaled."""
        client.reservations.discard(reservation.id)
        self._priorities.pop(reservation.id, None)
        if written is not None and self.journal is not None:
            restorable = len(reservation.evicted) + len(reservation.trimmed)
            try:
                self.journal.reserve(record_bytes(3 + 3 * restorable))
            except OutOfSpaceError:
                written = None  # no room to journal it: keep them evicted, as before
        c = self.container
        before = (c.pointer, c.rows_written)
        restored = c.abort(reservation.id, written)
        if (restored or before != (c.pointer, c.rows_written)) and self.journal is not None:
            self.journal.append_restore(restored, c.pointer, c.rows_written)

    def op_write(self, client: Client, fields: dict[str, Any], frames: Frames, now: float) -> Reply:
        """A remote writer's rows arrive as frames; the daemon does the copy."""
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
        num_sub = episode_split(fields)
        episodes = num_sub if isinstance(num_sub, int) else len(num_sub)
        # Room for both records first (a sub-episode across the wrap is two), and for its
        # priorities (at most one per row): a full disk refuses the write whole, never after
        # its rows were copied.
        extra = record_bytes(1 + 2 * fields["rows"]) if "priority" in fields else 0
        self._journal_room(_RESERVE_BYTES + record_bytes(3 + 3 * (episodes + 1)) + extra)
        reservation = self._reserve(client, fields, now)
        assert self.segment is not None
        with rows.Progress(functools.partial(self._abort, client, reservation)) as progress:
            rows.write(
                self.segment.columns, self.segment.arrays, reservation.ranges, leaves, 0, progress
            )
        return {"episodes": self._commit(client, reservation.id)}, []

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

    # -- reading ----------------------------------------------------------------------------

    def op_sample(
        self, client: Client, fields: dict[str, Any], frames: Frames, now: float
    ) -> Reply:
        if "release" in fields:  # applied once, even if the sample is then deferred
            self.leases.release(fields.pop("release"), client.id)
        deadline = now + fields.get("timeout_ms", 30_000) / 1000
        try:
            return self._sample(client, fields, now)
        except WaitTimeoutError as exc:  # the rate limiter refuses it now: wait in the daemon
            raise Deferred(str(exc), deadline, "sample") from None
        except EmptyBufferError as exc:
            # A FIFO or consume-once sampler with nothing to hand out waits for writers; an
            # empty buffer under any other sampler is an error at once, as it always was.
            if not self._waits_for_data():
                raise
            raise Deferred(f"nothing to consume yet: {exc}", deadline, "sample") from None

    def _waits_for_data(self) -> bool:
        sampler = self.container.sampler
        return sampler.name == "fifo" or sampler.max_times_sampled is not None

    def _sample(self, client: Client, fields: dict[str, Any], now: float) -> Reply:
        """Draw through the container's sampler (which counts the reads and tells the limiter),
        as in the in-process Buffer; every size limit is checked before the draw, since a
        consume-once sampler hands its items out for good."""
        kind, n, beta = fields["kind"], fields["n"], fields.get("beta")
        c = self.container
        reply: dict[str, Any] = {}
        drawn: RowSample | SliceSample | EpisodeSample
        leased = fields.get("lease", False) and not fields.get("payload", False)
        held = self.leases.count_owner(client.id) if leased else 0
        if held >= self.config.max_leases_per_client:
            raise LimitExceededError(
                f"client {client.id} holds {held} leases (limit max_leases_per_client="
                f"{self.config.max_leases_per_client}); release some"
            )
        if kind == "rows":
            self._check_sample_size(n, fields)
            drawn = c.sample_rows(n, beta=beta)
            physical = index = drawn.rows
            reply["rows"] = encode_i64(physical)
        elif kind == "slices":
            length = fields["length"]  # validation made sure of it
            self._check_sample_size(n * length, fields)
            strict = fields.get("strict", True)
            sliced = c.sample_slices(n, length, strict=strict, beta=beta)
            drawn, physical, index = sliced, sliced.rows, sliced.starts
            reply["starts"] = encode_i64(sliced.starts)
            if not strict:  # a padded slice's real rows: a prefix of its length
                reply["lengths"] = encode_i64(sliced.lengths)
        else:
            if c.num_episodes:  # the lengths are known after the draw: judge by the mean
                self._check_sample_size(n * max(1, c.num_rows // c.num_episodes), fields)
            episodes = c.sample_episodes(n, beta=beta)
            ids, index = episodes.ids, episodes.starts
            drawn, physical = episodes, episodes.rows
            if not self._waits_for_data():  # drawn for good otherwise: never refuse them now
                self._check_sample_size(physical.size, fields)
            reply.update(
                ids=encode_i64(ids),
                starts=encode_i64(index),
                lengths=encode_i64(episodes.ends - index),
            )
            if leased:
                reply["lease"] = self.leases.grant(client.id, ids.tolist(), now).id
        if leased and kind != "episodes":
            # The episodes holding the rows, pinned until the reader's copy is done: what a
            # consume-once sampler hands out may be overwritten the moment it is consumed
            # (the writer waiting for it is retried at once), before the reader copied it.
            reply["lease"] = self.leases.grant(client.id, self._holding(physical), now).id
        if fields.get("info", False):  # per item: its physical (first) row and its stamp
            reply.update(
                index=encode_i64(index),
                generation=encode_i64(self.generations[index]),
                probability=encode_f64(drawn.probability),
                weight=encode_f64(drawn.weight),
            )
        self.counters.samples += 1
        self.counters.rows_sampled += len(physical)
        client.rows_sampled += len(physical)
        if fields.get("payload", False):  # remote reader: the daemon copies the rows out
            assert self.segment is not None
            data = rows.gather_columns(self.segment.columns, physical)
            return reply, [rows.to_bytes(t, t.dtype) for t in data.values()]
        if kind != "episodes":  # leased episodes need no stamps: no writer can reach them
            reply["gens"] = encode_i64(self.generations[physical])
        return reply, []

    def _holding(self, physical: np.ndarray) -> list[int]:
        """Ids of the episodes holding ``physical`` rows (one registry query per run of
        consecutive rows: a FIFO's rows and a slice are runs)."""
        order = np.unique(physical)
        breaks = np.flatnonzero(np.diff(order) != 1) + 1
        registry = self.container.registry
        ids: set[int] = set()
        for run in np.split(order, breaks) if order.size else []:
            ids.update(ep.id for ep in registry.overlapping(int(run[0]), int(run[-1]) + 1))
        return sorted(ids)

    def _check_sample_size(self, num_rows: int, fields: dict[str, Any]) -> None:
        """Refuse a sample whose reply would exceed ``max_payload_bytes`` before any of it is
        built (rows travel as frames to a remote reader; as indices and stamps otherwise)."""
        per_row = 16  # an index and a generation stamp
        if fields.get("payload", False) and self.schema is not None:
            per_row = self.schema.row_nbytes
        size = num_rows * per_row
        if size > self.config.max_payload_bytes:
            raise LimitExceededError(
                f"op 'sample': {num_rows:,} rows make a reply of {size:,} bytes, over the "
                f"limit max_payload_bytes={self.config.max_payload_bytes:,}; sample fewer rows"
            )

    def update_priorities(self, rows: Any, priority: Any, generation: Any = None) -> int:
        """Set priorities of sampled rows (the ``update_priorities`` op's work): validated
        (invalid_argument, nothing done), rows whose generation stamp changed since the sample
        left out and counted stale, the rest journaled (PRIORITY) before the reply."""
        update = self.container.check_priorities(rows, priority, generation, self.generations)
        self._journal_room(record_bytes(1 + 2 * update.rows.size))
        applied = self.container.apply_priorities(update)
        if self.journal is not None and update.rows.size:
            self.journal.append_priorities(update.rows, update.priority)
        return applied

    def op_update_priorities(
        self, client: Client, fields: dict[str, Any], frames: Frames, now: float
    ) -> Reply:
        generation = fields.get("generation")
        stale = self.container.priority_updates_stale
        updated = self.update_priorities(
            decode_i64(fields["index"]),
            decode_f64(fields["priority"]),
            None if generation is None else decode_i64(generation),
        )
        return {"updated": updated, "stale": self.container.priority_updates_stale - stale}, []

    def op_iterate(
        self, client: Client, fields: dict[str, Any], frames: Frames, now: float
    ) -> Reply:
        """This rank's rows of one pass over everything stored (``Container.rank_rows``),
        with their stamps: the reader copies them batch by batch and checks the stamps."""
        world_size = fields["world_size"]
        total = self.container.num_rows
        share = -(-total // world_size)
        if share * 16 > self.config.max_payload_bytes:
            raise LimitExceededError(
                f"op 'iterate': {share:,} rows per rank make a reply of {share * 16:,} bytes, "
                f"over the limit max_payload_bytes={self.config.max_payload_bytes:,}; use "
                "more ranks"
            )
        physical = self.container.rank_rows(
            fields["rank"],
            world_size,
            shuffle=fields.get("shuffle", True),
            drop_last=fields.get("drop_last", False),
            seed=[self._iterate_seed, fields.get("epoch", 0)],
        )
        self.container.count_use(physical)
        gens = self.generations[physical]
        return {"rows": encode_i64(physical), "gens": encode_i64(gens), "total": total}, []

    def op_read(self, client: Client, fields: dict[str, Any], frames: Frames, now: float) -> Reply:
        """A remote reader's copy of rows it was handed by physical index (``iterate``),
        refused whole (``torn``) if a writer reached any of them since ``gens`` were taken."""
        if self.segment is None:
            raise SchemaError("the buffer has no schema yet: nothing to read")
        physical, gens = decode_i64(fields["rows"]), decode_i64(fields["gens"])
        outside = (physical < 0) | (physical >= self.config.capacity)
        if outside.any():
            raise InvalidArgumentError(
                f"op 'read': row {int(physical[outside][0])} is out of range for a buffer of "
                f"capacity {self.config.capacity}"
            )
        self._check_sample_size(physical.size, {"payload": True})
        moved = self.generations[physical] != gens
        if moved.any():
            raise TornReadError(
                f"op 'read': {int(moved.sum())} of {physical.size} rows were overwritten since "
                f"they were listed (row {int(physical[moved][0])}); iterate over a buffer no "
                "writer is writing to"
            )
        data = rows.gather_columns(self.segment.columns, physical)
        return {}, [rows.to_bytes(t, t.dtype) for t in data.values()]

    def op_release(
        self, client: Client, fields: dict[str, Any], frames: Frames, now: float
    ) -> Reply:
        self.leases.release(fields["lease"], client.id)
        return {}, []

    def op_renew(self, client: Client, fields: dict[str, Any], frames: Frames, now: float) -> Reply:
        """A reader's heartbeat for a lease it still uses: another ``lease_ttl`` from now."""
        self.leases.renew(fields["lease"], client.id, now)
        return {"ttl": self.config.lease_ttl}, []

    def _require_admin(self, client: Client, action: str) -> None:
        """The admin role, and a transport that vouches for it (see ``admin_refused``)."""
        if client.role != "admin":
            raise PermissionDeniedError(f"only an admin client may {action}")
        if self.admin_refused is not None:
            raise PermissionDeniedError(f"refusing to {action}: {self.admin_refused}")

    def op_clear(self, client: Client, fields: dict[str, Any], frames: Frames, now: float) -> Reply:
        self._require_admin(client, "clear the buffer")
        if len(self.leases) or self.container.reservations:
            raise LimitExceededError(
                f"cannot clear while {len(self.leases)} leases and "
                f"{len(self.container.reservations)} reservations are open"
            )
        self._journal_room(record_bytes(1))
        self.container.clear()
        if self.journal is not None:
            self.journal.append_clear(self.container.pointer)
        return {}, []

    def op_shutdown(
        self, client: Client, fields: dict[str, Any], frames: Frames, now: float
    ) -> Reply:
        self._require_admin(client, "shut the daemon down")
        return {}, []

    def op_configure(
        self, client: Client, fields: dict[str, Any], frames: Frames, now: float
    ) -> Reply:
        """Change the rate limiter's settings live (its counts are kept); parked requests
        are retried by the server's next pass under the new settings."""
        self._require_admin(client, "configure the rate limiter")
        limiter = self.container.rate_limiter
        try:
            limiter.configure(**fields)
        except (TypeError, ValueError) as exc:  # nothing was changed
            raise InvalidArgumentError(f"op 'configure': {exc}") from None
        log.warning("rate limiter reconfigured: %s", limiter.blocked_reason())
        if self.journal is not None:  # a resume keeps the new settings
            try:
                self.journal.snapshot(self.persistent_state())
            except (OSError, OutOfSpaceError) as exc:
                log.warning("journal snapshot after configure failed: %s", exc)
        return {"rate_limiter": self.limiter_stats()}, []

    # -- persistence: journal (for --resume) and checkpoints --------------------------------

    def _start_journal(self) -> None:
        assert self.segment is not None
        journal = Journal(self.segment.path)
        journal.start(self.persistent_state(), state_fn=self.persistent_state)
        self.journal = journal  # only once it can take records

    def _journal_room(self, nbytes: int) -> None:
        """Reserve journal space for a request's records before it changes anything, so an
        acknowledged change is always on disk (OutOfSpaceError refuses the request)."""
        if self.journal is not None:
            self.journal.reserve(nbytes)

    def _journal_reserve(self, evicted: list[tuple[int, int]]) -> None:
        if self.journal is not None:
            c = self.container
            self.journal.append_reserve(evicted, c.pointer, c.rows_written, c.next_reservation)

    def _journal_commit(self, ids: list[int], bounds: list[tuple[int, int]]) -> None:
        if self.journal is not None:
            self.journal.append_commit(
                [(i, s, e) for i, (s, e) in zip(ids, bounds, strict=True)],
                self.counters.rows_committed,
                self.counters.episodes_committed,
            )

    def persistent_state(self) -> dict[str, Any]:
        """The container and counters as JSON (what the journal snapshots and checkpoints
        store; open reservations are left out: their rows are never published)."""
        return container_state(self.container, dict(self.counters.__dict__))

    @classmethod
    def from_state(
        cls, config: DaemonConfig, segment: Segment, state: dict[str, Any]
    ) -> BufferService:
        """A service over an existing ``segment`` (resumed or restored) in ``state``; it
        starts a new journal generation at once."""
        service = cls(config, segment)
        restore_container(state, service.container)
        service.counters.restore(state.get("counters", {}))
        service._start_journal()
        return service

    def op_checkpoint(
        self, client: Client, fields: dict[str, Any], frames: Frames, now: float
    ) -> Reply:
        self._require_admin(client, "checkpoint the buffer")
        from shmbuffer.daemon.checkpoint import write_checkpoint

        # The container's state holds the sampler, the rate limiter and the generator.
        state = {**self.persistent_state(), "name": self.config.name}
        use_counts = self.container.use_counts
        return write_checkpoint(self.segment, state, use_counts, fields["to"]), []

    # -- time -------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Expire leases and stale reservations; sample rates for stats."""
        expired = self.leases.expire(now)
        self.counters.leases_expired += len(expired)
        for reservation in list(self.container.reservations.values()):
            if reservation.deadline <= now:
                self.container.abort(reservation.id)
                self._priorities.pop(reservation.id, None)
                self.clients.discard_reservation(reservation.id)
                self.counters.reservations_expired += 1
                log.warning("reservation %d expired uncommitted; rows dropped", reservation.id)
        self.rates.tick(now, self.counters)
        if self.journal is not None and self.journal.needs_snapshot(self.container.num_episodes):
            try:
                self.journal.snapshot(self.persistent_state())  # keeps a resume's replay short
            except (OSError, OutOfSpaceError) as exc:  # a full disk: the journal goes on
                log.warning("journal snapshot failed, retried later: %s", exc)
        if self.clients.sweep_due(now):
            self._reap(now)

    def _reap(self, now: float) -> None:
        """Forget the clients the table finds gone (:meth:`ClientTable.gone`: a local process
        that died, or idle with nothing open), with what they hold (see :meth:`forget`)."""
        for client, why in self.clients.gone(now, self.leases.owners()):
            if why == "died":
                self.counters.clients_reaped += 1
                log.warning(
                    "client %d (%s, pid %d) died holding %d reservations and %d leases; "
                    "its reservations are aborted, its leases released",
                    client.id,
                    client.role,
                    client.pid,
                    len(client.reservations),
                    self.leases.count_owner(client.id),
                )
            else:
                self.counters.clients_expired += 1
                log.info(
                    "client %d (pid %d) idle for %.0fs: forgotten",
                    client.id,
                    client.pid,
                    self.clients.idle_ttl,
                )
            self.forget(client.identity)

    def stats(self, now: float) -> dict[str, Any]:
        insert_rate, sample_rate = self.rates.rates(now, self.counters)
        container = self.container
        return {
            "name": self.config.name,
            "capacity": container.capacity,
            "unit": container.unit,
            "mode": container.mode,
            "rows": container.num_rows,
            "episodes": container.num_episodes,
            "fill": container.num_rows / container.capacity,
            "pointer": container.pointer,
            "schema": None if self.schema is None else self.schema.to_spec(),
            "segment": self.segment_info(),
            "insert_rows_per_s": insert_rate,
            "sample_rows_per_s": sample_rate,
            "writers": self.clients.count_role("writer"),
            "readers": self.clients.count_role("reader"),
            "clients": client_figures(self.clients, self.leases.count_by_owner(), now),
            "reservations": len(container.reservations),
            "reserved_rows": container.reserved_rows,
            "leases": len(self.leases),
            "uptime_s": time.time() - self.started,
            "pid": os.getpid(),
            "protocol": PROTOCOL_VERSION,
            "rate_limiter": self.limiter_stats(),
            "sampler": {
                "kind": container.sampler.name,
                "settings": container.sampler.settings(),
                "figures": container.sampler.stats(),
            },
            **{k: v for k, v in self.counters.__dict__.items()},
            "priority_updates": container.priority_updates,
            "priority_updates_stale": container.priority_updates_stale,
        }

    def limiter_stats(self) -> dict[str, Any]:
        """The rate limiter for ``stats`` and ``configure``: kind, settings, counts, the
        seconds parked requests waited for it, and how many wait now."""
        limiter = self.container.rate_limiter
        settings = limiter.settings()
        return {
            "kind": limiter.name,
            # rows stored before a sample may proceed (without a limiter: the first row)
            "min_size": int(settings.get("min_size", 1)),
            "settings": settings,
            "inserted": limiter.inserted,
            "sampled": limiter.sampled,
            "deleted": limiter.deleted,
            "size": limiter.size,
            "insert_blocked_s": float(limiter.insert_blocked_s),
            "sample_blocked_s": float(limiter.sample_blocked_s),
            "inserts_waiting": self.waiting["insert"],
            "samples_waiting": self.waiting["sample"],
        }

    def record_blocked(self, kind: str, seconds: float) -> None:
        """The server's report: a request flow control held back waited ``seconds``."""
        self.container.rate_limiter.record_blocked(kind, seconds)
