"""The daemon's end of the local lane (framing in ``shmbuffer/wire/unix.py``).

One listening unix stream socket beside the ipc one, and its connections, all non-blocking and
polled by the server's loop with its ROUTER: the loop stays one thread and never waits on a
client. Each connection is a client identity of its own (``b"\\x01lane"`` + a counter: ZeroMQ's
generated identities are five bytes starting ``\\x00``, so the two never meet), and its
messages go through the same decoding, validation and handlers as ZeroMQ's.

A reply that does not fit the socket's buffer waits in the connection's queue and goes out as
the client reads (POLLOUT), so a slow reader never blocks the loop. The lane carries every reply
the protocol allows, as ZeroMQ does: one reply of any size may wait for its client (its bytes
are the reply the daemon built, queued without a copy). What the limit is about is a client
that does not read: a connection whose replies queued *behind* the one it has to read next
pass ``MAX_UNREAD_BYTES`` is closed, as is one that breaks the framing or hangs up, and the
server is told (``on_close``): unlike a ZeroMQ peer, a lane client whose connection is gone is
gone. Each connection also knows the process at its other end, as the kernel reports it
(``SO_PEERCRED``): the one transport here that vouches for a client's pid.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from shmbuffer.daemon.processes import Process, peer_process
from shmbuffer.daemon.security import secure_ipc_path
from shmbuffer.errors import ProtocolError
from shmbuffer.wire.unix import Unpacker, pack, unsent

log = logging.getLogger("shmbuffer.daemon")

#: Replies a client may leave queued behind the one it reads next before it is dropped. A
#: Reader never has more than one large reply outstanding (it asks for the next batch once it
#: took the last), so only a client that stopped reading gets here.
MAX_UNREAD_BYTES = 256 * 1024 * 1024
ACCEPT_PAUSE_S = 1.0  # after a failed accept (out of descriptors): stop listening this long
_READ_BYTES = 256 * 1024  # read into one reused buffer: a fresh 1 MB bytes per recv was an mmap
_FLAGS = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL
_IDENTITY = b"\x01lane"  # + a counter; ZeroMQ's generated identities start with b"\x00"


class _Conn:
    def __init__(self, sock: socket.socket, identity: bytes, max_bytes: int) -> None:
        self.sock = sock
        self.fd = sock.fileno()  # what the poller names it by (also once it is closed)
        self.identity = identity
        self.unpacker = Unpacker(max_bytes)
        self.queued: deque[memoryview] = deque()  # what the socket did not take yet
        self.queued_bytes = 0
        self.sizes: deque[int] = deque()  # bytes left of each queued message, oldest first
        self.process = peer_process(sock)

    def took(self, sent: int) -> None:
        """The socket took ``sent`` more bytes of the queue: whole messages leave ``sizes``."""
        self.queued_bytes -= sent
        while sent:
            part = min(sent, self.sizes[0])
            self.sizes[0] -= part
            sent -= part
            if not self.sizes[0]:
                self.sizes.popleft()


class Lane:
    """Listens on ``path`` (mode as the ipc socket's: ``0600``, or ``0660`` for ``gid``)."""

    def __init__(
        self,
        path: str,
        gid: int | None,
        max_bytes: int,
        on_close: Callable[[bytes], None] | None = None,
    ) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._on_close = on_close  # told the identity of each connection that closes
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a crashed daemon's (the ipc socket's bind replaces its own too)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # created owner-only; opened to the group below if asked
        try:
            self.listener.bind(path)
        except BaseException:
            self.listener.close()
            raise
        finally:
            os.umask(old)
        secure_ipc_path(path, gid)
        self.listener.listen(128)
        self.listener.setblocking(False)
        self._poller: zmq.Poller | None = None
        self._conns: dict[int, _Conn] = {}  # by file descriptor
        self._by_identity: dict[bytes, _Conn] = {}
        self._next = 0
        self._inbox = bytearray(_READ_BYTES)
        self._paused_until: float | None = None  # the listener is out of the poller until then

    def register(self, poller: zmq.Poller) -> None:
        self._poller = poller
        poller.register(self.listener.fileno(), zmq.POLLIN)

    def tick(self, now: float) -> None:
        """Listen again once a pause after a failed accept is over (the server's timer)."""
        if self._paused_until is not None and now >= self._paused_until:
            self._paused_until = None
            assert self._poller is not None
            self._poller.register(self.listener.fileno(), zmq.POLLIN)

    def owns(self, identity: bytes) -> bool:
        return identity.startswith(_IDENTITY)

    def process(self, identity: bytes) -> Process | None:
        """The process at the other end of ``identity``'s connection, as the kernel says."""
        conn = self._by_identity.get(identity)
        return None if conn is None else conn.process

    # -- events -------------------------------------------------------------------------------

    def on_event(self, fd: int, events: int) -> Iterator[tuple[bytes, list[bytes]]]:
        """Handle one poll event of a lane socket (the poller names raw sockets by their file
        descriptor); yields ``(identity, frames)`` per message."""
        if fd == self.listener.fileno():
            self._accept()
            return
        conn = self._conns.get(fd)
        if conn is None:
            return
        if events & zmq.POLLOUT:
            self._flush(conn)
        if events & (zmq.POLLIN | zmq.POLLERR):
            yield from self._read(conn)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # Out of descriptors, say. The connection stays in the backlog, so the listener
                # would poll readable at once, forever: it sits out a while instead.
                log.warning(
                    "could not accept a lane connection (%s); not listening for %.0f s",
                    exc,
                    ACCEPT_PAUSE_S,
                )
                assert self._poller is not None
                self._poller.unregister(self.listener.fileno())
                self._paused_until = time.monotonic() + ACCEPT_PAUSE_S
                return
            sock.setblocking(False)
            self._next += 1
            conn = _Conn(sock, _IDENTITY + struct.pack("<Q", self._next), self.max_bytes)
            self._conns[conn.fd] = conn
            self._by_identity[conn.identity] = conn
            assert self._poller is not None
            self._poller.register(conn.fd, zmq.POLLIN)

    def _read(self, conn: _Conn) -> Iterator[tuple[bytes, list[bytes]]]:
        try:
            got = conn.sock.recv_into(self._inbox)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            got = 0
        if not got:  # hung up (or reset): nothing more can come
            self._close(conn)
            return
        conn.unpacker.feed(memoryview(self._inbox)[:got])
        while True:
            try:
                frames = conn.unpacker.next()
            except ProtocolError as exc:
                log.warning("closing a lane connection that broke the framing: %s", exc)
                self._close(conn)
                return
            if frames is None:
                return
            yield conn.identity, frames

    # -- replies ------------------------------------------------------------------------------

    def send(self, identity: bytes, frames: list[Any]) -> None:
        """Send one message to a lane client (dropped if it is gone, as ZeroMQ drops one)."""
        conn = self._by_identity.get(identity)
        if conn is None:
            return
        buffers = pack(frames)
        if not conn.queued:
            try:
                sent = conn.sock.sendmsg(buffers, [], _FLAGS)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._close(conn)
                return
            buffers = unsent(buffers, sent)
            if not buffers:
                return
            assert self._poller is not None
            self._poller.modify(conn.fd, zmq.POLLIN | zmq.POLLOUT)
        size = sum(b.nbytes for b in buffers)
        conn.queued.extend(buffers)
        conn.queued_bytes += size
        conn.sizes.append(size)
        behind = conn.queued_bytes - conn.sizes[0]  # what waits behind the reply read next
        if behind > MAX_UNREAD_BYTES:
            log.warning(
                "closing a lane connection that left %d bytes of replies unread behind the "
                "one it has to read next (%d bytes)",
                behind,
                conn.sizes[0],
            )
            self._close(conn)

    def _flush(self, conn: _Conn) -> None:
        while conn.queued:
            batch = list(itertools.islice(conn.queued, 64))  # at most IOV_MAX's share
            try:
                sent = conn.sock.sendmsg(batch, [], _FLAGS)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._close(conn)
                return
            conn.took(sent)
            rest = unsent(batch, sent)
            for _ in batch:
                conn.queued.popleft()
            conn.queued.extendleft(reversed(rest))
            if rest:
                return  # the socket is full again: the next POLLOUT goes on
        assert self._poller is not None
        self._poller.modify(conn.fd, zmq.POLLIN)

    # -- closing ------------------------------------------------------------------------------

    def _close(self, conn: _Conn) -> None:
        if self._conns.pop(conn.fd, None) is None:
            return
        self._by_identity.pop(conn.identity, None)
        if self._poller is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._poller.unregister(conn.fd)
        conn.sock.close()
        if self._on_close is not None:
            self._on_close(conn.identity)

    def close(self) -> None:
        self._on_close = None  # stopping: the clients' state goes with the daemon
        for conn in list(self._conns.values()):
            self._close(conn)
        self.listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
