"""Crashes: a SIGKILLed writer loses only its own uncommitted episode, a SIGKILLed learner's
leases come back at once, and a SIGKILLed daemon makes every waiting client fail fast.

The daemon finds a dead local client by its pid (clients send pid and host in ``hello``) on
its next sweep (every 0.25 s); remote clients fall back on the reservation and lease TTLs.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

from shmbuffer import Reader, Writer
from shmbuffer.cli.demo_loops import check_episode, check_rows, make_episode
from shmbuffer.errors import DaemonUnavailableError
from shmbuffer.wire.protocol import PROTOCOL_VERSION
from tests.e2e._watchdog import run_with_watchdog
from tests.e2e.conftest import wait_for

LENGTH = 10
OBS = (3,)
CRASHED = 99  # the writer id of the episode the crashed writer left half-written

# Reserves one episode, writes half of its rows straight into the segment, says where, and
# waits to be killed.
HALF_WRITER = """
import json, sys, time
from shmbuffer.clients.connection import Connection
from shmbuffer.cli.demo_loops import make_episode
from shmbuffer.storage.segment import Segment
name, length, obs = sys.argv[1], int(sys.argv[2]), tuple(json.loads(sys.argv[3]))
conn = Connection(name, "writer", timeout=10)
info = conn.buffer["segment"]
seg = Segment.attach(info["name"], storage_dir=info["storage_dir"])
reply = conn.call("reserve", rows=length)
(start, stop), = reply["ranges"]
ep = make_episode(CRASHED, 0, length, obs)
for key, array in seg.arrays.items():
    array[start : start + length // 2] = ep[key[0]][: length // 2]
print(json.dumps({"reservation": reply["reservation"], "start": start, "stop": stop}), flush=True)
time.sleep(600)
""".replace("CRASHED", str(CRASHED))

# Leases many episodes (all of a small ring), says so, and waits to be killed.
LEASE_HOLDER = """
import sys, time
from shmbuffer import Reader
reader = Reader(sys.argv[1], timeout=10)
with reader.sample_episodes(int(sys.argv[2])) as episodes:
    print(len(episodes), flush=True)
    time.sleep(600)
"""


@contextlib.contextmanager
def child(script: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def read_line(proc: subprocess.Popen[str], timeout: float = 30.0) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        pytest.fail(f"child pid {proc.pid} said nothing within {timeout}s")
    line = proc.stdout.readline()
    if not line:
        pytest.fail(f"child pid {proc.pid} exited with {proc.wait(10)} before it was ready")
    return line


def sigkill(proc: subprocess.Popen[str]) -> float:
    """SIGKILL and reap (so its pid is really gone); return the moment of the kill."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    return t0


def fill(name: str, writer_id: int, episodes: int) -> None:
    with Writer(name, timeout=5) as w:
        for e in range(episodes):
            w.add_episode(make_episode(writer_id, e, LENGTH, OBS))


def test_killed_writer_loses_only_its_uncommitted_episode(daemon):
    d = daemon(capacity=100 * LENGTH, unit="episode")  # reservation TTL: the default 60 s
    fill(d.name, 1, 10)
    with child(HALF_WRITER, d.name, str(LENGTH), "[3]") as proc:
        info = json.loads(read_line(proc))
        stats = d.stats()
        assert stats["reservations"] == 1 and stats["reserved_rows"] == LENGTH
        killed = sigkill(proc)
        stats = wait_for(
            lambda: (s := d.stats())["reservations"] == 0 and s, 5, 0.005, "the reservation freed"
        )
        latency = time.monotonic() - killed
    print(f"\ndead writer's reservation freed {latency * 1000:.0f} ms after SIGKILL")
    assert latency < 1.0
    assert stats["clients_reaped"] == 1 and stats["reservations_expired"] == 0
    assert stats["episodes_committed"] == 10 and stats["rows_committed"] == 10 * LENGTH

    fill(d.name, 2, 10)  # other writers go on, over and past the dead writer's rows
    stats = d.stats()
    assert stats["episodes_committed"] == 20 and stats["episodes"] == 20
    with Reader(d.name, timeout=5) as r:
        seen = set()
        for _ in range(50):
            with r.sample_episodes(16) as episodes:
                for ep in episodes:
                    check_episode(ep)
                    seen.add(int(ep["writer"][0]))
            batch = r.sample(256)
            check_rows(batch)
            assert not (batch["writer"] == CRASHED).any(), "a half-written row was sampled"
        assert seen == {1, 2}
    # the half-written rows were never published: a reader's view of them is not a sample
    assert info["stop"] - info["start"] == LENGTH


def test_killed_learner_releases_its_leases_and_writers_resume(daemon):
    ring = 8
    d = daemon(capacity=ring * LENGTH, unit="episode", args=["--lease-ttl", "30"])
    fill(d.name, 1, ring)  # the ring is full: every next episode evicts a leased one
    with child(LEASE_HOLDER, d.name, "64") as proc:
        read_line(proc)
        assert d.stats()["leases"] == 1
        blocked = Writer(d.name, timeout=5, reserve_timeout=20)
        done = threading.Event()
        errors: list[BaseException] = []

        def write() -> None:
            try:
                for e in range(ring):
                    blocked.add_episode(make_episode(2, e, LENGTH, OBS))
                blocked.flush()
            except BaseException as exc:
                errors.append(exc)
            finally:
                done.set()

        thread = threading.Thread(target=write, daemon=True)
        thread.start()
        time.sleep(0.5)
        assert not done.is_set(), "the writer should wait for the leased episodes"
        killed = sigkill(proc)
        wait_for(lambda: d.stats()["leases"] == 0, 5, 0.005, "the lease released")
        freed = time.monotonic() - killed
        assert done.wait(10), "the writer did not resume after the learner died"
        resumed = time.monotonic() - killed
        blocked.close()
    print(f"\ndead learner's lease freed in {freed * 1000:.0f} ms, writer done {resumed:.2f}s")
    assert not errors, errors
    stats = d.stats()
    assert stats["clients_reaped"] == 1 and stats["leases_expired"] == 0
    assert freed < 1.0 and resumed < 3.0  # far within the 30 s lease TTL
    assert stats["episodes_committed"] == 2 * ring


def test_remote_learner_lease_expires_within_its_ttl(daemon):
    """A client on another host cannot be checked by pid: its lease ends with the TTL."""
    d = daemon(capacity=100 * LENGTH, unit="episode", args=["--lease-ttl", "1"])
    fill(d.name, 1, 4)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(d.endpoint)
    try:

        def ask(op: str, **fields: Any) -> dict[str, Any]:
            sock.send(msgpack.packb({"v": PROTOCOL_VERSION, "op": op, "seq": 1, **fields}))
            assert sock.poll(5000)
            reply: dict[str, Any] = msgpack.unpackb(sock.recv())
            assert reply["ok"], reply
            return reply

        ask("hello", role="reader", pid=os.getpid(), host="another-host", remote=True)
        ask("sample", kind="episodes", n=2, lease=True)
        t0 = time.monotonic()
        assert d.stats()["leases"] == 1
        sock.close()  # gone without a word: no pid to check, only the TTL
        wait_for(lambda: d.stats()["leases"] == 0, 5, 0.02, "the lease expired")
        took = time.monotonic() - t0
        stats = d.stats()
        assert stats["leases_expired"] == 1 and stats["clients_reaped"] == 0
        assert took < 1.0 + 0.5
    finally:
        sock.close()
        ctx.term()


def test_killed_daemon_fails_waiting_clients_fast(daemon):
    ring = 4
    d = daemon(capacity=ring * LENGTH, unit="episode")
    fill(d.name, 1, ring)
    learner = Reader(d.name, timeout=2)
    writer = Writer(d.name, timeout=2, reserve_timeout=60)
    sampler = Reader(d.name, timeout=2)
    lease = learner.sample_episodes(32)
    lease.__enter__()  # leases the whole ring
    results: dict[str, tuple[BaseException | None, float]] = {}

    def blocked_reserve() -> None:  # parked by the daemon, waiting for the leases
        results["reserve"] = run_with_watchdog(
            lambda: writer.add_episode(make_episode(2, 0, LENGTH, OBS)), 20
        )

    reserve = threading.Thread(target=blocked_reserve, daemon=True)
    reserve.start()
    time.sleep(2.2)  # longer than the timeout: the wait lives on the daemon's pings
    assert reserve.is_alive(), "the reserve should still be waiting for the leases"

    os.kill(d.pid, signal.SIGSTOP)  # hung: a sample now waits for a reply...

    def blocked_sample() -> None:
        results["sample"] = run_with_watchdog(lambda: sampler.sample(8), 20)

    sample = threading.Thread(target=blocked_sample, daemon=True)
    sample.start()
    time.sleep(0.3)
    d.process.kill()  # ...and the daemon dies
    d.process.wait(10)
    killed = time.monotonic()
    reserve.join(20)
    sample.join(20)
    took = time.monotonic() - killed
    for what, (exc, _) in results.items():
        assert isinstance(exc, DaemonUnavailableError), (what, exc)
    assert set(results) == {"reserve", "sample"}
    assert took < 2 + 1.0, f"clients took {took:.1f}s to notice the dead daemon"
    print(f"\nclients failed {took:.2f}s after the daemon was killed: {results}")
    exc, took = run_with_watchdog(lambda: lease.__exit__(None, None, None), 10)
    assert isinstance(exc, DaemonUnavailableError) and took < 2 + 1.0  # the release
    closers = [threading.Thread(target=c.close, daemon=True) for c in (writer, sampler, learner)]
    t0 = time.monotonic()
    for t in closers:
        t.start()
    for t in closers:
        t.join(10)
    assert not any(t.is_alive() for t in closers) and time.monotonic() - t0 < 2 + 1.0
