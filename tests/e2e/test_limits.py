"""Resource limits: clients, reservations and leases per client, payload sizes, and a buffer
that does not fit its file system. Each is refused with a clear ``limit`` (or out-of-space)
error, and the daemon goes on serving.

Oversized messages, in practice: the daemon's ROUTER has ``ZMQ_MAXMSGSIZE`` set to
``max_payload_bytes`` + the 64 KiB header limit, checked by libzmq per frame. A peer that sends
a bigger frame is disconnected by libzmq before the daemon sees anything, so it gets **no
reply** (a client's wait ends with ``DaemonUnavailableError`` after its timeout) while the
daemon and its other clients carry on. That is why the checks that name the size happen
earlier: a ``Connection`` refuses a payload over the daemon's ``max_payload_bytes`` (which the
daemon announces in ``hello``) before sending it, and the daemon refuses a ``write`` whose
frames add up to more (each frame under the libzmq limit) with a ``limit`` error.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from shmbuffer import Reader, Writer
from shmbuffer.cli.demo_loops import make_episode
from shmbuffer.clients.connection import Connection
from shmbuffer.errors import LimitExceededError
from shmbuffer.storage.schema import Schema
from shmbuffer.wire.protocol import MAX_HEADER_BYTES, MAX_SAMPLE, MAX_SAMPLE_ROWS, PROTOCOL_VERSION

LENGTH = 10
OBS = (3,)
SPEC = Schema.from_batch(make_episode(0, 0, 1, OBS)).to_spec()
ROW = Schema.from_spec(SPEC).row_nbytes
MAX_PAYLOAD = 4096


class Raw:
    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def ask(self, frames: list[Any], wait_ms: int = 5000) -> dict[str, Any] | None:
        self.sock.send_multipart(frames)
        if not self.sock.poll(wait_ms):
            return None
        reply: dict[str, Any] = msgpack.unpackb(self.sock.recv_multipart()[0])
        return reply

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def header(op: str, **fields: Any) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "op": op, "seq": 7, **fields})


@pytest.fixture
def limited(daemon, e2e_env):
    (e2e_env.runtime_dir / "schema.json").write_text(json.dumps(SPEC))
    config = e2e_env.runtime_dir / "limits.toml"
    config.write_text(
        "[daemon]\n"
        "max_clients = 4\n"
        "max_reservations_per_client = 2\n"
        "max_leases_per_client = 2\n"
        f"max_payload_bytes = {MAX_PAYLOAD}\n"
    )
    args = ["--config", str(config), "--schema", str(e2e_env.runtime_dir / "schema.json")]
    return daemon(capacity=100 * LENGTH, unit="episode", args=args)


def test_limits_are_refused_clearly(limited):
    d = limited
    admin = Connection(d.name, "admin", timeout=5)  # client 1 of 4
    writer = Writer(d.name, timeout=5)  # 2
    reader = Reader(d.name, timeout=5)  # 3
    try:
        for e in range(4):
            writer.add_episode(make_episode(1, e, LENGTH, OBS))
        writer.flush()

        # reservations per client
        conn = writer.conn
        held = [conn.call("reserve", rows=LENGTH)["reservation"] for _ in range(2)]
        with pytest.raises(LimitExceededError, match=r"2 open reservations \(limit 2\)"):
            conn.call("reserve", rows=LENGTH)
        for rid in held:
            conn.call("abort", reservation=rid)
        conn.call("abort", reservation=conn.call("reserve", rows=LENGTH)["reservation"])

        # leases per client
        with (
            reader.sample_episodes(2),
            reader.sample_episodes(2),
            pytest.raises(LimitExceededError, match="max_leases_per_client=2"),
            reader.sample_episodes(2),
        ):
            pass
        assert admin.call("stats")["stats"]["leases"] == 0
        with reader.sample_episodes(2) as episodes:
            assert len(episodes) == 2

        # clients
        fourth = Connection(d.name, "reader", timeout=5)
        with pytest.raises(LimitExceededError, match=r"too many clients .*max_clients=4"):
            Connection(d.name, "reader", timeout=5)
        fourth.close()  # 'bye' frees its place
        Connection(d.name, "reader", timeout=5).close()

        # a sample whose reply would be over max_payload_bytes (16 bytes a row locally)
        with pytest.raises(LimitExceededError, match="max_payload_bytes=4,096"):
            reader.sample(MAX_PAYLOAD // 16 + 1)
        assert len(reader.sample(MAX_PAYLOAD // 16)) == MAX_PAYLOAD // 16
        stats = admin.call("stats")["stats"]
        assert stats["reservations"] == 0 and stats["episodes_committed"] == 4
    finally:
        for c in (reader, writer, admin):
            c.close()


def test_oversized_payloads(limited):
    d = limited
    remote = Writer(d.name, remote=True, timeout=3)
    raw = Raw(d.endpoint)
    bystander = Raw(d.endpoint)
    try:
        remote.add_episode(make_episode(1, 0, LENGTH, OBS))  # 320 bytes: fine
        too_many = MAX_PAYLOAD // ROW + 1
        # the client refuses it before sending, naming the size and the limit
        with pytest.raises(LimitExceededError, match=r"payload of [\d,]+ bytes .*4,096"):
            remote.add_episode(make_episode(1, 1, too_many, OBS))

        # the daemon refuses it too, for a client that sends it anyway (each frame is small)
        hello = header("hello", role="writer", pid=os.getpid(), host=socket.gethostname())
        assert raw.ask([hello])["ok"]
        schema = Schema.from_spec(SPEC)
        ep = make_episode(1, 2, too_many, OBS)
        frames = [np.ascontiguousarray(ep[f.key[0]]).tobytes() for f in schema.fields]
        assert max(len(f) for f in frames) < MAX_PAYLOAD < sum(len(f) for f in frames)
        reply = raw.ask([header("write", rows=too_many), *frames])
        assert reply is not None and reply["ok"] is False
        assert reply["error"]["code"] == "limit"
        message = reply["error"]["message"]
        assert f"{too_many * ROW:,} bytes" in message and "max_payload_bytes=4,096" in message
        # rows alone can make a write too large, whatever frames come with it
        reply = raw.ask([header("write", rows=10**9), b"x"])
        assert reply is not None and reply["error"]["code"] == "limit"

        # one frame over ZMQ_MAXMSGSIZE: libzmq drops the connection, nothing is answered...
        huge = b"\x00" * (MAX_PAYLOAD + MAX_HEADER_BYTES + 1)
        assert raw.ask([header("write", rows=1), huge], wait_ms=1500) is None
        # ...and the daemon, its data and its other clients carry on
        assert bystander.ask([header("ping")])["ok"]
        remote.add_episode(make_episode(1, 3, LENGTH, OBS))
        stats = d.stats()
        assert stats["episodes_committed"] == 2 and stats["errors"] >= 2
        assert d.process.poll() is None
    finally:
        remote.close()
        raw.close()
        bystander.close()


def test_a_sample_over_the_protocol_limits_is_refused_before_it_is_sent(limited):
    """The Reader refuses what the in-process Buffer refuses, as the Buffer does
    (LimitExceededError naming the argument): over ``MAX_SAMPLE`` items or ``MAX_SAMPLE_ROWS``
    rows, before any request goes out."""
    d = limited
    with Writer(d.name, timeout=5) as writer, Reader(d.name, timeout=5, prefetch=False) as reader:
        for e in range(4):
            writer.add_episode(make_episode(1, e, LENGTH, OBS))
        writer.flush()
        reader.sample(1)
        first = d.stats()["messages"]
        before = d.stats()["messages"]  # what a stats call itself counts: before - first
        with pytest.raises(LimitExceededError, match=f"batch_size={MAX_SAMPLE + 1:,}"):
            reader.sample(MAX_SAMPLE + 1)
        with pytest.raises(LimitExceededError, match=f"n={MAX_SAMPLE + 1:,}"):
            reader.sample_slices(MAX_SAMPLE + 1, 1)
        with pytest.raises(LimitExceededError, match=f"{MAX_SAMPLE_ROWS:,} rows per sample"):
            reader.sample_slices(2, MAX_SAMPLE_ROWS // 2 + 1)
        with (
            pytest.raises(LimitExceededError, match=f"n={MAX_SAMPLE + 1:,}"),
            reader.sample_episodes(MAX_SAMPLE + 1),
        ):
            pass
        assert d.stats()["messages"] - before == before - first  # nothing else arrived


def test_prefetch_never_turns_an_allowed_sample_into_a_refused_one(limited):
    """Prefetching ``k`` batches in one request multiplies its rows by ``k``: where that would
    pass the daemon's limit on a reply (here ``max_payload_bytes`` / 16 = 256 rows), the
    Reader fetches one batch a request instead of being refused."""
    d = limited
    with Writer(d.name, timeout=5) as writer, Reader(d.name, timeout=5, prefetch=4) as reader:
        for e in range(4):
            writer.add_episode(make_episode(1, e, LENGTH, OBS))
        writer.flush()
        for _ in range(3):  # 100 rows a call: 400 would be refused
            assert reader.sample_slices(10, LENGTH).shape == (10, LENGTH)
        assert reader.sample_slices(2, 5).shape == (2, 5)  # 4 x 10 rows: fetched together


def test_buffer_too_big_for_its_file_system_is_refused_at_start(e2e_env):
    schema = e2e_env.runtime_dir / "schema.json"
    schema.write_text(json.dumps({"obs": {"dtype": "float32", "shape": [1024]}}))
    storage = str(e2e_env.storage_dir)
    result = e2e_env.cli(
        "start", "--name", "huge", "--capacity", str(10**12), "--schema", str(schema),
        "--storage-dir", storage,
    )  # fmt: skip
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    assert "needs 4,104,000,000,000,000 bytes" in result.stderr, result.stderr
    assert "bytes free" in result.stderr and "--capacity" in result.stderr
    assert e2e_env.read_runtime("huge") is None  # nothing left behind
    assert not (e2e_env.storage_dir / "huge").exists()
    # a lazy buffer (no schema yet) that large cannot even hold its bookkeeping
    result = e2e_env.cli(
        "start", "--name", "huge", "--capacity", str(10**15), "--storage-dir", storage
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert "cannot allocate" in result.stderr
