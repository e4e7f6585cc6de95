"""A client's end of the local lane (framing in ``shmbuffer/wire/unix.py``).

The three calls :class:`~shmbuffer.clients.connection.Connection` makes of its ZeroMQ socket
(send a message, poll for a reply, take it), on a unix stream socket, and with what a DEALER
does when its daemon goes away: it reconnects. After a hang-up (the daemon exited, or was
killed and ``--resume``d) the next request connects again, to whichever daemon listens there
by then; a request that finds none waits, as it would in ZeroMQ's queue, and its caller's
deadline still bounds it. What this adds: a request already sent when the lane hung up can
never be answered (the daemon that took it is gone), so its wait ends at once with
``DaemonUnavailableError`` instead of at its timeout. Sends block at most ``timeout`` (a
daemon that stopped reading).
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Sequence
from typing import Any

from shmbuffer.errors import DaemonUnavailableError
from shmbuffer.wire.unix import Unpacker, pack, unsent

_READ_BYTES = 256 * 1024  # read into one reused buffer: a fresh 1 MB bytes per recv was an mmap
RECONNECT_S = 0.02  # how often a request waiting for a daemon tries the lane again


def connect_lane(path: str, timeout: float) -> LaneSocket | None:
    """A connection to the lane at ``path``, or None where none answers (an older daemon, a
    tcp one, a stale file): the caller keeps ZeroMQ."""
    sock = _connect(path, timeout)
    return None if sock is None else LaneSocket(sock, path, timeout)


def _connect(path: str, timeout: float) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    return sock


class LaneSocket:
    def __init__(self, sock: socket.socket, path: str, timeout: float) -> None:
        self.path = path
        self.timeout = timeout
        self.sock: socket.socket | None = None
        self._attach(sock)
        self._message: list[bytes] | None = None  # parsed, not yet taken
        self._inbox = bytearray(_READ_BYTES)
        self._waiting: list[list[memoryview]] = []  # requests made while no daemon listened
        self._next_try = 0.0

    def _attach(self, sock: socket.socket) -> None:
        self.sock = sock
        self._unpacker = Unpacker()
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self._unanswered = 0  # requests sent on this connection, minus replies taken

    @property
    def connected(self) -> bool:
        """Whether the connection is up (False after a hang-up, until a request reconnects)."""
        return self.sock is not None

    # -- sending ------------------------------------------------------------------------------

    def send(self, frames: Sequence[Any]) -> None:
        buffers = pack(frames)
        if self.sock is None and not self._reconnect():
            self._waiting.append(buffers)
            return
        self._send(buffers)

    def _send(self, buffers: list[memoryview]) -> None:
        assert self.sock is not None
        whole = buffers
        try:
            while buffers:  # each wait bounded by the timeout (a daemon that stopped reading)
                buffers = unsent(buffers, self.sock.sendmsg(buffers, [], socket.MSG_NOSIGNAL))
        except TimeoutError:
            raise DaemonUnavailableError(
                f"the daemon's lane at {self.path} took no request within {self.timeout:.1f}s"
            ) from None
        except OSError:  # hung up before this went: it waits for the next daemon, unsent
            self._hang_up()
            if buffers is whole:
                self._waiting.append(whole)
                return
            raise self._lost() from None  # part of it went to the daemon that is gone
        self._unanswered += 1

    def _reconnect(self) -> bool:
        now = time.monotonic()
        if now < self._next_try:
            return False
        self._next_try = now + RECONNECT_S
        sock = _connect(self.path, self.timeout)
        if sock is None:
            return False
        self._attach(sock)
        waiting, self._waiting = self._waiting, []
        for buffers in waiting:
            self._send(buffers)
        return True

    # -- receiving ----------------------------------------------------------------------------

    def poll(self, ms: int) -> bool:
        """Whether a whole message is here within ``ms`` milliseconds."""
        deadline = time.monotonic() + ms / 1000
        while self._message is None:
            if self.sock is None:  # hung up: wait for a daemon to take the waiting requests
                if not self._reconnect():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    time.sleep(min(left, RECONNECT_S))
                continue
            self._message = self._unpacker.next()
            if self._message is not None:
                break
            left = max(0, int((deadline - time.monotonic()) * 1000))
            if not self._poll.poll(left):
                return False
            self._read()
        return True

    def recv(self) -> list[bytes]:
        """The message :meth:`poll` found; call it after a poll said True."""
        message, self._message = self._message, None
        if message is None:
            raise RuntimeError("LaneSocket.recv() without a message: poll() first")
        self._unanswered -= 1
        return message

    def _read(self) -> None:
        assert self.sock is not None
        try:
            got = self.sock.recv_into(self._inbox, 0, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            got = 0
        if got:
            self._unpacker.feed(memoryview(self._inbox)[:got])
            return
        lost = self._unanswered > 0
        self._hang_up()
        if lost:
            raise self._lost()

    def _hang_up(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock = None
        self._next_try = 0.0

    def _lost(self) -> DaemonUnavailableError:
        return DaemonUnavailableError(
            f"the daemon closed its lane at {self.path} with requests unanswered (it exited "
            "or was killed): they cannot be answered; new requests go to the daemon that "
            "listens there next"
        )

    def close(self) -> None:
        self._hang_up()
