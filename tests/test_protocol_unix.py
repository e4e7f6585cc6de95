"""The local lane's framing: whatever way a stream cuts its bytes, the same messages come out;
a stream that breaks the framing is refused."""

from __future__ import annotations

import itertools
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmbuffer.errors import ProtocolError
from shmbuffer.wire.unix import MAX_FRAMES, Unpacker, lane_path, pack, unsent


def _wire(frames: list[bytes]) -> bytes:
    return b"".join(bytes(b) for b in pack(frames))


messages = st.lists(st.lists(st.binary(max_size=300), min_size=1, max_size=4), max_size=6)


@settings(max_examples=200, deadline=None)
@given(messages, st.lists(st.integers(0, 2000), max_size=12))
def test_any_cut_of_the_stream_gives_the_same_messages(sent, cuts):
    stream = b"".join(_wire(m) for m in sent)
    points = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    unpacker, got = Unpacker(), []
    for lo, hi in itertools.pairwise(points):
        unpacker.feed(memoryview(stream)[lo:hi])
        while (message := unpacker.next()) is not None:
            got.append(message)
    assert got == sent
    assert unpacker.buffered == 0


@given(messages, st.integers(0, 5000))
def test_unsent_is_the_tail_of_the_message(sent, n):
    for frames in sent:
        buffers = pack(frames)
        whole = b"".join(bytes(b) for b in buffers)
        n_sent = min(n, len(whole))
        assert b"".join(bytes(b) for b in unsent(buffers, n_sent)) == whole[n_sent:]


def test_a_message_waits_for_its_last_byte():
    wire = _wire([b"header", b"payload"])
    unpacker = Unpacker()
    unpacker.feed(wire[:-1])
    assert unpacker.next() is None
    unpacker.feed(wire[-1:])
    assert unpacker.next() == [b"header", b"payload"]


@pytest.mark.parametrize("count", [0, MAX_FRAMES + 1, 2**32 - 1])
def test_a_frame_count_out_of_range_is_refused(count):
    unpacker = Unpacker()
    unpacker.feed(struct.pack("<I", count) + b"\x00" * 64)
    with pytest.raises(ProtocolError, match=f"{count} frames"):
        unpacker.next()


def test_a_message_over_the_limit_is_refused_before_it_arrives():
    unpacker = Unpacker(max_bytes=1000)
    unpacker.feed(struct.pack("<IQ", 1, 1001))  # only the prefix: the rest never needs to come
    with pytest.raises(ProtocolError, match="1,001 bytes exceeds 1,000"):
        unpacker.next()


def test_lane_path_is_beside_an_ipc_socket_only():
    assert lane_path("ipc:///run/x/buf.sock") == "/run/x/buf.sock.lane"
    assert lane_path("tcp://127.0.0.1:5555") is None
