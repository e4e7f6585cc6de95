"""The daemon's state and what each request does to it, with no sockets in sight.

:class:`BufferService` owns the container (ring, registry, reservations), the shared segment,
the per-row generation stamps, leases and client records. The server feeds it validated
requests one at a time; a handler either returns reply fields (plus payload frames for remote
clients), raises a :class:`~shmbuffer.errors.ShmBufferError` that becomes an error reply, or
raises :class:`Deferred` when the request must wait (a reservation that would evict leased
episodes), in which case the server retries it later.

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
from shmbuffer.container import Container, Reservation
from shmbuffer.daemon.clients import Client, ClientTable
from shmbuffer.daemon.config import DaemonConfig
from shmbuffer.daemon.journal import Journal, container_state, record_bytes, restore_container
from shmbuffer.daemon.leases import LeaseTable
from shmbuffer.daemon.security import segment_access
from shmbuffer.daemon.stats import Counters, RateMeter
from shmbuffer.errors import (
    LimitExceededError,
    NotFoundError,
    OutOfSpaceError,
    PermissionDeniedError,
    SchemaError,
    UnknownClientError,
)
from shmbuffer.protocol import PROTOCOL_VERSION, encode_i64, episode_split, payload_sizes
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
    """The request cannot proceed yet; retry it until ``deadline`` (monotonic seconds)."""

    def __init__(self, reason: str, deadline: float) -> None:
        super().__init__(reason)
        self.deadline = deadline


#: A RESERVE record evicts at most two ranges (a wrap).
_RESERVE_BYTES = record_bytes(4 + 2 * 2)


def _commit_bytes(reservation: Reservation) -> int:
    return record_bytes(3 + 3 * len(reservation.episodes))


class BufferService:
    def __init__(self, config: DaemonConfig, segment: Segment | None = None) -> None:
        self.config = config
        if segment is None and config.schema is not None:
            # before any per-row allocation below
            check_fits(
                config.name, Schema.from_spec(config.schema), config.capacity, config.storage_dir
            )
        try:
            self.container = Container(config.capacity, mode=config.mode, unit=config.unit)
        except MemoryError:
            raise OutOfSpaceError(
                f"capacity {config.capacity:,} rows: the daemon cannot allocate its per-row "
                f"bookkeeping (about {12 * config.capacity:,} bytes of memory)"
            ) from None
        self.leases = LeaseTable(config.lease_ttl)
        self.clients = ClientTable(config.max_clients, config.client_idle_ttl)
        self.counters = Counters()
        self.started = time.time()
        self._rng = np.random.default_rng(config.seed)
        self.rates = RateMeter()
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
            "release": self.op_release,
            "renew": self.op_renew,
            "clear": self.op_clear,
            "shutdown": self.op_shutdown,
            "checkpoint": self.op_checkpoint,
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
        }

    # -- dispatch ---------------------------------------------------------------------------

    def handle(
        self, identity: bytes, op: str, fields: dict[str, Any], frames: Frames, now: float
    ) -> Reply:
        """Run one validated request (``protocol.validate_request``) of ``identity``."""
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
        _, evict = self.container.plan(num_rows, num_sub)
        deadline = now + fields.get("timeout_ms", 30_000) / 1000
        leased = len(self.leases) and self.leases.pinned(  # no lease, no lookup: the hot path
            ep.id for s, e in evict for ep in self.container.registry.overlapping(s, e)
        )
        if leased:
            raise Deferred(f"rows are leased by readers (episodes {leased[:5]})", deadline)
        if self.container.conflicts(evict):  # the ring lapped a writer that is still copying
            raise Deferred("rows are still being written by another writer", deadline)
        self._journal_room(record_bytes(4 + 2 * len(evict)))  # OutOfSpaceError: nothing done
        reservation = self.container.reserve(num_rows, num_sub, owner=client.id)
        self._journal_reserve(evict)  # before the reply hands out the rows
        for start, stop in reservation.ranges:
            self.generations[start:stop] += 1
        reservation.deadline = now + self.config.reservation_ttl
        client.reservations.add(reservation.id)
        return reservation

    def _owned(self, client: Client, reservation_id: int) -> Reservation:
        reservation = self.container.reservations.get(reservation_id)
        if reservation is None:
            raise NotFoundError(
                f"no open reservation {reservation_id} (committed, aborted, or expired)"
            )
        if reservation.owner != client.id:
            raise PermissionDeniedError(f"reservation {reservation_id} belongs to another client")
        return reservation

    def _commit(self, client: Client, reservation_id: int) -> list[int]:
        reservation = self._owned(client, reservation_id)
        # A commit the journal cannot hold is refused (out_of_space), never acknowledged: the
        # reservation stays open, so the writer may retry once there is room.
        self._journal_room(_commit_bytes(reservation))
        ids = self.container.commit(reservation.id)
        client.reservations.discard(reservation.id)
        self.counters.rows_committed += reservation.num_rows
        self.counters.episodes_committed += len(ids)
        self._journal_commit(ids, reservation.episodes)  # before the reply acknowledges it
        return ids

    def op_commit(
        self, client: Client, fields: dict[str, Any], frames: Frames, now: float
    ) -> Reply:
        return {"episodes": self._commit(client, fields["reservation"])}, []

    def op_abort(self, client: Client, fields: dict[str, Any], frames: Frames, now: float) -> Reply:
        self._abort(client, self._owned(client, fields["reservation"]), fields.get("written"))
        return {}, []

    def _abort(self, client: Client, reservation: Reservation, written: int | None) -> None:
        """Abort; with ``written`` (rows the writer's copy may have touched) what the
        reservation evicted from untouched rows is published again, and journaled."""
        client.reservations.discard(reservation.id)
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
        # Room for both records first (a sub-episode across the wrap is two): a full disk
        # refuses the write whole, never after its rows were copied.
        self._journal_room(_RESERVE_BYTES + record_bytes(3 + 3 * (episodes + 1)))
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
        if "release" in fields:
            self.leases.release(fields["release"], client.id)
        kind, n = fields["kind"], fields["n"]
        registry = self.container.registry
        reply: dict[str, Any] = {}
        if kind == "rows":
            self._check_sample_size(n, fields)
            physical = registry.sample_rows(n, self._rng)
            reply["rows"] = encode_i64(physical)
        elif kind == "slices":
            length = fields["length"]  # validation made sure of it
            self._check_sample_size(n * length, fields)
            starts = registry.sample_slices(n, length, self._rng)
            physical = rows.slice_rows(starts, length)
            reply["starts"] = encode_i64(starts)
        else:
            ids, starts, ends = registry.sample_episodes(n, self._rng)
            lengths = ends - starts
            self._check_sample_size(int(lengths.sum()), fields)
            physical = rows.episode_rows(starts, lengths)
            reply.update(
                ids=encode_i64(ids), starts=encode_i64(starts), lengths=encode_i64(lengths)
            )
            if fields.get("lease", False) and not fields.get("payload", False):
                held = self.leases.count_owner(client.id)
                if held >= self.config.max_leases_per_client:
                    raise LimitExceededError(
                        f"client {client.id} holds {held} leases (limit max_leases_per_client="
                        f"{self.config.max_leases_per_client}); release some"
                    )
                reply["lease"] = self.leases.grant(client.id, ids.tolist(), now).id
        self.container.count_use(physical)
        self.counters.samples += 1
        self.counters.rows_sampled += len(physical)
        if fields.get("payload", False):  # remote reader: the daemon copies the rows out
            assert self.segment is not None
            data = rows.gather_columns(self.segment.columns, physical)
            return reply, [rows.to_bytes(t, t.dtype) for t in data.values()]
        if kind != "episodes":  # leased episodes need no stamps: no writer can reach them
            reply["gens"] = encode_i64(self.generations[physical])
        return reply, []

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
            self.journal.append_reserve(evicted, c.pointer, c.rows_written, c._next_reservation)

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

        state = {
            **self.persistent_state(),
            "name": self.config.name,
            "sampler": {"kind": "uniform", "rng": self._rng.bit_generator.state},
            "rate_limiter": {"kind": "none"},
        }
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
            "reservations": len(container.reservations),
            "reserved_rows": container.reserved_rows,
            "leases": len(self.leases),
            "uptime_s": time.time() - self.started,
            "pid": os.getpid(),
            "protocol": PROTOCOL_VERSION,
            "rate_limiter": {"kind": "none", "min_size": 1},
            **{k: v for k, v in self.counters.__dict__.items()},
        }
