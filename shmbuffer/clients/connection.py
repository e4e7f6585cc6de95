"""A client's line to the daemon: one DEALER socket, requests matched to replies by ``seq``.

Requests may be pipelined: :meth:`Connection.send` returns at once and :meth:`Connection.wait`
collects that request's reply later (the writer sends a commit and goes on copying). Every wait
is bounded; a daemon that does not answer in time raises :class:`DaemonUnavailableError`
instead of hanging the caller.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
import socket
import time
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from shmbuffer.curve import (
    ENV_CURVE_CLIENT_CERT,
    ENV_CURVE_SERVER_KEY,
    client_curve_options,
)
from shmbuffer.errors import (
    DaemonUnavailableError,
    LimitExceededError,
    ProtocolError,
    error_from_code,
)
from shmbuffer.protocol import check_version, encode, request
from shmbuffer.protocol_zmq import send_frames
from shmbuffer.runtime import resolve_endpoint

Reply = tuple[dict[str, Any], list[zmq.Frame]]

_FAILED_HANDSHAKE = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
)
_HANDSHAKE_EVENTS = functools.reduce(operator.or_, _FAILED_HANDSHAKE)


class Connection:
    def __init__(
        self,
        target: str,
        role: str,
        *,
        timeout: float = 10.0,
        remote: bool | None = None,
        curve_server_key: str | bytes | os.PathLike[str] | None = None,
        curve_client_cert: str | os.PathLike[str] | None = None,
    ) -> None:
        """``curve_server_key`` (the daemon's ``.key`` file or its Z85 text) makes this a
        CURVE client; ``curve_client_cert`` (a ``.key_secret`` file) is the identity a daemon
        started with ``--curve-clients`` checks. Both default to ``$SHMBUFFER_CURVE_SERVER_KEY``
        and ``$SHMBUFFER_CURVE_CLIENT_CERT``."""
        self.endpoint = resolve_endpoint(target)
        #: Rows travel over the socket (a daemon on another host, or asked for).
        self.remote = is_remote_target(self.endpoint) if remote is None else remote
        self.timeout = timeout
        self._context = zmq.Context()  # per connection: safe across fork/spawn
        self.socket = self._context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)  # nothing rides on an unacknowledged message
        curve = client_curve_options(curve_server_key, curve_client_cert)
        for option, value in curve.items():
            self.socket.setsockopt(option, value)
        self.curve = bool(curve)
        # Until the hello is answered, watch the handshake: a refused one explains a timeout.
        self._monitor: zmq.Socket[Any] | None = None
        if self.curve or not self.endpoint.startswith("ipc://"):
            self._monitor = self.socket.get_monitor_socket(_HANDSHAKE_EVENTS)
        self.socket.connect(self.endpoint)
        self._seq = 0
        self._early: dict[int, Reply] = {}  # replies that arrived before anyone waited
        self._pings: set[int] = set()  # liveness pings sent during long waits (see wait_all)
        self._closed = False
        try:
            hello = self.call(
                "hello", role=role, pid=os.getpid(), host=socket.gethostname(), remote=self.remote
            )
        except BaseException:
            self._closed = True
            self._stop_monitor()
            self.socket.close()
            self._context.term()
            raise
        self._stop_monitor()
        self.client_id: int = hello["client"]
        self.buffer: dict[str, Any] = hello["buffer"]
        self.daemon_pid: int = hello["daemon_pid"]

    def send(self, op: str, frames: Sequence[Any] = (), **fields: Any) -> int:
        limit = getattr(self, "buffer", {}).get("max_payload_bytes")
        if frames and limit is not None:
            size = sum(memoryview(f).nbytes for f in frames)
            if size > limit:  # the daemon would refuse it, or libzmq drop it unanswered
                raise LimitExceededError(
                    f"op {op!r}: a payload of {size:,} bytes exceeds the daemon's limit "
                    f"max_payload_bytes={limit:,}; send fewer rows per call"
                )
        self._seq += 1
        header = encode(request(op, self._seq, **fields))
        send_frames(self.socket, [header], frames)
        return self._seq

    def wait(self, seq: int, timeout: float | None = None) -> Reply:
        """The reply to request ``seq``; raises the daemon's error as its exception class."""
        self.wait_all([seq], timeout)
        header, payload = self._early.pop(seq)
        check_version(header.get("v"))
        if not header.get("ok"):
            error = header.get("error") or {}
            raise error_from_code(str(error.get("code")), str(error.get("message")))
        return header, payload

    def ready(self, seq: int) -> bool:
        """Whether the reply to ``seq`` can be taken without waiting."""
        while seq not in self._early and self.socket.poll(0):
            self._receive_one()
        return seq in self._early

    def wait_all(self, seqs: Sequence[int], timeout: float | None = None) -> None:
        """Wait (one deadline for all) until every reply in ``seqs`` has arrived.

        A wait longer than ``self.timeout`` (a reservation waiting for readers' leases) pings
        the daemon whenever it has been silent for half of ``self.timeout``, so a daemon that
        died is reported within ``self.timeout`` instead of at the end of the long wait.
        """
        waited = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + waited
        heard = time.monotonic()  # when the daemon last said anything
        for seq in seqs:
            while seq not in self._early:
                now = time.monotonic()
                left = deadline - now
                if waited > self.timeout:
                    if now - heard >= self.timeout:  # not even a ping was answered
                        raise DaemonUnavailableError(
                            f"the daemon at {self.endpoint} stopped answering: nothing, not "
                            f"even a ping, within {self.timeout:.1f}s ({self._why_no_reply()})"
                        )
                    quiet = self.timeout if self._pings else self.timeout / 2
                    left = min(left, heard + quiet - now)
                if left > 0 and self.socket.poll(int(left * 1000) + 1):
                    self._receive_one()
                    heard = time.monotonic()
                elif time.monotonic() >= deadline:
                    raise DaemonUnavailableError(
                        f"no reply from the daemon at {self.endpoint} within {waited:.1f}s "
                        f"({self._why_no_reply()})"
                    )
                elif waited > self.timeout and not self._pings:
                    self._pings.add(self.send("ping"))  # its reply is dropped on arrival

    def _why_no_reply(self) -> str:
        """A hint for a timeout, naming CURVE authentication when it may be the cause."""
        failed = None
        while self._monitor is not None and self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event in _FAILED_HANDSHAKE:
                failed = event
        keys = (
            f"check the server public key (curve_server_key / ${ENV_CURVE_SERVER_KEY}) and "
            f"that the client certificate (curve_client_cert / ${ENV_CURVE_CLIENT_CERT}) is "
            "allowed"
            if self.curve
            else f"the daemon may require CURVE keys: pass curve_server_key= or set "
            f"${ENV_CURVE_SERVER_KEY}"
        )
        if failed == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return (
                "the daemon refused this client's CURVE key (not among its --curve-clients); "
                f"{keys}"
            )
        if failed is not None:
            return f"the CURVE authentication handshake failed: {keys}"
        if self._monitor is not None:  # still connecting: down, or a handshake that went nowhere
            return f"is it running? `shmbuffer-daemon status`; if it is, {keys}"
        return "is it running? `shmbuffer-daemon status`"

    def _stop_monitor(self) -> None:
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.socket.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None

    def _receive_one(self) -> None:
        frames = self.socket.recv_multipart(copy=False)
        header = _decode_reply(frames[0].buffer)
        got = header.get("seq")
        if not isinstance(got, int):
            raise ProtocolError(f"reply without a seq: {header!r}")
        if got in self._pings:  # a liveness ping: arriving was all it had to do
            self._pings.discard(got)
            return
        self._early[got] = (header, frames[1:])

    def call(
        self, op: str, frames: Sequence[Any] = (), timeout: float | None = None, **fields: Any
    ) -> dict[str, Any]:
        return self.wait(self.send(op, frames, **fields), timeout)[0]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):  # the daemon may be gone; closing still succeeds
            self.call("bye", timeout=min(self.timeout, 2.0))
        self.socket.close()
        self._context.term()


def _decode_reply(frame: memoryview) -> dict[str, Any]:
    """A reply header. Requests are capped at ``MAX_HEADER_BYTES`` to protect the daemon, but a
    sample reply carries an index and a stamp per sampled row, so it may be megabytes."""
    try:
        header = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises a zoo of types for bad input
        raise ProtocolError(f"reply is not valid msgpack: {type(exc).__name__}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"reply header must be a msgpack map, got {type(header).__name__}")
    return header


def is_remote_target(endpoint: str) -> bool:
    """A ``tcp://`` endpoint on another host, whose shared memory cannot be mapped here."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    local = {"127.0.0.1", "localhost", "::1", "0.0.0.0", socket.gethostname()}
    return host not in local
