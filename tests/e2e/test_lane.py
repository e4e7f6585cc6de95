"""The local lane (a unix socket beside the daemon's ipc one): local clients use it, ZeroMQ
stays open beside it, a broken or greedy lane client hurts nobody else, and a daemon that dies
is reported at once. (The protocol's malformed-request suite runs on the lane too, in
``test_protocol.py``.)"""

from __future__ import annotations

import os
import resource
import signal
import socket
import stat
import struct
import threading
import time

import pytest
import torch
from tensordict import TensorDict

from shmbuffer import Reader, Writer
from shmbuffer.clients.connection import Connection
from shmbuffer.errors import DaemonUnavailableError, UnknownClientError
from shmbuffer.wire.protocol import decode, encode, request
from shmbuffer.wire.unix import ENV_LANE, Unpacker, lane_path, pack

from .conftest import wait_for


def _rows(n: int, first: int = 0) -> TensorDict:
    obs = torch.arange(first, first + n, dtype=torch.float32)[:, None].expand(n, 4).contiguous()
    return TensorDict({"obs": obs}, batch_size=[n])


def _lane_socket(endpoint: str) -> socket.socket:
    path = lane_path(endpoint)
    assert path is not None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10.0)
    sock.connect(path)
    return sock


def _send(sock: socket.socket, op: str, seq: int, **fields) -> None:
    sock.sendall(b"".join(bytes(b) for b in pack([encode(request(op, seq, **fields))])))


def _replies(sock: socket.socket, count: int) -> list[dict]:
    unpacker, got = Unpacker(), []
    while len(got) < count:
        data = sock.recv(1 << 16)
        assert data, f"the lane closed after {len(got)} of {count} replies"
        unpacker.feed(data)
        while (message := unpacker.next()) is not None:
            got.append(decode(message[0], max_bytes=None))
    return got


def test_local_clients_take_the_lane_and_zeromq_stays_open(daemon, monkeypatch):
    d = daemon(capacity=1000, unit="transition")
    path = lane_path(d.endpoint)
    assert path is not None
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # as the ipc socket: owner-only
    with Writer(d.name) as writer:
        monkeypatch.setenv(ENV_LANE, "0")
        with Reader(d.name) as reader:
            assert writer.conn._lane is not None
            assert reader.conn._lane is None
            writer.extend(_rows(100))
            writer.flush()
            batch = reader.sample(64)
            assert batch["obs"].shape == (64, 4)
            assert bool((batch["obs"][:, 0] < 100).all())
    assert d.stats()["rows_committed"] == 100
    d.stop()
    assert not os.path.exists(path), "the lane's socket file outlived the daemon"


@pytest.mark.parametrize(
    "prefix",
    [struct.pack("<I", 0), struct.pack("<I", 10**6), struct.pack("<IQ", 1, 2**40)],
    ids=["no-frames", "too-many-frames", "too-large"],
)
def test_broken_framing_closes_that_connection_only(daemon, prefix):
    d = daemon(capacity=100, unit="transition")
    bystander = _lane_socket(d.endpoint)
    _send(bystander, "hello", 1, role="reader", pid=os.getpid(), host="h")
    assert _replies(bystander, 1)[0]["ok"]
    bad = _lane_socket(d.endpoint)
    bad.sendall(prefix + b"\x00" * 32)
    assert bad.recv(1 << 16) == b"", "the daemon kept a connection that broke the framing"
    _send(bystander, "ping", 2)
    assert _replies(bystander, 1)[0]["seq"] == 2
    assert d.process.poll() is None
    bad.close()
    bystander.close()


def test_replies_left_unread_wait_for_their_client(daemon):
    """Many replies larger than the socket's buffer, none read until all were asked for: the
    daemon queues them (it never blocks on one client) and they arrive whole, in order."""
    d = daemon(capacity=100, unit="transition")
    with Writer(d.name) as writer:
        writer.extend(_rows(100))
        writer.flush()
    sock = _lane_socket(d.endpoint)
    _send(sock, "hello", 1, role="reader", pid=os.getpid(), host="h")
    assert _replies(sock, 1)[0]["ok"]
    for seq in range(2, 42):  # 40 replies of 20,000 rows: ~13 MB of index arrays
        _send(sock, "sample", seq, kind="rows", n=20_000)
    other = _lane_socket(d.endpoint)  # served meanwhile
    _send(other, "ping", 7)
    assert _replies(other, 1)[0]["seq"] == 7
    got = _replies(sock, 40)
    assert [r["seq"] for r in got] == list(range(2, 42))
    assert all(r["ok"] and len(r["rows"]) == 8 * 20_000 for r in got)
    sock.close()
    other.close()


def test_a_large_sample_through_a_reader(daemon):
    d = daemon(capacity=100, unit="transition")
    with Writer(d.name) as writer, Reader(d.name) as reader:
        writer.extend(_rows(100))
        writer.flush()
        batch = reader.sample(50_000)  # a reply of 800 KB: more than one socket buffer
        assert batch["obs"].shape == (50_000, 4)
        assert bool((batch["obs"][:, 0] == batch["obs"][:, 3]).all())


def test_a_request_in_flight_when_the_daemon_dies_fails_at_once(daemon):
    """A sample parked in the daemon (FIFO, nothing to consume) when the daemon is SIGKILLed
    can never be answered: the hang-up ends its wait, long before its timeout."""
    d = daemon(
        capacity=100, unit="transition", args=["--sampler", "fifo", "--max-times-sampled", "1"]
    )
    reader = Reader(d.name, timeout=120, sample_timeout=120)
    outcome: list[BaseException | None] = []

    def sample() -> None:
        try:
            reader.sample(4)
            outcome.append(None)
        except BaseException as exc:  # handed to the test thread
            outcome.append(exc)

    try:
        assert reader.conn._lane is not None
        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        wait_for(
            lambda: d.stats()["rate_limiter"]["samples_waiting"] == 1, 10, what="the sample to park"
        )
        os.kill(d.pid, signal.SIGKILL)
        thread.join(60)
        assert not thread.is_alive(), "the sample waited on for its timeout"
        assert isinstance(outcome[0], DaemonUnavailableError), outcome
        assert "requests unanswered" in str(outcome[0])
    finally:
        reader.close()


def test_after_a_restart_the_lane_reconnects(daemon):
    """As a DEALER does: the client's next request goes to the daemon that listens there now
    (which does not know it: say hello again), whether sent after the hang-up was seen or
    before."""
    d = daemon(capacity=100, unit="transition")
    conn = Connection(d.name, "reader", timeout=10)
    try:
        assert conn._lane is not None
        d.stop()
        d2 = daemon(name=d.name, capacity=100, unit="transition")
        with pytest.raises(UnknownClientError):
            conn.call("stats")
        assert conn.call("hello", role="reader", pid=os.getpid(), host="h")["ok"]
        assert conn.call("stats")["stats"]["capacity"] == 100
        assert d2.process.poll() is None
    finally:
        conn.close()


def test_out_of_descriptors_the_lane_pauses_instead_of_spinning(daemon):
    """A daemon that cannot accept (its descriptors used up) stops listening for a while, so
    the connection waiting in the backlog does not make its loop spin, then takes it."""
    d = daemon(capacity=100, unit="transition")
    held = len(os.listdir(f"/proc/{d.pid}/fd"))
    soft, hard = resource.prlimit(d.pid, resource.RLIMIT_NOFILE)
    resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (held + 1, hard))
    socks = []
    try:
        socks = [_lane_socket(d.endpoint) for _ in range(3)]  # the kernel queues them all
        wait_for(lambda: "could not accept" in d.log(), 10, what="the failed accept in the log")
        before = _cpu_seconds(d.pid)
        time.sleep(1.0)
        assert _cpu_seconds(d.pid) - before < 0.5, "the daemon's loop spun on its listener"
    finally:
        resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (soft, hard))
    for sock in socks:  # taken once the pause is over
        _send(sock, "ping", 3)
        assert _replies(sock, 1)[0]["seq"] == 3
        sock.close()
    assert d.process.poll() is None


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow
def test_a_legal_sample_of_2_25_rows_crosses_the_lane_and_the_reader_goes_on(daemon):
    """``sample_slices(2**19, 64)``: 2**25 rows, under the protocol's limit, whose reply (a
    stamp per row: 272 MB) is larger than what the lane let a client leave unread. The lane
    carries any reply the protocol allows, as ZeroMQ does, so the call succeeds there as it
    does with ``SHMBUFFER_LANE=0``, and the Reader goes on. A tiny buffer: the cost is the
    reply (about 3 GB at its peak across the daemon and this process, prefetch included)."""
    d = daemon(capacity=128, unit="episode")
    with Writer(d.name) as writer, Reader(d.name) as reader:
        writer.add_episode({"obs": torch.arange(128, dtype=torch.float32)})
        writer.flush()
        assert reader.conn._lane is not None
        for _ in range(2):  # the second is the reply the first prefetched
            batch = reader.sample_slices(2**19, 64)
            assert batch.shape == (2**19, 64)
            obs = batch["obs"]
            assert bool((obs[:, 1:] - obs[:, :-1] == 1).all())  # consecutive rows
            del batch, obs
        assert reader.sample(8).shape == (8,)
    assert d.process.poll() is None
    assert "unread" not in d.log()
