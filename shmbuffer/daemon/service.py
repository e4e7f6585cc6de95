"""The daemon's request handling, with no sockets in sight: one handler per op, by table.

:class:`BufferService` is the daemon's state (:mod:`shmbuffer.daemon.state`) with all of its
ops: the write ops (:mod:`~shmbuffer.daemon.writes`), the read ops
(:mod:`~shmbuffer.daemon.samples`) and, here, the client, admin and time ops and the stats.
The server feeds it validated requests one at a time through :meth:`BufferService.handle`; a
handler either returns reply fields (plus payload frames for remote clients), raises a
:class:`~shmbuffer.errors.ShmBufferError` that becomes an error reply, or raises
:class:`Deferred` when the request must wait (a reservation that would evict leased episodes,
or that the rate limiter or a FIFO sampler's unconsumed rows hold back; a sample the limiter
holds back, or one with nothing to consume yet), in which case the server retries it later. A
handler that defers has changed nothing, or names in ``Deferred.retry`` the request to retry
instead, without what it did already (a piggybacked commit, a lease released first, a
checkpoint started); a request is never changed in place.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

from shmbuffer.daemon.clients import Client
from shmbuffer.daemon.config import DaemonConfig
from shmbuffer.daemon.journal import record_bytes
from shmbuffer.daemon.pins import pins_from_state
from shmbuffer.daemon.processes import alive
from shmbuffer.daemon.rewrites import RewriteOps
from shmbuffer.daemon.samples import SampleOps
from shmbuffer.daemon.saved_state import restore_container
from shmbuffer.daemon.state import Deferred, Frames, Reply
from shmbuffer.daemon.stats import client_figures
from shmbuffer.daemon.writes import WriteOps
from shmbuffer.errors import (
    InvalidArgumentError,
    LimitExceededError,
    OutOfSpaceError,
    PermissionDeniedError,
    SchemaError,
    UnknownClientError,
)
from shmbuffer.ring.table import Table
from shmbuffer.storage.schema import Schema
from shmbuffer.storage.segment import Segment
from shmbuffer.wire.protocol import PROTOCOL_VERSION

log = logging.getLogger("shmbuffer.daemon")

__all__ = ["BufferService", "Deferred", "Frames", "Reply"]

#: An op of a client that said ``hello``: (its record, validated fields, payload, now).
Handler = Callable[[Client, dict[str, Any], Frames, float], Reply]
#: ``hello`` and ``ping``, which any identity may send: (identity, validated fields, now).
OpenHandler = Callable[[bytes, dict[str, Any], float], Reply]


class BufferService(WriteOps, SampleOps, RewriteOps):
    def __init__(self, config: DaemonConfig, segment: Segment | None = None) -> None:
        super().__init__(config, segment)
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
            "rewrite": self.op_rewrite,
            "sample": self.op_sample,
            "drawn": self.op_drawn,
            "episodes": self.op_episodes,
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
        try:
            return self.handlers[op](client, fields, frames, now)
        finally:
            spans = self.spans
            if spans is not None and spans.stale:  # what it committed, for readers' draws
                spans.publish()

    def op_hello(self, identity: bytes, fields: dict[str, Any], now: float) -> Reply:
        if identity not in self.clients and self.clients.full:
            self._reap(now)  # make room from clients that died without a 'bye'
        remote = fields.get("remote", False)
        client = self.clients.hello(
            identity,
            fields["role"],
            fields["pid"],
            fields["host"],
            remote,
            now,
            process=self.peer_process(identity),
        )
        return {"client": client.id, "buffer": self.buffer_info(), "daemon_pid": os.getpid()}, []

    def op_ping(self, identity: bytes, fields: dict[str, Any], now: float) -> Reply:
        return {"pid": os.getpid(), "protocol": PROTOCOL_VERSION}, []

    def forget(self, identity: bytes, now: float | None = None, said_bye: bool = False) -> None:
        """Drop a client with everything it holds: its leases are released and its
        reservations aborted (their rows were never published) — except, unless it said
        ``bye``, those pinned to a process that still runs (pins.py): a writer whose
        connection went may still be copying, so they are kept for it as orphans."""
        client = self.clients.pop(identity)
        if client is None:
            return
        for rid in list(client.reservations):
            reservation = self.container.reservations[rid]
            held = self.pins.get(rid)
            if held is not None and not said_bye and alive(held.process):
                held.orphaned = time.monotonic() if now is None else now
                reservation.owner = None
                log.warning(
                    "client %d gone while pid %d lives: its %d rows (reservation %d) stay "
                    "pinned until that process commits or aborts them, or exits",
                    client.id,
                    held.process.pid,
                    held.rows,
                    rid,
                )
            else:
                self._abort(None, reservation, None)
        self.leases.release_owner(client.id)
        log.info("client %d (pid %d) gone", client.id, client.pid)

    def disconnected(self, identity: bytes, now: float) -> None:
        """The transport says ``identity``'s connection closed (a lane client hung up). One
        holding nothing is forgotten at once; one holding reservations or leases on the next
        sweep, which tells a process that died (a SIGKILL closes its sockets as it exits) from
        one that dropped a connection and lives on (:meth:`forget`)."""
        client = self.clients.get(identity)
        if client is None:
            return
        if client.reservations or self.leases.count_owner(client.id):
            client.disconnected = True
        else:
            self.forget(identity, now)

    def op_bye(self, client: Client, fields: dict[str, Any], frames: Frames, now: float) -> Reply:
        self.forget(client.identity, now, said_bye=True)
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
        """Change the rate limiter's settings live (its counts are kept), the ``table``'s
        (absent: the default table's); parked requests are retried by the server's next
        pass under the new settings."""
        self._require_admin(client, "configure the rate limiter")
        settings = {k: v for k, v in fields.items() if k != "table"}
        name = fields.get("table")
        table = self.container.table_named(name)
        limiter = table.rate_limiter
        try:
            limiter.configure(**settings)
        except (TypeError, ValueError) as exc:  # nothing was changed
            where = "" if name is None else f" table {name!r}:"
            raise InvalidArgumentError(f"op 'configure':{where} {exc}") from None
        log.warning(
            "rate limiter%s reconfigured: %s",
            "" if name is None else f" of table {name!r}",
            limiter.blocked_reason(),
        )
        if self.spans is not None:  # whether readers may draw themselves may have changed
            self.spans.publish()
        if self.journal is not None:  # a resume keeps the new settings
            try:
                self.journal.snapshot(self.persistent_state())
            except (OSError, OutOfSpaceError) as exc:
                log.warning("journal snapshot after configure failed: %s", exc)
        if self.settings_changed is not None:  # and so does one before the first write
            try:
                self.settings_changed()
            except OSError as exc:
                log.warning("keeping the new settings in the runtime record failed: %s", exc)
        return {"rate_limiter": self.limiter_stats(table)}, []

    @classmethod
    def from_state(
        cls, config: DaemonConfig, segment: Segment, state: dict[str, Any]
    ) -> BufferService:
        """A service over an existing ``segment`` (resumed or restored) in ``state``; it
        starts a new journal generation at once."""
        service = cls(config, segment)
        restore_container(state, service.container)
        service.counters.restore(state.get("counters", {}))
        service._hold_pins(state.get("pins") or [], time.monotonic())
        service._start_journal()  # its first snapshot keeps the pins held again
        service.publish_spans()  # the whole state, before any client is served
        return service

    def _hold_pins(self, entries: list[Any], now: float) -> None:
        """Hold again the rows a dead daemon had pinned to writers that still run (their
        copies may go on into them); those of writers that exited stay free."""
        for held in pins_from_state(entries):
            if not alive(held.process):
                continue
            tables = self.container.mask_members(held.tables)
            reservation = self.container.hold(held.reservation, held.ranges, held.split, tables)
            reservation.deadline = now + self.config.reservation_ttl
            held.orphaned = now
            self.pins.add(held)
            log.warning(
                "resume: %d rows (reservation %d) stay pinned to pid %d, which was writing "
                "them when the daemon died",
                held.rows,
                held.reservation,
                held.process.pid,
            )

    def op_checkpoint(
        self, client: Client, fields: dict[str, Any], frames: Frames, now: float
    ) -> Reply:
        """Take the cut and start the copy (``checkpoint.py``); the reply waits for the copy:
        parked by the server (``Deferred``, retried until the job is done) while everyone else
        is served, or, with no server to park it, waited for here."""
        job = fields.get("_job")  # a retry: the job this request started
        if job is None:
            self._require_admin(client, "checkpoint the buffer")
            job = self.begin_checkpoint(fields["to"])
            if not self.defer_checkpoints:
                job.wait()
        if not job.done:  # parked with its job, so a retry does not start another
            reason = f"checkpoint to {job.dest}: {job.progress()}"
            raise Deferred(reason, math.inf, None, {**fields, "_job": job})
        return job.reply(), []

    def tick(self, now: float) -> None:
        """Expire leases and stale reservations; sample rates for stats."""
        expired = self.leases.expire(now)
        self.counters.leases_expired += len(expired)
        for reservation in list(self.container.reservations.values()):
            if reservation.deadline > now:
                continue
            held = self.pins.get(reservation.id)
            if held is not None:  # kept while its writer lives (pins.py)
                if not held.overdue:
                    held.overdue = True
                    log.warning(
                        "reservation %d of pid %d is past its TTL uncommitted; its rows stay "
                        "pinned while that process lives (stopped, or in a debugger?)",
                        reservation.id,
                        held.process.pid,
                    )
                continue
            self._abort(None, reservation, None)
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
            self._drop_dead_orphans()

    def _drop_dead_orphans(self) -> None:
        """Abort the orphaned pins whose process is gone: nobody can copy into them now."""
        for held in self.pins.orphans():
            if not alive(held.process):
                log.warning(
                    "pid %d exited: its pinned reservation %d is aborted, %d rows dropped",
                    held.process.pid,
                    held.reservation,
                    held.rows,
                )
                self._abort(None, self.container.reservations[held.reservation], None)
                self.counters.reservations_expired += 1

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
            elif why == "closed":
                log.info("client %d (pid %d) closed its connection", client.id, client.pid)
            else:
                self.counters.clients_expired += 1
                log.info(
                    "client %d (pid %d) idle for %.0fs: forgotten",
                    client.id,
                    client.pid,
                    self.clients.idle_ttl,
                )
            self.forget(client.identity, now)

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
            "stalled_writers": self.stalled_writers(now),
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
            "tables": self.table_stats(),
            # compressed columns' byte store (since 1.10): bytes, used, fill, ratio, columns
            **({} if self.bytes is None else {"compressed": self.bytes.stats()}),
        }

    def table_stats(self) -> dict[str, dict[str, Any]]:
        """Each table's sampler, limiter and priority counters, by name (the default first):
        the ``stats`` reply's ``tables`` (since 1.9; one, ``"default"``, without ``--table``)."""
        out: dict[str, dict[str, Any]] = {}
        for name, table in self.container.tables.items():
            out[name] = {
                "sampler": {
                    "kind": table.sampler.name,
                    "settings": table.sampler.settings(),
                    "figures": table.sampler.stats(),
                },
                "rate_limiter": self.limiter_stats(table),
                "priority_updates": table.priority_updates,
                "priority_updates_stale": table.priority_updates_stale,
                # why writes wait for this table now (its limiter, or rows a consume-once
                # table has not handed out), or None
                "holds_writes": self._holds_writes(name),
            }
            if table.bounds is not None:  # its options, the newest version, episodes per lag
                out[name]["bounds"] = table.bounds.stats(table)
        return out

    def stalled_writers(self, now: float) -> list[dict[str, Any]]:
        """Pinned reservations past their TTL or whose connection is gone: the rows a
        stopped (or disconnected) local writer holds, and for how long."""
        out = []
        for held in self.pins:
            reservation = self.container.reservations[held.reservation]
            if held.orphaned is None and reservation.deadline > now:
                continue
            out.append(
                {
                    "pid": held.process.pid,
                    "reservation": held.reservation,
                    "rows": held.rows,
                    "past_ttl_s": max(0.0, now - reservation.deadline),
                    "connected": held.orphaned is None,
                }
            )
        return out

    def _holds_writes(self, name: str) -> str | None:
        """The parked write's reason where it is table ``name``'s (the only table's, or one
        naming it)."""
        reason = self.insert_wait
        if reason is None or (len(self.container.tables) > 1 and f"table {name!r}" not in reason):
            return None
        return reason

    def limiter_stats(self, table: Table | None = None) -> dict[str, Any]:
        """The rate limiter of ``table`` (None: the default one) for ``stats`` and
        ``configure``: kind, settings, counts, the seconds parked requests waited for it, and
        how many wait now (all parked requests, whichever table holds them back)."""
        limiter = (table or self.container.table).rate_limiter
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
