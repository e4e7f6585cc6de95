"""The local lane: the protocol's messages on a unix stream socket, shared by daemon and clients.

A ZeroMQ request between two processes crosses four threads (the client's, its I/O thread, the
daemon's I/O thread, the daemon's loop) and each crossing is a wake-up: a ping's round trip
took several times a plain unix socket's (``docs/architecture.md``). A daemon on
an ``ipc://`` endpoint without CURVE therefore also listens on ``<ipc path>.lane`` (same
folder, same mode and group), and local clients use it when it answers; tcp, CURVE, and
``SHMBUFFER_LANE=0`` keep ZeroMQ. The messages and their meaning are the same on both; only the
framing differs, because a stream has no frames of its own::

    u32 n | n x u64 length | frame 0 | ... | frame n-1        (little-endian)

Frame 0 is the msgpack header; any more are payload frames, as over ZeroMQ.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from typing import Any

from shmbuffer.errors import ProtocolError

LANE_SUFFIX = ".lane"
ENV_LANE = "SHMBUFFER_LANE"  # "0": clients keep ZeroMQ even where a lane answers
#: Frames in one message: a header and one per column is all the protocol sends.
MAX_FRAMES = 4096

_COUNT = struct.Struct("<I")


def lane_path(endpoint: str) -> str | None:
    """The lane's socket path beside an ``ipc://`` endpoint's; None for any other endpoint."""
    if not endpoint.startswith("ipc://"):
        return None
    return endpoint[len("ipc://") :] + LANE_SUFFIX


def lane_wanted() -> bool:
    return os.environ.get(ENV_LANE, "1") != "0"


def pack(frames: Sequence[Any]) -> list[memoryview]:
    """The buffers that carry ``frames`` as one message (for ``sendmsg``: nothing is joined)."""
    views = [memoryview(f).cast("B") for f in frames]
    prefix = struct.pack(f"<I{len(views)}Q", len(views), *(v.nbytes for v in views))
    return [memoryview(prefix), *views]


def unsent(buffers: list[memoryview], sent: int) -> list[memoryview]:
    """What is left of ``buffers`` once their first ``sent`` bytes went out (a stream socket
    may take part of a message)."""
    for i, buf in enumerate(buffers):
        if sent < buf.nbytes:
            return [buf[sent:], *buffers[i + 1 :]]
        sent -= buf.nbytes
    return []


class Unpacker:
    """Cuts a byte stream into messages: :meth:`feed` what arrived, then take :meth:`next`
    until it returns None. A stream that breaks the framing (too many frames, a message over
    ``max_bytes``) raises ProtocolError: it cannot be resynchronised, so the connection ends."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes
        self._buf = bytearray()
        self._at = 0  # where the next message starts in _buf (what is before it was taken)
        self._lengths: tuple[int, ...] | None = None  # of the message at _at, once known
        self._end = 0  # where that message ends, once its lengths are known

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._at:  # drop what was taken once per read, not once per message
            del self._buf[: self._at]
            self._end -= self._at
            self._at = 0
        self._buf += data

    @property
    def buffered(self) -> int:
        return len(self._buf) - self._at

    def next(self) -> list[bytes] | None:
        """The next whole message's frames, or None until more has arrived."""
        buf, at = self._buf, self._at
        if self._lengths is None:
            if len(buf) - at < _COUNT.size:
                return None
            (n,) = _COUNT.unpack_from(buf, at)
            if not 1 <= n <= MAX_FRAMES:
                raise ProtocolError(f"lane message of {n} frames (1 to {MAX_FRAMES} allowed)")
            prefix = _COUNT.size + 8 * n
            if len(buf) - at < prefix:
                return None
            lengths = struct.unpack_from(f"<{n}Q", buf, at + _COUNT.size)
            total = sum(lengths)
            if self.max_bytes is not None and total > self.max_bytes:
                raise ProtocolError(f"lane message of {total:,} bytes exceeds {self.max_bytes:,}")
            self._lengths, self._end = lengths, at + prefix + total
        if len(buf) < self._end:
            return None
        frames, offset = [], self._end - sum(self._lengths)
        with memoryview(buf) as view:  # one copy per frame (released before feed resizes)
            for length in self._lengths:
                frames.append(bytes(view[offset : offset + length]))
                offset += length
        self._at, self._lengths = self._end, None
        return frames
