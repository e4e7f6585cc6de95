"""The daemon's event loop: one ROUTER socket (and the local lane), one thread, every message
answered.

Local clients of an ipc daemon talk over the lane, a plain unix socket beside the ROUTER's
(``daemon/lane.py``): the same messages without ZeroMQ's I/O-thread hops. Both are polled here
and their messages take the same path; a reply goes back the way its request came.

Each request is decoded and validated before it reaches the service; anything wrong becomes an
error reply with a typed code and a log line, and the loop goes on. A request the service
defers (a reservation waiting for readers' leases or for the rate limiter, a sample waiting for
data to consume or for the limiter) is parked and retried after every batch of messages until
it succeeds or its own timeout runs out, without blocking anyone else.

Parked inserts (``reserve``, ``write``) and parked samples wait in separate FIFO queues, as
Reverb keeps them: a parked sample never holds up the insert that would let it through, nor the
other way round. Each pass retries the inserts first, then the samples, and passes repeat while
one of them got through (a sample that proceeds may be what a parked insert waited for).

A ``checkpoint`` is parked in a third queue of its own until its copy thread is done (see
``checkpoint.py``), checked on every pass; it never holds up a parked insert or sample. A
daemon stopped meanwhile cancels the copy (its temp folder goes) before it closes.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import zmq

from shmbuffer.daemon.lane import Lane
from shmbuffer.daemon.security import (
    ServerSecurity,
    admin_refusal,
    make_curve_server,
    resolve_group,
    secure_ipc_path,
)
from shmbuffer.daemon.service import BufferService, Deferred, Frames
from shmbuffer.errors import EmptyBufferError, ShmBufferError, WaitTimeoutError
from shmbuffer.wire.protocol import (
    MAX_HEADER_BYTES,
    decode,
    encode,
    error_reply,
    ok_reply,
    validate_request,
)
from shmbuffer.wire.unix import lane_path
from shmbuffer.wire.zmq import send_frames

if TYPE_CHECKING:
    from shmbuffer.daemon.metrics import Metrics

log = logging.getLogger("shmbuffer.daemon")

TICK_S = 0.05  # how often leases and reservations are checked for expiry
LOG_REFUSALS_PER_S = 20  # refused requests logged per second; the rest are only counted


class _LogBudget:
    """At most ``per_s`` log lines a second; what was left out is summarised in one line."""

    def __init__(self, per_s: int) -> None:
        self.per_s = per_s
        self.window = -1.0
        self.used = self.dropped = 0

    def allow(self) -> bool:
        now = time.monotonic()
        if now - self.window >= 1.0:
            if self.dropped:
                log.warning(
                    "%d more refused requests were not logged (at most %d a second); the "
                    "'errors' counter in stats counts them all",
                    self.dropped,
                    self.per_s,
                )
            self.window, self.used, self.dropped = now, 0, 0
        self.used += 1
        if self.used <= self.per_s:
            return True
        self.dropped += 1
        return False


@dataclass
class Parked:
    identity: bytes
    header: dict[str, Any]
    fields: dict[str, Any]
    frames: Frames
    deadline: float
    arrived: float
    #: Why it waits now (the latest Deferred's reason; a WaitTimeoutError names it).
    reason: str
    #: ``"insert"``/``"sample"`` once the rate limiter or the sampler held it back: the time
    #: it waited counts as blocked in the limiter's figures (a lease wait does not).
    blocked: str | None


#: Ops parked in the insert queue; every other deferred op is a sample, except these:
INSERT_OPS = ("reserve", "write")
#: Ops whose reply waits for work off the loop (a checkpoint's copy), in a queue of their own.
BACKGROUND_OPS = ("checkpoint",)


class Server:
    def __init__(
        self, service: BufferService, endpoint: str, metrics: Metrics | None = None
    ) -> None:
        self.service = service
        self.endpoint = endpoint
        #: ``--metrics-port``: answered requests are timed and a stats snapshot is published
        #: from this loop (the HTTP thread reads only that; see daemon/metrics.py).
        self.metrics = metrics
        self._context = zmq.Context()
        self.socket = self._context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 1000)
        self.socket.setsockopt(zmq.MAXMSGSIZE, service.config.max_payload_bytes + MAX_HEADER_BYTES)
        self._bind(endpoint)
        self.lane = self._open_lane()
        self._inserts: deque[Parked] = deque()
        self._samples: deque[Parked] = deque()
        self._background: deque[Parked] = deque()
        service.defer_checkpoints = True  # parked in _background, answered when done
        self._stopping = False
        self._refusals = _LogBudget(LOG_REFUSALS_PER_S)
        self.keep_segment = False

    def _bind(self, endpoint: str) -> None:
        config = self.service.config
        self.security = ServerSecurity()  # CURVE and its authenticator (see daemon/security.py)
        if config.curve_secret:
            self.security = make_curve_server(
                self._context, self.socket, config.curve_secret, config.curve_clients
            )
        try:
            if endpoint.startswith("ipc://"):
                path = endpoint[len("ipc://") :]
                old = os.umask(0o177)  # the socket file is created owner-only
                try:
                    self.socket.bind(endpoint)
                finally:
                    os.umask(old)
                secure_ipc_path(path, resolve_group(config.group))  # 0600, or 0660 + group
            else:
                self.socket.bind(endpoint)
                self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            self.security.close()
            raise
        # The admin role is self-declared: only a transport that vouches for the client (the
        # owner-only ipc socket, CURVE) may carry clear/shutdown/checkpoint.
        self.service.admin_refused = admin_refusal(
            self.endpoint, self.security.curve, config.insecure_tcp_admin
        )

    def _open_lane(self) -> Lane | None:
        """The local lane beside an ipc socket (never beside CURVE: it would bypass the keys)."""
        config = self.service.config
        path = lane_path(self.endpoint)
        if path is None or config.curve_secret:
            return None
        try:
            limit = config.max_payload_bytes + MAX_HEADER_BYTES
            lane = Lane(path, resolve_group(config.group), limit, on_close=self._lane_closed)
        except OSError as exc:  # a path over the kernel's limit, say: clients keep ZeroMQ
            log.warning("no local lane at %s (%s); local clients use the ipc socket", path, exc)
            return None
        self.service.peer_process = lane.process  # the pid a lane client has is vouched for
        return lane

    def _lane_closed(self, identity: bytes) -> None:
        self.service.disconnected(identity, time.monotonic())

    def stop(self, *_: object) -> None:
        """Ask the loop to finish the messages in hand and return (signal-handler safe)."""
        self._stopping = True

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)

    # -- loop -------------------------------------------------------------------------------

    def serve_forever(self) -> None:
        # What start-up loaded (torch, numpy, the segment's objects) lives as long as the daemon:
        # frozen, no full collection rescans it. Without this each one rescanned all of them
        # (a long pause, ``docs/architecture.md``), inside write replies.
        gc.freeze()
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        if self.lane is not None:
            self.lane.register(poller)
        last_tick = 0.0
        while not self._stopping:
            for sock, events in poller.poll(int(TICK_S * 1000)):
                if sock is self.socket:
                    self._drain_router()
                else:
                    assert self.lane is not None
                    for identity, frames in self.lane.on_event(sock, events):
                        self._on_message(identity, frames[0], cast("Frames", frames[1:]))
            now = time.monotonic()
            if now - last_tick >= TICK_S:
                self.service.tick(now)
                if self.lane is not None:
                    self.lane.tick(now)
                last_tick = now
            if self.metrics is not None:
                self.metrics.publish(now, self.service.stats)
            if self._inserts or self._samples:
                self._retry_parked(now)
            if self._background:
                self._retry_background(now)
        self._drain_on_stop()

    def _drain_router(self) -> None:
        for _ in range(1000):  # a burst at most, then the lane and the timers get their turn
            try:
                raw = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(raw) >= 2:  # a ROUTER always prepends the identity; else nothing to answer
                self._on_message(raw[0].bytes, raw[1].buffer, [f.buffer for f in raw[2:]])

    def _on_message(self, identity: bytes, header_frame: Any, payload: Frames) -> None:
        header: dict[str, Any] = {}
        try:
            header = decode(header_frame)
            fields = validate_request(header)
        except ShmBufferError as exc:
            self._reply_error(identity, header.get("seq"), exc)
            return
        except Exception as exc:  # a bug in validation must not kill the daemon either
            log.exception("internal error validating a request")
            self._reply_error(identity, header.get("seq"), ShmBufferError(f"internal: {exc!r}"))
            return
        now = time.monotonic()
        wait = self._dispatch(identity, header, fields, payload, now, retry=False)
        if wait is not None:
            queue = self._inserts if header["op"] in INSERT_OPS else self._samples
            if header["op"] in BACKGROUND_OPS:
                queue = self._background
            parked = fields if wait.retry is None else wait.retry
            queue.append(
                Parked(identity, header, parked, payload, wait.deadline, now, str(wait), None)
            )
            self._note_wait(queue[-1], wait)
            self._count_waiting()

    def _dispatch(
        self,
        identity: bytes,
        header: dict[str, Any],
        fields: dict[str, Any],
        payload: Frames,
        now: float,
        retry: bool,
    ) -> Deferred | None:
        """Run one request: reply, or return the Deferred that says it must wait. With
        metrics, an answered request's handling time is observed (a deferred attempt's is
        not: its wait shows in the blocked seconds)."""
        if self.metrics is None:
            return self._run(identity, header, fields, payload, now, retry)
        t0 = time.perf_counter()
        wait = self._run(identity, header, fields, payload, now, retry)
        if wait is None:
            self.metrics.observe(header["op"], time.perf_counter() - t0)
        return wait

    def _run(
        self,
        identity: bytes,
        header: dict[str, Any],
        fields: dict[str, Any],
        payload: Frames,
        now: float,
        retry: bool,
    ) -> Deferred | None:
        try:
            reply, out = self.service.handle(
                identity, header["op"], fields, payload, now, retry=retry
            )
        except Deferred as wait:
            return wait
        except ShmBufferError as exc:
            self._reply_error(identity, header["seq"], exc)
            return None
        except Exception as exc:  # a bug must not kill the daemon: report it and go on
            log.exception("internal error handling %s", header.get("op"))
            self._reply_error(identity, header["seq"], ShmBufferError(f"internal error: {exc!r}"))
            return None
        self._send(identity, ok_reply(header["seq"], **reply), out)
        if header["op"] == "shutdown":
            self.keep_segment = bool(fields.get("keep", False))
            self.stop()
        return None

    @staticmethod
    def _note_wait(item: Parked, wait: Deferred) -> None:
        item.reason = str(wait)
        item.blocked = item.blocked or wait.blocked
        if wait.retry is not None:  # part of it was done by this attempt
            item.fields = wait.retry

    def _retry_parked(self, now: float) -> None:
        """Retry parked inserts, then parked samples, and again while either got through."""
        while self._retry_queue(self._inserts, now) | self._retry_queue(self._samples, now):
            pass
        self._count_waiting()

    def _retry_background(self, now: float) -> None:
        """Answer the parked requests whose work is done; each on its own (none waits for
        another)."""
        for item in list(self._background):
            wait = self._dispatch(
                item.identity, item.header, item.fields, item.frames, now, retry=True
            )
            if wait is None:
                self._background.remove(item)
                continue
            self._note_wait(item, wait)
            if now >= item.deadline:
                self._background.remove(item)
                self._time_out(item, now)

    def _retry_queue(self, queue: deque[Parked], now: float) -> bool:
        """Retry ``queue`` in FIFO order up to the first request still blocked (those behind it
        want the same rows or data: they stay behind it, but time out on their own deadline);
        True if any went through."""
        progressed = False
        still: deque[Parked] = deque()
        while queue:
            item = queue.popleft()
            if now >= item.deadline:
                self._time_out(item, now)
                continue
            wait = self._dispatch(
                item.identity, item.header, item.fields, item.frames, now, retry=True
            )
            if wait is None:
                progressed = True
                self._blocked_for(item, now)
                continue
            self._note_wait(item, wait)
            still.append(item)
            break
        for item in queue:  # behind the blocked one: only their deadlines are checked
            if now >= item.deadline:
                self._time_out(item, now)
            else:
                still.append(item)
        queue.clear()
        queue.extend(still)
        return progressed

    def _time_out(self, item: Parked, now: float) -> None:
        self._blocked_for(item, now)
        waited = now - item.arrived
        self._reply_error(
            item.identity,
            item.header["seq"],
            WaitTimeoutError(
                f"op {item.header['op']!r} waited {waited:.1f}s, its timeout: {item.reason}"
            ),
        )

    def _blocked_for(self, item: Parked, now: float) -> None:
        """Count the time a request the limiter or sampler held back spent parked."""
        if item.blocked is not None:
            self.service.record_blocked(item.blocked, now - item.arrived)

    def _count_waiting(self) -> None:
        self.service.waiting = {"insert": len(self._inserts), "sample": len(self._samples)}
        # why the first parked write waits (a table holding its rows back names itself)
        self.service.insert_wait = self._inserts[0].reason if self._inserts else None

    def _reply_error(self, identity: bytes, seq: Any, exc: ShmBufferError) -> None:
        self.service.counters.errors += 1
        # Waiting for data or for rows is normal flow control; anything else is a client bug,
        # logged at a bounded rate so that a flood of bad input cannot flood the log.
        if isinstance(exc, EmptyBufferError | WaitTimeoutError):
            log.debug("refused a request: %s: %s", exc.code, exc)
        elif self._refusals.allow():
            log.warning("refused a request: %s: %s", exc.code, exc)
        self._send(identity, error_reply(seq, exc), [])

    def _send(self, identity: bytes, header: dict[str, Any], payload: Frames) -> None:
        if self.lane is not None and self.lane.owns(identity):
            self.lane.send(identity, [encode(header), *payload])
            return
        try:
            send_frames(self.socket, [identity, encode(header)], payload)
        except zmq.ZMQError as exc:  # the peer vanished; its state is reaped by TTL
            log.warning("could not reply to a client: %s", exc)

    def _drain_on_stop(self) -> None:
        self.service.stop_checkpoint()  # its reply is the shutting-down error below
        for queue in (self._inserts, self._samples, self._background):
            for item in queue:
                self._reply_error(
                    item.identity, item.header["seq"], ShmBufferError("the daemon is shutting down")
                )
            queue.clear()
        self._count_waiting()

    def close(self) -> None:
        self.service.stop_checkpoint()  # before the segment goes (a loop that raised)
        if self.lane is not None:
            self.lane.close()
        self.socket.close()
        self.security.close()  # the ZAP authenticator thread, before the context goes
        self._context.term()
        if self.endpoint.startswith("ipc://"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.endpoint[len("ipc://") :])
