"""The daemon's end of the lane (``daemon/lane.py``) on a real unix socket, driven the way the
server's loop drives it: a reply of any size the protocol allows reaches a client that reads
it, and only replies piling up *behind* the one a client has to read next end its connection.

The large replies are views of one zero-filled ``bytearray`` whose pages are never written (no
memory to speak of on either side); the client counts what arrives and keeps the last bytes.
"""

from __future__ import annotations

import socket
import struct
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from shmbuffer.daemon.lane import MAX_UNREAD_BYTES, Lane
from shmbuffer.wire.protocol import encode, request
from shmbuffer.wire.unix import pack

#: A reply past the old limit on unread bytes (256 MiB), of the order of a legal sample's
#: (2**26 rows: 512 MiB of stamps).
BIG = MAX_UNREAD_BYTES + (16 << 20)
HEADER = encode({"v": "1.5", "seq": 1, "ok": True})


class Loop:
    """The server loop's part: poll, hand lane events to the lane, collect requests."""

    def __init__(self, lane: Lane) -> None:
        self.lane = lane
        self.poller = zmq.Poller()
        lane.register(self.poller)

    def turn(self, ms: int = 20) -> list[tuple[bytes, list[bytes]]]:
        got = []
        for fd, events in self.poller.poll(ms):
            got.extend(self.lane.on_event(fd, events))
        return got

    def connect(self) -> tuple[socket.socket, bytes]:
        """A client connection and the identity the lane gave it (off its first request)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(20.0)
        sock.connect(self.lane.path)
        sock.sendall(b"".join(bytes(b) for b in pack([encode(request("ping", 1))])))
        for _ in range(100):
            for identity, _frames in self.turn():
                return sock, identity
        raise AssertionError("the lane never saw the client's request")

    def read(self, sock: socket.socket, expected: int) -> tuple[int, bytes]:
        """What the client reads (bytes, and the last 8) until ``expected`` bytes or the
        lane's hang-up, the loop serving it meanwhile."""
        got: dict[str, object] = {}
        reader = threading.Thread(target=_drain, args=(sock, expected, got))
        reader.start()
        while reader.is_alive():
            self.turn()
        return int(got["total"]), bytes(got["tail"])  # type: ignore[call-overload,arg-type]


def _drain(sock: socket.socket, expected: int, out: dict[str, object]) -> None:
    chunk, total, tail = bytearray(1 << 20), 0, b""
    while total < expected and (got := sock.recv_into(chunk)):
        total += got
        tail = (tail + bytes(chunk[:got]))[-8:]
    out.update(total=total, tail=tail)


def _size(*frames: bytes | bytearray | memoryview) -> int:
    return sum(b.nbytes for b in pack(list(frames)))


@pytest.fixture
def loop() -> Iterator[Loop]:
    folder = tempfile.mkdtemp(prefix="sblane-", dir="/tmp")  # unix socket paths are short
    lane = Lane(str(Path(folder) / "x.sock.lane"), None, 1 << 20)
    yield Loop(lane)
    lane.close()
    Path(folder).rmdir()


def test_a_reply_larger_than_the_unread_limit_reaches_a_client_that_reads(loop: Loop) -> None:
    sock, identity = loop.connect()
    payload = bytearray(BIG)
    payload[-8:] = struct.pack("<Q", 0x5EED)
    loop.lane.send(identity, [HEADER, payload])  # far more than the socket takes at once
    total, tail = loop.read(sock, _size(HEADER, payload))
    assert total == _size(HEADER, payload), "the lane closed a client reading its reply"
    assert tail == struct.pack("<Q", 0x5EED)
    sock.close()


def test_replies_piling_up_behind_the_next_one_end_a_client_that_does_not_read(
    loop: Loop,
) -> None:
    payload = memoryview(bytearray(BIG))
    half = payload[: MAX_UNREAD_BYTES // 2 + 1]
    # one large reply, and less than the limit behind it: all of it arrives
    sock, identity = loop.connect()
    loop.lane.send(identity, [HEADER, payload])
    loop.lane.send(identity, [HEADER, half])
    both = _size(HEADER, payload) + _size(HEADER, half)
    assert loop.read(sock, both)[0] == both
    sock.close()
    # more than the limit behind it: a client that reads nothing is dropped
    sock, identity = loop.connect()
    for part in (payload, half, half):
        loop.lane.send(identity, [HEADER, part])
    assert loop.read(sock, both)[0] < _size(HEADER, payload)
    sock.close()
