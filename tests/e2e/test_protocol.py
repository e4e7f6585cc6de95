"""Malformed, out-of-range and unauthorised requests on a raw socket: each one is answered
with a typed error code, and the daemon keeps serving. Every test runs twice: on a raw ZeroMQ
DEALER and on a raw connection to the local lane (the same messages, framed for a stream)."""

from __future__ import annotations

import os
import socket

import msgpack
import pytest
import zmq

from shmbuffer.clients.connection import Connection
from shmbuffer.errors import PermissionDeniedError
from shmbuffer.wire.protocol import PROTOCOL_VERSION, encode, request
from shmbuffer.wire.unix import Unpacker, lane_path, pack

SCHEMA = {"obs": {"dtype": "float32", "shape": [4]}}


class Raw:
    """A bare DEALER socket that sends any frames and reads back the decoded reply."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def ask(self, *frames: bytes) -> dict:
        self.sock.send_multipart(list(frames))
        assert self.sock.poll(5000), "no reply within 5 s"
        reply = self.sock.recv_multipart()
        return msgpack.unpackb(reply[0], raw=False)

    def req(self, op: str, seq: int = 1, **fields) -> dict:
        return self.ask(encode(request(op, seq, **fields)))

    def hello(self) -> None:
        reply = self.req("hello", role="writer", pid=os.getpid(), host=socket.gethostname())
        assert reply["ok"], reply

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


class RawLane(Raw):
    """The same, on a bare unix socket to the daemon's lane."""

    def __init__(self, endpoint: str) -> None:
        path = lane_path(endpoint)
        assert path is not None and os.path.exists(path), f"no lane beside {endpoint}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # type: ignore[assignment]
        self.sock.settimeout(5.0)
        self.sock.connect(path)
        self.unpacker = Unpacker()

    def ask(self, *frames: bytes) -> dict:
        self.sock.sendall(b"".join(bytes(b) for b in pack(frames)))
        while (reply := self.unpacker.next()) is None:
            data = self.sock.recv(1 << 16)
            assert data, "the daemon closed the lane connection"
            self.unpacker.feed(data)
        return msgpack.unpackb(reply[0], raw=False)

    def close(self) -> None:
        self.sock.close()


def _error(reply: dict, code: str, *words: str) -> None:
    assert reply["ok"] is False, reply
    assert reply["error"]["code"] == code, reply
    for word in words:
        assert word in reply["error"]["message"], reply


@pytest.fixture(params=["zmq", "lane"])
def raw_daemon(daemon, request: pytest.FixtureRequest):
    d = daemon(capacity=100, unit="transition")
    raws: list[Raw] = []
    kind = Raw if request.param == "zmq" else RawLane

    def make() -> Raw:
        raws.append(kind(d.endpoint))
        return raws[-1]

    try:
        yield d, make
    finally:
        for r in raws:
            r.close()


def _assert_alive(d, raw: Raw) -> None:
    reply = raw.req("ping", seq=99)
    assert reply["ok"] and reply["seq"] == 99 and reply["pid"] == d.pid, reply
    assert d.process.poll() is None


def test_malformed_frames_are_refused(raw_daemon):
    d, make = raw_daemon
    raw = make()
    good = encode(request("ping", 7))
    cases = [
        (b"\xc1\xc1garbage", "not valid msgpack"),
        (b"", "not valid msgpack"),
        (good[:-2], "not valid msgpack"),
        (msgpack.packb([1, 2, 3]), "map"),
        (msgpack.packb({b"op": b"ping"}), "string keys"),
        (b"\x80" + b"\x00" * (70 * 1024), "exceeds"),
        (msgpack.packb({"op": "ping", "seq": 1}), "'v'"),
        (msgpack.packb({"v": 1, "op": "ping", "seq": 1}), "'v'"),
        (msgpack.packb({"v": "x.y", "op": "ping", "seq": 1}), "'v'"),
        (msgpack.packb({"v": PROTOCOL_VERSION, "op": "frobnicate", "seq": 1}), "unknown op"),
        (msgpack.packb({"v": PROTOCOL_VERSION, "op": 5, "seq": 1}), "'op'"),
        (msgpack.packb({"v": PROTOCOL_VERSION, "op": "ping", "seq": -1}), "'seq'"),
        (msgpack.packb({"v": PROTOCOL_VERSION, "op": "ping", "seq": "1"}), "'seq'"),
        (msgpack.packb({"v": PROTOCOL_VERSION, "op": "ping", "seq": 1, "x": 1}), "'x'"),
    ]
    for frame, word in cases:
        _error(raw.ask(frame), "protocol", word)
    _error(raw.req("ping", v="2.0"), "version")
    _error(raw.ask(msgpack.packb({"v": "2.5", "op": "ping", "seq": 3})), "version")
    _assert_alive(d, raw)


def test_bad_fields_and_order_are_refused(raw_daemon):
    d, make = raw_daemon
    raw = make()
    _error(raw.req("stats", seq=5), "unknown_client", "say 'hello' first")
    _error(raw.req("reserve", rows=10), "unknown_client", "say 'hello' first")
    raw.hello()
    reply = raw.req("reserve", seq=11, rows="x")
    _error(reply, "protocol", "'rows'")
    assert reply["seq"] == 11
    for rows in (-1, 0, True, 2**63, 1.5, None):
        _error(raw.req("reserve", rows=rows), "protocol", "'rows'")
    _error(raw.req("reserve"), "protocol", "missing field 'rows'")
    _error(raw.req("reserve", rows=1, timeout_ms=-5), "protocol", "'timeout_ms'")
    _error(raw.req("sample", kind="rows", n=1 << 21), "protocol", "'n'")
    _error(raw.req("sample", kind="nope", n=1), "protocol", "'kind'")
    _error(raw.req("sample", kind="slices", n=1), "protocol", "'length'")
    _error(raw.req("hello", role="root", pid=1, host="h"), "protocol", "'role'")
    _error(raw.req("commit", reservation=0), "protocol", "'reservation'")
    # well-formed but impossible
    _error(raw.req("reserve", rows=5), "schema")  # no schema yet
    _error(raw.req("define_schema", schema={"obs": {"dtype": "nope"}}), "schema", "nope")
    _error(raw.req("define_schema", schema={}), "schema")
    assert raw.req("define_schema", schema=SCHEMA)["ok"]
    _error(raw.req("define_schema", schema={"obs": {"dtype": "int8"}}), "schema")
    _error(raw.req("reserve", rows=101), "capacity")
    _error(raw.req("commit", reservation=12345), "not_found")
    _error(raw.req("release", lease=12345), "not_found")
    _error(raw.req("sample", kind="rows", n=4), "empty")
    _error(raw.req("write", rows=2), "schema", "payload frames")
    _error(raw.ask(encode(request("write", 1, rows=2)), b"\x00" * 3), "schema", "'obs'")
    _error(raw.req("clear"), "permission")
    _error(raw.req("shutdown"), "permission")
    _assert_alive(d, raw)
    assert d.stats()["errors"] >= 25


def test_someone_elses_reservation(raw_daemon):
    d, make = raw_daemon
    a = Connection(d.name, "writer", timeout=5)
    b = Connection(d.name, "writer", timeout=5)
    try:
        a.call("define_schema", schema=SCHEMA)
        rid = a.call("reserve", rows=10)["reservation"]
        with pytest.raises(PermissionDeniedError):
            b.call("commit", reservation=rid)
        with pytest.raises(PermissionDeniedError):
            b.call("abort", reservation=rid)
        raw = make()
        raw.hello()
        _error(raw.req("commit", reservation=rid), "permission", str(rid))
        # the owner still can
        assert a.call("commit", reservation=rid)["episodes"]
        assert d.stats()["rows_committed"] == 10
        _assert_alive(d, raw)
    finally:
        a.close()
        b.close()


def test_unicode_digit_version_does_not_kill_the_daemon(raw_daemon):
    # regression: "²".isdigit() is True but int("²") raised ValueError out of the server loop
    d, make = raw_daemon
    raw = make()
    _error(raw.ask(msgpack.packb({"v": "\u00b2.0", "op": "ping", "seq": 1})), "protocol")
    assert d.process.poll() is None, f"the daemon exited with {d.process.returncode}"
    _assert_alive(d, raw)
