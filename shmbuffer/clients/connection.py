"""A client's line to the daemon: one socket, requests matched to replies by ``seq``.

The socket is the daemon's local lane (a unix socket, ``clients/lane.py``) where it answers:
a local client of an ipc daemon without CURVE; else a ZeroMQ DEALER. Both carry the same
messages; the lane skips ZeroMQ's I/O threads (a shorter round trip: ``docs/architecture.md``).

Requests may be pipelined: :meth:`Connection.send` returns at once and :meth:`Connection.wait`
collects that request's reply later (the writer sends a commit and goes on copying). Every wait
is bounded; a daemon that does not answer in time raises :class:`DaemonUnavailableError`
instead of hanging the caller.

Lifecycle: every socket lives in one ZeroMQ context per process (:class:`_ProcessContext`),
never terminated, and each connection says ``bye`` (so the daemon forgets it at once) and
closes its own sockets with ``LINGER`` 0, in :meth:`Connection.close` or, for one never
closed (collected, or left at interpreter exit), in a ``weakref.finalize`` callback that holds
the sockets, never the connection. The goodbye waits at most :data:`BYE_TIMEOUT_S` (or the
connection's timeout, if shorter) for its answer, and is skipped on a lane that has hung up
(the daemon that knew the client is gone).

``zmq_ctx_term`` blocks until every socket of its context is closed; a context per connection,
collected in a reference cycle, was finalised before its socket (the garbage's weak
references are cleared first, so pyzmq's ``Context.__del__`` found no socket to close) and
``gc.collect()`` blocked forever. A connection is bound to the process
that made it: used after ``os.fork()`` it raises :class:`ForkedClientError` (the inherited
socket's I/O thread does not exist in the child, so a poll on it spun forever), and closing
it there touches nothing of the parent's.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from shmbuffer.clients.lane import LaneSocket, connect_lane
from shmbuffer.errors import (
    ClosedError,
    DaemonUnavailableError,
    ForkedClientError,
    LimitExceededError,
    PermissionDeniedError,
    ProtocolError,
    ShmBufferError,
    UnknownClientError,
    WaitTimeoutError,
    error_from_code,
)
from shmbuffer.runtime import access_refusal, resolve_endpoint
from shmbuffer.wire.curve import (
    ENV_CURVE_CLIENT_CERT,
    ENV_CURVE_SERVER_KEY,
    client_curve_options,
)
from shmbuffer.wire.protocol import check_version, decode, encode, request
from shmbuffer.wire.unix import lane_path, lane_wanted
from shmbuffer.wire.zmq import send_frames

Reply = tuple[dict[str, Any], list[Any]]  # payload: zmq.Frame, or bytes off the lane

_FAILED_HANDSHAKE = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
)
_HANDSHAKE_EVENTS = functools.reduce(operator.or_, _FAILED_HANDSHAKE)

#: The longest a goodbye waits for the daemon's answer.
BYE_TIMEOUT_S = 2.0
#: The goodbye's seq: requests count from 1, so a reply with this one answers the goodbye.
_BYE_SEQ = 0


class _ProcessContext:
    """This process's ZeroMQ context, made at first use and again in a forked child (a
    context does not survive fork). Never terminated: nothing may wait in ``zmq_ctx_term``
    (see the module docstring); the process's exit ends its I/O thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._context: zmq.Context[Any] | None = None
        self._pid = 0

    def get(self) -> zmq.Context[Any]:
        with self._lock:
            if self._context is None or self._pid != os.getpid():
                self._context, self._pid = zmq.Context(), os.getpid()
            return self._context

    def after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # a thread of the parent may have held it at the fork


_process_context = _ProcessContext()
os.register_at_fork(after_in_child=_process_context.after_fork_in_child)


def _goodbye(sock: Any, timeout: float) -> None:
    """Send ``bye`` on a connection's socket (a :class:`LaneSocket` or a DEALER) and wait at
    most ``timeout`` for its answer, dropping the replies before it; never raises."""
    header = encode(request("bye", _BYE_SEQ))
    deadline = time.monotonic() + timeout
    with contextlib.suppress(zmq.ZMQError, OSError, ShmBufferError, ValueError):
        if isinstance(sock, LaneSocket):
            if not sock.connected:  # hung up: the daemon that knew this client is gone
                return
            sock.send([header])
            while sock.connected and sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                if decode(sock.recv()[0], max_bytes=None).get("seq") == _BYE_SEQ:
                    return
        else:
            sock.send(header, zmq.NOBLOCK)  # never blocks: no pipe, no goodbye
            while sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                first = sock.recv_multipart(copy=False)[0].buffer
                if decode(first, max_bytes=None).get("seq") == _BYE_SEQ:
                    return


def _finalise(pid: int, sockets: list[Any], lock: Any, timeout: float) -> None:
    """The finaliser of a connection never closed: say goodbye, then close its sockets. A
    no-op in a forked child, whose copies of the parent's sockets are not its own. At
    interpreter exit a thread of the client (a lease renewer) may be using the socket: the
    goodbye waits for its lock, within the same bound, or is skipped."""
    if os.getpid() != pid:
        return
    if sockets and lock.acquire(timeout=timeout):
        try:
            _goodbye(sockets[-1], timeout)  # the monitor, while it exists, comes first
        finally:
            lock.release()
    _close_sockets(pid, sockets)


def _close_sockets(pid: int, sockets: list[Any]) -> None:
    """Close a connection's sockets at once (``LINGER`` 0: nothing rides on an unacknowledged
    message); a no-op in a forked child, whose copies of the parent's sockets are not its
    own."""
    if os.getpid() != pid:
        return
    while sockets:
        sock = sockets.pop()
        with contextlib.suppress(zmq.ZMQError, OSError):
            if isinstance(sock, LaneSocket):
                sock.close()
            else:
                sock.close(linger=0)


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
        _check_socket_access(self.endpoint)
        #: Rows travel over the socket (a daemon on another host, or asked for).
        self.remote = is_remote_target(self.endpoint) if remote is None else remote
        self.timeout = timeout
        #: "Writer", "Reader", ...: names the object in a closed or forked client's error.
        self.label = {"writer": "Writer", "reader": "Reader"}.get(role, "Connection")
        self._pid = os.getpid()
        # Callers on two threads (a Reader's lease renewer) share the socket through this.
        self._lock = threading.RLock()
        curve = client_curve_options(curve_server_key, curve_client_cert)
        self.curve = bool(curve)
        self._monitor: zmq.Socket[Any] | None = None
        #: The local lane (a unix socket beside the daemon's ipc one, see
        #: ``shmbuffer/wire/unix.py``) when it answers; else the ZeroMQ socket.
        self._lane: LaneSocket | None = None
        path = lane_path(self.endpoint)
        if path is not None and not self.remote and not self.curve and lane_wanted():
            self._lane = connect_lane(path, timeout)
        # Holds the sockets (not the connection): says goodbye and closes them if the
        # connection is collected unclosed. The monitor joins the list when it exists.
        self._sockets: list[Any] = []
        self._finalizer = weakref.finalize(
            self, _finalise, self._pid, self._sockets, self._lock, min(timeout, BYE_TIMEOUT_S)
        )
        if self._lane is not None:
            self._sockets.append(self._lane)
        else:
            self.socket = _process_context.get().socket(zmq.DEALER)
            self.socket.setsockopt(zmq.LINGER, 0)  # nothing rides on an unacknowledged message
            self._sockets.append(self.socket)
            for option, value in curve.items():
                self.socket.setsockopt(option, value)
            # Until the hello is answered, watch the handshake: a refused one explains a timeout.
            if self.curve or not self.endpoint.startswith("ipc://"):
                self._monitor = self.socket.get_monitor_socket(_HANDSHAKE_EVENTS)
                self._monitor.setsockopt(zmq.LINGER, 0)
                self._sockets.insert(0, self._monitor)  # closed before the socket it watches
            # Bounded until the hello is answered: a socket whose handshake failed can be left
            # with no pipe, and a send on it would block for ever (seen once in CI).
            self.socket.setsockopt(zmq.SNDTIMEO, max(1, int(min(timeout, 86400.0) * 1000)))
            self.socket.connect(self.endpoint)
        self._seq = 0
        self._early: dict[int, Reply] = {}  # replies that arrived before anyone waited
        self._pings: set[int] = set()  # liveness pings sent during long waits (see wait_all)
        self._cap: float | None = None  # a deadline every wait ends by (see bounded)
        #: When the daemon last said anything on this connection (monotonic seconds).
        self.last_heard = 0.0
        self._closed = False
        try:
            hello = self.call(
                "hello", role=role, pid=os.getpid(), host=socket.gethostname(), remote=self.remote
            )
        except BaseException:
            self._closed = True
            self._stop_monitor()
            self._release_sockets()  # no hello, no goodbye
            raise
        self._stop_monitor()
        if self._lane is None:
            self.socket.setsockopt(zmq.SNDTIMEO, -1)
        self.client_id: int = hello["client"]
        self.buffer: dict[str, Any] = hello["buffer"]
        self.daemon_pid: int = hello["daemon_pid"]

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def forked(self) -> bool:
        """Whether this process is not the one that made the connection (a fork's child)."""
        return os.getpid() != self._pid

    def check(self) -> None:
        """Raise :class:`ClosedError` after :meth:`close`, :class:`ForkedClientError` in a
        forked child. Every request and wait passes here, before taking the lock (which a
        thread of the parent may have held at the fork); the Writer also calls it before
        writes it only stages."""
        if self.forked:
            raise ForkedClientError(
                f"this {self.label} was created in process {self._pid} and cannot be used in "
                f"process {os.getpid()}, forked from it: its ZeroMQ socket belongs to the "
                f"parent. Create a new {self.label} in the child (after the fork)"
            )
        self._check_open()

    def _check_open(self) -> None:
        # The finaliser has closed the sockets when the connection is being collected (a
        # generator of the same garbage may still try a last request from its own finaliser).
        if self._closed or not self._finalizer.alive:
            raise ClosedError(f"this {self.label} is closed (close() was called); create a new one")

    def send(self, op: str, frames: Sequence[Any] = (), **fields: Any) -> int:
        self.check()
        with self._lock:
            return self._send(op, frames, **fields)

    def check_payload(self, op: str, size: int) -> None:
        """LimitExceededError for a payload of ``size`` bytes over the daemon's limit: it
        would refuse it, or libzmq drop it unanswered."""
        limit = getattr(self, "buffer", {}).get("max_payload_bytes")
        if limit is not None and size > limit:
            raise LimitExceededError(
                f"op {op!r}: a payload of {size:,} bytes exceeds the daemon's limit "
                f"max_payload_bytes={limit:,}; send fewer rows per call"
            )

    def _send(self, op: str, frames: Sequence[Any] = (), **fields: Any) -> int:
        self._check_open()  # again, under the lock: another thread may have closed it
        if frames:
            self.check_payload(op, sum(memoryview(f).nbytes for f in frames))
        self._seq += 1
        header = encode(request(op, self._seq, **fields))
        if self._lane is not None:
            self._lane.send([header, *frames])
        else:
            try:
                send_frames(self.socket, [header], frames)
            except zmq.Again:  # only while connecting: the send timeout is set until the hello
                raise DaemonUnavailableError(
                    f"could not send to the daemon at {self.endpoint} within "
                    f"{self.timeout:.1f}s ({self._why_no_reply()})"
                ) from None
        return self._seq

    def wait(self, seq: int, timeout: float | None = None) -> Reply:
        """The reply to request ``seq``; raises the daemon's error as its exception class."""
        self.check()
        with self._lock:
            self.wait_all([seq], timeout)
            header, payload = self._early.pop(seq)
        check_version(header.get("v"))
        if not header.get("ok"):
            error = header.get("error") or {}
            raise error_from_code(str(error.get("code")), str(error.get("message")))
        return header, payload

    def ready(self, seq: int) -> bool:
        """Whether the reply to ``seq`` can be taken without waiting."""
        self.check()
        with self._lock:
            self._check_open()
            while seq not in self._early and self._poll(0):
                self._receive_one()
            return seq in self._early

    def wait_all(self, seqs: Sequence[int], timeout: float | None = None) -> None:
        """Wait (one deadline for all) until every reply in ``seqs`` has arrived.

        A wait longer than ``self.timeout`` (a reservation waiting for readers' leases) pings
        the daemon whenever it has been silent for half of ``self.timeout``, so a daemon that
        died is reported within ``self.timeout`` instead of at the end of the long wait.
        """
        self.check()
        with self._lock:
            self._wait_all(seqs, timeout)

    @contextlib.contextmanager
    def bounded(self, seconds: float) -> Iterator[None]:
        """Every wait inside ends within ``seconds`` from now, whatever its own timeout (a
        finaliser's budget); one cut short raises :class:`WaitTimeoutError`."""
        self._cap = time.monotonic() + seconds
        try:
            yield
        finally:
            self._cap = None

    def _wait_all(self, seqs: Sequence[int], timeout: float | None) -> None:
        self._check_open()
        waited = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + waited
        cut = self._cap is not None and self._cap < deadline
        if cut:
            assert self._cap is not None
            deadline = self._cap
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
                if left > 0 and self._poll(int(left * 1000) + 1):
                    self._receive_one()
                    heard = time.monotonic()
                elif time.monotonic() >= deadline:
                    if cut:
                        raise WaitTimeoutError(
                            f"no reply from the daemon at {self.endpoint} within the time "
                            f"this client had left ({self._why_no_reply()})"
                        )
                    raise DaemonUnavailableError(
                        f"no reply from the daemon at {self.endpoint} within {waited:.1f}s "
                        f"({self._why_no_reply()})"
                    )
                elif waited > self.timeout and not self._pings:
                    self._pings.add(self._send("ping"))  # its reply is dropped on arrival

    def _poll(self, ms: int) -> bool:
        """Whether a reply is ready within ``ms``. While the hello's handshake is watched, a
        failed one ends the wait at once: libzmq would retry it with the same keys until the
        timeout, and nothing but the same failure can come of that."""
        if self._lane is not None:
            return self._lane.poll(ms)
        if self._monitor is None:
            return bool(self.socket.poll(ms))
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        ready = dict(poller.poll(ms))
        if self.socket in ready:
            return True
        if self._monitor in ready:
            event = recv_monitor_message(self._monitor)["event"]
            if event in _FAILED_HANDSHAKE:
                raise DaemonUnavailableError(
                    f"the daemon at {self.endpoint} did not accept this client "
                    f"({self._why_no_reply(event)})"
                )
        return False

    def _why_no_reply(self, failed: int | None = None) -> str:
        """A hint for a timeout, naming CURVE authentication when it may be the cause."""
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
            self._sockets.remove(self._monitor)
            self._monitor.close(linger=0)
            self._monitor = None

    def _receive_one(self) -> None:
        frames: list[Any]
        if self._lane is not None:
            frames = self._lane.recv()
            first = frames[0]
        else:
            frames = self.socket.recv_multipart(copy=False)
            first = frames[0].buffer
        self.last_heard = time.monotonic()
        header = decode(first, max_bytes=None)  # a sample reply may be megabytes
        got = header.get("seq")
        if not isinstance(got, int):
            raise ProtocolError(f"reply without a seq: {header!r}")
        if got in self._pings:  # a liveness ping: arriving was all it had to do
            self._pings.discard(got)
            self._check_same_daemon(header)
            return
        self._early[got] = (header, frames[1:])

    def _check_same_daemon(self, pong: dict[str, Any]) -> None:
        """A ping answered proves the daemon alive only if it is the one this client said
        hello to. A daemon started in a dead one's place on the same endpoint (a resume, a
        host restarting it) answers pings, since they need no hello, but the requests in
        flight died with the old one: waiting on would last to the end of the long wait."""
        pid = pong.get("pid")
        if pong.get("ok") and isinstance(pid, int) and pid != self.daemon_pid:
            raise UnknownClientError(
                f"the daemon at {self.endpoint} restarted: pid {pid} answers in place of pid "
                f"{self.daemon_pid}, and the requests this client had in flight died with it; "
                "reconnect (a new Writer/Reader)"
            )

    def call(
        self, op: str, frames: Sequence[Any] = (), timeout: float | None = None, **fields: Any
    ) -> dict[str, Any]:
        return self.wait(self.send(op, frames, **fields), timeout)[0]

    def close(self, goodbye: bool = True) -> None:
        """Say ``bye`` (unless not ``goodbye``: a daemon known not to answer) and close the
        sockets; the goodbye waits at most :data:`BYE_TIMEOUT_S` (or the timeout, if
        shorter). Safe to call twice; in a forked child it only marks this copy closed (the
        sockets are the parent's)."""
        if self.forked:
            self._closed = True
            self._finalizer.detach()
            return
        with self._lock:
            if self._closed:
                return
            try:
                if goodbye and self._sockets:  # the daemon may be gone; closing succeeds
                    _goodbye(self._sockets[-1], min(self.timeout, BYE_TIMEOUT_S))
            finally:
                self._closed = True
                self._monitor = None
                self._release_sockets()

    def _release_sockets(self) -> None:
        """Close the sockets now, in place of the finaliser (which then does nothing)."""
        if self._finalizer.detach() is not None:
            _close_sockets(self._pid, self._sockets)


def _check_socket_access(endpoint: str) -> None:
    """Refuse at once an ipc socket this user may not connect to (another user's daemon):
    ZeroMQ would retry its connect quietly until the timeout, and then only guess why."""
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
        return  # tcp, or an abstract socket (no file, no permissions)
    why = access_refusal(endpoint[len("ipc://") :], os.W_OK)
    if why is not None:
        raise PermissionDeniedError(
            f"the daemon at {endpoint} is another user's: {why}. Only that user, or members "
            "of the group it was started with (--group), may connect: its user shares it by "
            "starting it with --group naming a group you are in, or on loopback tcp, where a "
            "client of another user passes remote=True (README, Access)"
        )


def is_remote_target(endpoint: str) -> bool:
    """A ``tcp://`` endpoint on another host, whose shared memory cannot be mapped here."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    local = {"127.0.0.1", "localhost", "::1", "0.0.0.0", socket.gethostname()}
    return host not in local
