"""Daemon crash recovery through the real CLI: ``start --resume`` after SIGKILL (the ring, and
what samples and leases changed: a learner's leased views, use counts, FIFO consumption), a
plain ``start`` after SIGKILL, ``cleanup``, and ``checkpoint`` + ``start --restore``."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shmbuffer import Reader, Writer
from shmbuffer.cli.demo_loops import check_episode, make_episode
from shmbuffer.clients.connection import Connection
from shmbuffer.errors import LeaseExpiredError, WaitTimeoutError
from tests.e2e.conftest import wait_for

LENGTH = 10
OBS = (2, 3)
N = 20


def write_episodes(name: str, first: int, count: int) -> None:
    with Writer(name, timeout=5) as w:
        for e in range(first, first + count):
            w.add_episode(make_episode(0, e, LENGTH, OBS))
        w.flush()


def committed(name: str) -> tuple[set[int], set[int]]:
    """Episode ids the daemon samples (many draws: every one of N shows up), and the
    ``episode`` numbers a Reader finds in their rows, each checked whole."""
    with Reader(name, timeout=5) as r:
        reply = r.conn.call("sample", kind="episodes", n=2000)
        ids = set(np.frombuffer(reply["ids"], dtype="<i8").tolist())
        found = set()
        with r.sample_episodes(500) as episodes:
            for ep in episodes:
                number = int(ep["episode"][0])
                expected = make_episode(0, number, LENGTH, OBS)
                assert np.array_equal(ep["obs"].numpy(), expected["obs"])
                found.add(number)
    return ids, found


def sigkill(d: Any) -> None:
    d.process.send_signal(signal.SIGKILL)
    d.process.wait(10)


def test_resume_after_sigkill(daemon, e2e_env):
    d = daemon(capacity=1000, unit="episode")
    write_episodes(d.name, 0, N)
    before = d.stats()
    # a writer that reserved rows and never committed: its rows must never be published
    hanging = Connection(d.name, "writer", timeout=2)
    try:
        hanging.call("define_schema", schema=before["schema"])
        reservation = hanging.call("reserve", rows=LENGTH)["reservation"]
        sigkill(d)
    finally:
        hanging.close()
    assert e2e_env.read_runtime(d.name) is not None  # stale leftovers
    assert (d.segment_path / "journal.bin").is_file()

    t0 = time.monotonic()
    resumed = daemon(name=d.name, capacity=1000, unit="episode", args=["--resume"])
    elapsed = time.monotonic() - t0
    print(f"resume to ready: {elapsed:.2f}s")
    assert "resumed" in resumed.log()
    after = resumed.stats()
    assert after["pid"] == resumed.pid != d.pid
    for key in ("episodes", "rows", "rows_committed", "episodes_committed"):
        assert after[key] == before[key], key
    assert after["pointer"] == before["pointer"] + LENGTH  # past the uncommitted reservation
    # Its writer's process (this one) lives, so its rows stay pinned to it (it may still be
    # copying) until a connection of that process ends the reservation.
    assert [s["pid"] for s in after["stalled_writers"]] == [os.getpid()]
    again = Connection(d.name, "writer", timeout=2)
    try:
        again.call("abort", reservation=reservation)
    finally:
        again.close()
    assert resumed.stats()["reservations"] == 0
    ids, found = committed(d.name)
    assert ids == set(range(N))
    assert found == set(range(N))

    write_episodes(d.name, N, 3)  # and it goes on: new ids after the old ones
    ids, found = committed(d.name)
    assert ids == set(range(N + 3))


def test_plain_start_after_sigkill_starts_empty(daemon, e2e_env):
    d = daemon(capacity=1000, unit="episode")
    write_episodes(d.name, 0, 5)
    sigkill(d)
    fresh = daemon(name=d.name, capacity=1000, unit="episode")
    stats = fresh.stats()
    assert stats["episodes"] == 0 and stats["episodes_committed"] == 0
    assert stats["schema"] is None  # the old segment is gone with its schema
    assert "stale" in fresh.log()


def test_a_daemon_killed_before_its_first_write_resumes_with_its_settings(daemon, e2e_env):
    """A daemon that never had a schema has no segment: ``status`` says so, and ``--resume``
    starts it again, empty, with its settings, the rate limiter as ``configure`` left it."""
    args = ["--rate-limiter", "min-size", "--min-size", "1"]
    d = daemon(capacity=100, unit="transition", args=args)
    out = e2e_env.cli("configure", "--name", d.name, "--min-size", "3")
    assert out.returncode == 0, out.stderr
    sigkill(d)
    assert not d.segment_path.exists()

    status = e2e_env.cli("status", "--name", d.name)
    assert status.returncode != 0
    assert "stored nothing" in status.stderr and "--resume" in status.stderr, status.stderr
    assert "committed data" not in status.stderr  # there is none to serve again

    resumed = daemon(name=d.name, capacity=100, unit="transition", args=["--resume"])
    limiter = resumed.stats()["rate_limiter"]
    assert (limiter["kind"], limiter["settings"]["min_size"]) == ("min-size", 3)
    assert "stored nothing" in resumed.log()
    with Writer(d.name, timeout=5) as w:
        w.add_episode(make_episode(0, 0, 3, OBS))
        w.flush()
    with Reader(d.name, timeout=5) as r:
        assert len(r.sample(2)["episode"]) == 2
    assert resumed.stats()["rate_limiter"]["settings"]["min_size"] == 3


def test_resume_refusals(daemon, e2e_env):
    storage = str(e2e_env.storage_dir)
    nothing = e2e_env.cli(
        "start", "--name", "nobody", "--storage-dir", storage, "--resume", timeout=30
    )
    assert nothing.returncode != 0
    assert "nothing to resume" in nothing.stderr

    d = daemon(capacity=1000, unit="episode")
    write_episodes(d.name, 0, 2)
    busy = e2e_env.cli("start", "--name", d.name, "--storage-dir", storage, "--resume")
    assert busy.returncode != 0 and "already served" in busy.stderr
    sigkill(d)
    conflict = e2e_env.cli(
        "start", "--name", d.name, "--storage-dir", storage, "--capacity", "999", "--resume"
    )
    assert conflict.returncode != 0
    assert "capacity" in conflict.stderr and "conflict" in conflict.stderr
    assert (d.segment_path / "journal.bin").is_file()  # a refusal touches nothing


def test_cleanup_removes_only_dead_daemons_leftovers(daemon, e2e_env):
    storage = str(e2e_env.storage_dir)
    dead = daemon(capacity=100, unit="episode")
    live = daemon(capacity=100, unit="episode")
    write_episodes(dead.name, 0, 2)
    write_episodes(live.name, 0, 2)
    sigkill(dead)
    stray = e2e_env.storage_dir / "not-a-segment"
    stray.mkdir()
    (stray / "keep.txt").write_text("x")

    lane = e2e_env.runtime_dir / f"{dead.name}.sock.lane"  # the local lane's socket
    assert lane.exists()  # left by the SIGKILL

    dry = e2e_env.cli("cleanup", "--storage-dir", storage, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert str(dead.segment_path) in dry.stdout and "would remove" in dry.stdout
    assert dead.segment_path.exists() and e2e_env.runtime_file(dead.name).exists()

    out = e2e_env.cli("cleanup", "--storage-dir", storage)
    assert out.returncode == 0, out.stderr
    assert str(dead.segment_path) in out.stdout
    assert str(e2e_env.runtime_file(dead.name)) in out.stdout
    assert not dead.segment_path.exists()
    assert not e2e_env.runtime_file(dead.name).exists()
    assert not (e2e_env.runtime_dir / f"{dead.name}.sock").exists()
    assert not lane.exists() and str(lane) in out.stdout
    assert (e2e_env.runtime_dir / f"{live.name}.sock.lane").exists()
    # the live daemon and the stray folder are untouched
    assert live.segment_path.is_dir() and e2e_env.runtime_file(live.name).exists()
    assert (stray / "keep.txt").exists()
    assert live.stats()["episodes"] == 2
    again = e2e_env.cli("cleanup", "--storage-dir", storage)
    assert "nothing to clean up" in again.stdout


def test_checkpoint_stop_restore(daemon, e2e_env, tmp_path):
    d = daemon(capacity=1000, unit="episode")
    write_episodes(d.name, 0, N)
    with Reader(d.name, timeout=5) as r:
        r.sample(16)  # counters beyond the writes
    before = d.stats()
    out = e2e_env.cli("checkpoint", "--name", d.name, "--to", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "checkpoint of" in out.stdout
    assert (tmp_path / "checkpoint" / "COMPLETE").is_file()
    assert d.stop() == 0
    assert not d.segment_path.exists()

    restored = daemon(name=d.name, capacity=1000, unit="episode", args=["--restore", str(tmp_path)])
    after = restored.stats()
    for key in ("episodes", "rows", "pointer", "rows_committed", "episodes_committed", "samples"):
        assert after[key] == before[key], key
    assert after["schema"] == before["schema"]
    ids, found = committed(d.name)
    assert ids == set(range(N))
    assert found == set(range(N))


def test_restore_refuses_a_corrupted_checkpoint_naming_the_chunk(daemon, e2e_env, tmp_path):
    """One flipped byte in a chunk file: ``start --restore`` exits non-zero naming the file,
    before it serves anything, and leaves no segment behind."""
    d = daemon(capacity=1000, unit="episode")
    write_episodes(d.name, 0, N)
    out = e2e_env.cli("checkpoint", "--name", d.name, "--to", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert d.stop() == 0
    chunk = next((tmp_path / "checkpoint" / "chunks").glob("000000-*.bin"))  # rows from 0
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0x01  # the first row's first column
    chunk.write_bytes(bytes(data))

    argv = ["start", "--name", d.name, "--capacity", "1000", "--unit", "episode"]
    argv += ["--storage-dir", str(e2e_env.storage_dir), "--restore", str(tmp_path), "--detach"]
    res = e2e_env.cli(*argv, timeout=60)
    info = e2e_env.read_runtime(d.name)
    if info is not None:  # it serves: reap it after the test
        e2e_env.extra_pids.append(int(info["pid"]))
    assert res.returncode != 0, res.stdout
    assert "corrupt" in res.stderr and chunk.name in res.stderr, res.stderr
    assert not d.segment_path.exists()


# -- what samples and leases changed survives --resume too -------------------------------------

RING = 4  # episodes of LENGTH rows: a writer of RING more laps the ring


def use_counts(d: Any) -> np.ndarray:
    """The daemon's per-row use counters: the file it updates in place (``journal.py``)."""
    return np.fromfile(Path(d.segment_path) / "use_counts.bin", dtype="<i4")


class LeasedAcrossKill:
    """A learner inside ``sample_episodes`` (every episode of a full ring leased, views built)
    when the daemon is SIGKILLed, and the daemon resumed; then a writer connecting to the
    resumed daemon to lap the ring. ``ttl`` must outlast a resume (a daemon start imports
    torch: 9-18 s measured on a loaded 2-core machine)."""

    def __init__(self, daemon: Any, ttl: float) -> None:
        self.ttl = ttl
        args = ["--lease-ttl", str(ttl)]
        d = daemon(capacity=RING * LENGTH, unit="episode", args=args)
        write_episodes(d.name, 0, RING)
        self.reader = reader = Reader(d.name, timeout=5, auto_renew=False)
        for _ in range(5):
            reader.sample(64)  # use counts beyond zero
        for _ in range(20):  # a block whose lease pins every episode of the ring
            self.block = reader.sample_episodes(32)
            self.episodes = self.block.__enter__()
            if len({int(ep["episode"][0]) for ep in self.episodes}) == RING:
                break
            self.block.__exit__(None, None, None)
        else:
            pytest.fail("never leased the whole ring")
        self.views = [self.episodes[i] for i in range(len(self.episodes))]  # built in time
        self.before = [v["obs"].clone() for v in self.views]
        counts = use_counts(d)
        assert counts.sum() > 64 * 5  # the samples and the leased episodes
        self.episodes.renew()  # the lease now ends ttl after this
        self.expires = time.time() + ttl
        sigkill(d)
        self.daemon = daemon(
            name=d.name, capacity=RING * LENGTH, unit="episode", args=[*args, "--resume"]
        )
        assert time.time() < self.expires - 2, "the resume outlasted the lease: raise its ttl"
        assert self.daemon.stats()["leases"] == 1
        assert "1 leases held on" in self.daemon.log()
        assert np.array_equal(use_counts(self.daemon), counts)  # use counts survive too
        self.acked: list[float] = []
        self.errors: list[BaseException] = []
        self.writer = Writer(d.name, timeout=5, reserve_timeout=3 * ttl, batch_bytes=0)
        self.thread = threading.Thread(target=self._lap, daemon=True)
        self.thread.start()

    def _lap(self) -> None:
        try:
            for e in range(RING):
                self.writer.add_episode(make_episode(1, e, LENGTH, OBS))
                self.writer.flush()
                self.acked.append(time.time())
        except BaseException as exc:
            self.errors.append(exc)

    def unchanged_until(self, until: float) -> None:
        """Until wall-clock ``until`` the writer waits and the views stay as they were."""
        while time.time() < until:
            for view, obs in zip(self.views, self.before, strict=True):
                assert torch.equal(view["obs"], obs), "leased rows overwritten"
            assert not self.acked and self.thread.is_alive(), (self.acked, self.errors)
            time.sleep(0.1)

    def writer_finishes(self) -> None:
        self.thread.join(3 * self.ttl)
        assert not self.thread.is_alive(), "the writer still blocks"
        assert not self.errors, self.errors
        assert len(self.acked) == RING
        pairs = zip(self.views, self.before, strict=True)
        assert any(not torch.equal(v["obs"], obs) for v, obs in pairs)  # it reached them

    def close(self) -> None:
        self.writer.close()
        self.reader.close()


def test_leased_views_survive_a_daemon_kill_until_released(daemon):
    """The resumed daemon keeps the dead daemon's lease: a writer that laps the ring waits and
    the learner's views stay as they were, until the learner's process, on a new connection,
    adopts the lease by id and releases it; then the writer goes on at once. Use counts
    survive the kill too. (The TTL is long, to outlast any resume; nothing waits for it.)"""
    run = LeasedAcrossKill(daemon, ttl=120.0)
    try:
        run.unchanged_until(time.time() + 3.0)
        conn = Connection(run.daemon.name, "reader", timeout=5)  # same pid and host
        try:
            conn.call("release", lease=run.episodes.lease)
        finally:
            conn.close()
        run.writer_finishes()
        assert run.acked[0] < run.expires - 60  # long before the TTL
        assert run.daemon.stats()["leases"] == 0
        with pytest.raises(LeaseExpiredError):
            run.block.__exit__(None, None, None)  # its old connection: lapsed, as it must say
    finally:
        run.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_leased_views_survive_a_daemon_kill_until_their_ttl(daemon):
    """As above, but nobody releases the lease: the writer waits until its TTL (journaled in
    wall-clock time, converted by the resumed daemon), then proceeds."""
    run = LeasedAcrossKill(daemon, ttl=40.0)
    try:
        run.unchanged_until(run.expires - 0.5)
        run.writer_finishes()
        assert run.acked[0] >= run.expires - 0.5, f"written {run.expires - run.acked[0]:.2f}s early"
        with pytest.raises(LeaseExpiredError):
            run.block.__exit__(None, None, None)
        assert run.daemon.stats()["leases"] == 0
    finally:
        run.close()


def iterate_order(name: str) -> list[int]:
    """The rows of ``iterate``'s pass 3 (one rank), in the daemon's shuffled order."""
    with Reader(name, timeout=5) as r:
        reply = r.conn.call("iterate", rank=0, world_size=1, shuffle=True, epoch=3)
    return np.frombuffer(reply["rows"], dtype="<i8").tolist()


def test_fifo_consumption_survives_a_daemon_kill(daemon):
    """Episodes a consume-once FIFO handed out before a SIGKILL are not handed out again by
    the resumed daemon; every other one is, once; the limiter's count, the use counts and
    ``iterate``'s shuffles come back."""
    args = ["--sampler", "fifo", "--max-times-sampled", "1"]
    d = daemon(capacity=1000, unit="episode", args=args)
    write_episodes(d.name, 0, N)

    def consume(name: str, sizes: tuple[int, ...], calls: int | None = None) -> list[int]:
        """Episode numbers consumed by ``sample_episodes`` of each size in turn, until none
        is left for it (or after ``calls`` calls)."""
        got: list[int] = []
        with Reader(name, timeout=5, sample_timeout=0.5) as r:
            for n in sizes:
                while calls is None or len(got) < calls * n:
                    try:
                        with r.sample_episodes(n) as episodes:
                            for ep in episodes:
                                check_episode(ep)
                                got.append(int(ep["episode"][0]))
                    except WaitTimeoutError:
                        break
        return got

    first = consume(d.name, (3,), calls=3)
    assert first == list(range(9))  # oldest first
    shuffled = iterate_order(d.name)  # counts a use of every row, without a SAMPLE
    before = d.stats()
    counts = use_counts(d)
    sigkill(d)
    resumed = daemon(name=d.name, capacity=1000, unit="episode", args=["--resume"])
    assert np.array_equal(use_counts(resumed), counts)
    assert iterate_order(d.name) == shuffled  # iterate's seed too (no --seed given)
    after = resumed.stats()
    assert after["rate_limiter"]["sampled"] == before["rate_limiter"]["sampled"] == 9 * LENGTH
    assert after["sampler"]["figures"] == before["sampler"]["figures"]
    rest = consume(d.name, (2, 1))  # an odd one is left for the last
    assert sorted(rest) == list(range(9, N))  # nothing of ``first`` again, nothing lost
    wait_for(lambda: resumed.stats()["leases"] == 0, 10, what="the drain's leases to go")
