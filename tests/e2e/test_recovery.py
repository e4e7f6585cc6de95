"""Daemon crash recovery through the real CLI: ``start --resume`` after SIGKILL, a plain
``start`` after SIGKILL, ``cleanup``, and ``checkpoint`` + ``start --restore``."""

from __future__ import annotations

import signal
import time
from typing import Any

import numpy as np

from shmbuffer import Reader, Writer
from shmbuffer.clients.connection import Connection
from shmbuffer.demo import make_episode

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
        hanging.call("reserve", rows=LENGTH)
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
    assert after["reservations"] == 0
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
