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

import logging
import os
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shmbuffer import rows
from shmbuffer.container import Container, Reservation
from shmbuffer.daemon.config import DaemonConfig
from shmbuffer.daemon.leases import LeaseTable
from shmbuffer.errors import (
    LimitExceededError,
    NotFoundError,
    PermissionDeniedError,
    ProtocolError,
    SchemaError,
)
from shmbuffer.protocol import PROTOCOL_VERSION
from shmbuffer.schema import Schema
from shmbuffer.segment import Segment

log = logging.getLogger("shmbuffer.daemon")

Frames = list[bytes | memoryview]
RATE_WINDOW_S = 3.0


class Deferred(Exception):
    """The request cannot proceed yet; retry it until ``deadline`` (monotonic seconds)."""

    def __init__(self, reason: str, deadline: float) -> None:
        super().__init__(reason)
        self.deadline = deadline


@dataclass
class Client:
    id: int
    role: str
    pid: int
    host: str
    remote: bool
    reservations: set[int] = field(default_factory=set)
    last_seen: float = 0.0

    @property
    def local(self) -> bool:
        return not self.remote and self.host == socket.gethostname()


@dataclass
class Counters:
    rows_committed: int = 0
    episodes_committed: int = 0
    rows_sampled: int = 0
    samples: int = 0
    messages: int = 0
    errors: int = 0
    reservations_expired: int = 0
    leases_expired: int = 0


def _i64(values: np.ndarray) -> bytes:
    return np.ascontiguousarray(values, dtype="<i8").tobytes()


class BufferService:
    def __init__(self, config: DaemonConfig, segment: Segment | None = None) -> None:
        self.config = config
        self.container = Container(config.capacity, mode=config.mode, unit=config.unit)
        self.leases = LeaseTable(config.lease_ttl)
        self.clients: dict[bytes, Client] = {}
        self.counters = Counters()
        self.started = time.time()
        self._rng = np.random.default_rng(config.seed)
        self._next_client = 1
        self._rates: deque[tuple[float, int, int]] = deque(maxlen=11)
        self.segment = segment
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
        )
        self.generations = self.segment.generations
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
            "storage_dir": self.config.storage_dir,
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
        }

    # -- dispatch ---------------------------------------------------------------------------

    def handle(
        self, identity: bytes, op: str, fields: dict[str, Any], frames: Frames, now: float
    ) -> tuple[dict[str, Any], Frames]:
        self.counters.messages += 1
        if op == "hello":
            return self.hello(identity, fields, now), []
        if op == "ping":
            return {"pid": os.getpid(), "protocol": PROTOCOL_VERSION}, []
        client = self.clients.get(identity)
        if client is None:
            raise ProtocolError(f"op {op!r} before 'hello': introduce the client first")
        client.last_seen = now
        handler = getattr(self, f"op_{op}")
        result: tuple[dict[str, Any], Frames] = handler(client, fields, frames, now)
        return result

    # -- clients ----------------------------------------------------------------------------

    def hello(self, identity: bytes, fields: dict[str, Any], now: float) -> dict[str, Any]:
        client = self.clients.get(identity)
        if client is None:
            if len(self.clients) >= self.config.max_clients:
                raise LimitExceededError(f"too many clients ({self.config.max_clients})")
            client = Client(
                self._next_client,
                fields["role"],
                fields["pid"],
                fields["host"],
                fields.get("remote", False),
            )
            self._next_client += 1
            self.clients[identity] = client
            log.info("client %d: %s pid %d on %s", client.id, client.role, client.pid, client.host)
        client.last_seen = now
        return {"client": client.id, "buffer": self.buffer_info(), "daemon_pid": os.getpid()}

    def forget(self, identity: bytes) -> None:
        """Drop a client with everything it holds: its reservations are aborted (their rows
        were never published), its leases released."""
        client = self.clients.pop(identity, None)
        if client is None:
            return
        for rid in list(client.reservations):
            self.container.abort(rid)
        self.leases.release_owner(client.id)
        log.info("client %d (pid %d) gone", client.id, client.pid)

    def op_bye(self, client: Client, fields: dict[str, Any], frames: Frames, now: float) -> Any:
        identity = next(k for k, c in self.clients.items() if c is client)
        self.forget(identity)
        return {}, []

    def op_stats(self, client: Client, fields: dict[str, Any], frames: Frames, now: float) -> Any:
        return {"stats": self.stats(now)}, []

    def op_define_schema(
        self, client: Client, fields: dict[str, Any], frames: Frames, now: float
    ) -> Any:
        schema = Schema.from_spec(fields["schema"])
        if self.schema is None:
            self._create_segment(schema)
        elif schema != self.schema:
            raise SchemaError(f"the buffer's schema is {self.schema}, this writer's is {schema}")
        return {"buffer": self.buffer_info()}, []

    # -- writing ----------------------------------------------------------------------------

    def op_reserve(self, client: Client, fields: dict[str, Any], frames: Frames, now: float) -> Any:
        if "commit" in fields:  # commit the previous episode in the same round trip; kept
            # out of ``fields`` so a deferred retry does not commit twice
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
        num_rows, num_sub = fields["rows"], fields.get("episodes", 1)
        if num_rows % num_sub:
            raise ProtocolError(
                f"field 'rows'={num_rows} is not a multiple of field 'episodes'={num_sub}"
            )
        _, evict = self.container.plan(num_rows, num_sub)
        deadline = now + fields.get("timeout_ms", 30_000) / 1000
        leased = self.leases.pinned(
            ep.id for s, e in evict for ep in self.container.registry.overlapping(s, e)
        )
        if leased:
            raise Deferred(f"rows are leased by readers (episodes {leased[:5]})", deadline)
        if self.container.conflicts(evict):  # the ring lapped a writer that is still copying
            raise Deferred("rows are still being written by another writer", deadline)
        reservation = self.container.reserve(num_rows, num_sub, owner=client.id)
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
        ids = self.container.commit(reservation.id)
        client.reservations.discard(reservation.id)
        self.counters.rows_committed += reservation.num_rows
        self.counters.episodes_committed += len(ids)
        return ids

    def op_commit(self, client: Client, fields: dict[str, Any], frames: Frames, now: float) -> Any:
        return {"episodes": self._commit(client, fields["reservation"])}, []

    def op_abort(self, client: Client, fields: dict[str, Any], frames: Frames, now: float) -> Any:
        reservation = self._owned(client, fields["reservation"])
        self.container.abort(reservation.id)
        client.reservations.discard(reservation.id)
        return {}, []

    def op_write(self, client: Client, fields: dict[str, Any], frames: Frames, now: float) -> Any:
        """A remote writer's rows arrive as frames; the daemon does the copy."""
        leaves = self._leaves_from_frames(fields["rows"], frames)
        reservation = self._reserve(client, fields, now)
        assert self.segment is not None
        try:
            rows.write(self.segment.columns, self.segment.arrays, reservation.ranges, leaves)
        except BaseException:
            self.container.abort(reservation.id)
            client.reservations.discard(reservation.id)
            raise
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

    def op_sample(self, client: Client, fields: dict[str, Any], frames: Frames, now: float) -> Any:
        if "release" in fields:
            self.leases.release(fields["release"], client.id)
        kind, n = fields["kind"], fields["n"]
        registry = self.container.registry
        reply: dict[str, Any] = {}
        if kind == "rows":
            physical = registry.sample_rows(n, self._rng)
            reply["rows"] = _i64(physical)
        elif kind == "slices":
            length = fields.get("length")
            if length is None:
                raise ProtocolError("op 'sample': kind 'slices' needs field 'length'")
            starts = registry.sample_slices(n, length, self._rng)
            physical = (starts[:, None] + np.arange(length)).reshape(-1)
            reply["starts"] = _i64(starts)
        else:
            ids, starts, ends = registry.sample_episodes(n, self._rng)
            lengths = ends - starts
            physical = rows.episode_rows(starts, lengths)
            reply.update(ids=_i64(ids), starts=_i64(starts), lengths=_i64(lengths))
            if fields.get("lease", False) and not fields.get("payload", False):
                if self.leases.count_owner(client.id) >= self.config.max_leases_per_client:
                    raise LimitExceededError(
                        f"client {client.id} holds too many leases "
                        f"(limit {self.config.max_leases_per_client}); release some"
                    )
                reply["lease"] = self.leases.grant(client.id, ids.tolist(), now).id
        self.container.count_use(physical)
        self.counters.samples += 1
        self.counters.rows_sampled += len(physical)
        if fields.get("payload", False):  # remote reader: the daemon copies the rows out
            assert self.segment is not None
            data = rows.gather_columns(self.segment.columns, physical)
            return reply, [rows.to_bytes(t, t.dtype) for t in data.values()]
        reply["gens"] = _i64(self.generations[physical])
        return reply, []

    def op_release(self, client: Client, fields: dict[str, Any], frames: Frames, now: float) -> Any:
        self.leases.release(fields["lease"], client.id)
        return {}, []

    def op_clear(self, client: Client, fields: dict[str, Any], frames: Frames, now: float) -> Any:
        if client.role != "admin":
            raise PermissionDeniedError("only an admin client may clear the buffer")
        if len(self.leases) or self.container.reservations:
            raise LimitExceededError(
                f"cannot clear while {len(self.leases)} leases and "
                f"{len(self.container.reservations)} reservations are open"
            )
        self.container.clear()
        return {}, []

    def op_shutdown(
        self, client: Client, fields: dict[str, Any], frames: Frames, now: float
    ) -> Any:
        if client.role != "admin":
            raise PermissionDeniedError("only an admin client may shut the daemon down")
        return {}, []

    # -- time -------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Expire leases and stale reservations; sample rates for stats."""
        expired = self.leases.expire(now)
        self.counters.leases_expired += len(expired)
        for reservation in list(self.container.reservations.values()):
            if reservation.deadline <= now:
                self.container.abort(reservation.id)
                for client in self.clients.values():
                    client.reservations.discard(reservation.id)
                self.counters.reservations_expired += 1
                log.warning("reservation %d expired uncommitted; rows dropped", reservation.id)
        if not self._rates or now - self._rates[-1][0] >= 1.0:
            self._rates.append((now, self.counters.rows_committed, self.counters.rows_sampled))

    def stats(self, now: float) -> dict[str, Any]:
        # Rates over the last few seconds, up to this moment (bursts show at once).
        insert_rate = sample_rate = 0.0
        recent = [snap for snap in self._rates if now - snap[0] <= RATE_WINDOW_S]
        if recent and now > recent[0][0]:
            t0, c0, s0 = recent[0]
            insert_rate = (self.counters.rows_committed - c0) / (now - t0)
            sample_rate = (self.counters.rows_sampled - s0) / (now - t0)
        roles = [c.role for c in self.clients.values()]
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
            "writers": roles.count("writer"),
            "readers": roles.count("reader"),
            "reservations": len(container.reservations),
            "reserved_rows": container.reserved_rows,
            "leases": len(self.leases),
            "uptime_s": time.time() - self.started,
            "pid": os.getpid(),
            "protocol": PROTOCOL_VERSION,
            "rate_limiter": {"kind": "none", "min_size": 1},
            **{k: v for k, v in self.counters.__dict__.items()},
        }
