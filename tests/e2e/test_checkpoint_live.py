"""Checkpoints of a live daemon (started through the CLI, asked over its socket): taken while a
writer process laps the ring, answered while other clients are served, incremental, restored with
``start --restore``, and cancelled by a stop.

A slow copy comes from ``SHMBUFFER_TEST_CHECKPOINT_SLEEP_S`` (seconds the daemon's copy thread
sleeps before each piece; for tests only), set in the daemon's environment.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from shmbuffer import Reader, Writer
from shmbuffer.cli.demo_loops import check_episode, make_episode
from shmbuffer.clients.connection import Connection
from shmbuffer.daemon.checkpoint import resolve_checkpoint
from shmbuffer.daemon.checkpoint_job import ENV_TEST_SLEEP
from shmbuffer.daemon.config import DaemonConfig
from shmbuffer.daemon.recovery import restore_service
from shmbuffer.storage.segment import Segment
from tests.e2e import _checkpoint_workers as workers
from tests.e2e.conftest import wait_for

CAPACITY = 2000  # rows: 200 episodes of 10; 256+ pieces of a few rows each


def checkpoint(name: str, to: Path, timeout: float = 60.0) -> dict[str, Any]:
    """The whole ``checkpoint`` reply (the admin helper keeps only three fields)."""
    conn = Connection(name, "admin", timeout=10)
    try:
        return dict(conn.call("checkpoint", timeout=timeout, to=str(to)))
    finally:
        conn.close()


def write_episodes(name: str, first: int, count: int) -> None:
    with Writer(name, timeout=10) as w:
        for e in range(first, first + count):
            w.add_episode(make_episode(0, e, workers.LENGTH, workers.OBS))
        w.flush()


def saved_episodes(folder: Path) -> list[list[int]]:
    state = json.loads((resolve_checkpoint(folder) / "state.json").read_text())
    return [list(map(int, ep)) for ep in state["registry"]["episodes"]]


def check_restored(e2e_env: Any, folder: Path, episodes: list[list[int]]) -> None:
    """Restore ``folder`` (in this process: the restore code a ``--restore`` daemon runs) and
    read every episode of the cut from it: whole, and the very episode committed under that id
    (a single writer's n-th episode is id n)."""
    config = DaemonConfig(
        name=f"check-{uuid.uuid4().hex[:8]}",
        capacity=CAPACITY,
        unit="episode",
        storage_dir=str(e2e_env.storage_dir),
    )
    service = restore_service(config, folder)
    try:
        assert [list(ep) for ep in service.container.registry.to_state()["episodes"]] == episodes
        assert service.segment is not None
        for episode_id, start, end in episodes:
            ep = service.segment.data[start:end]
            check_episode(ep)  # untorn: every row agrees with its (writer, episode, step)
            assert int(ep["episode"][0]) == episode_id
    finally:
        assert service.journal is not None and service.segment is not None
        service.journal.close()
        service.segment.close()
        Segment.unlink(config.name, config.storage_dir)


def test_checkpoint_under_a_lapping_writer_is_the_cut(daemon, e2e_env, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_TEST_SLEEP, "0.004")  # ~1.2 s of copy: the writer laps meanwhile
    d = daemon(capacity=CAPACITY, unit="episode")
    stop = tmp_path / "stop"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    writer = ctx.Process(
        target=workers.write_until_stopped,
        args=(str(e2e_env.runtime_dir), d.name, str(stop), 60.0, results),
        daemon=True,
    )
    writer.start()
    try:
        wait_for(lambda: d.stats()["rows_committed"] > 2 * CAPACITY, 60, what="two laps")
        before = d.stats()["rows_committed"]
        reply = checkpoint(d.name, tmp_path / "ck")
        during = d.stats()["rows_committed"] - before
        stop.touch()
        written = results.get(timeout=30)
        writer.join(10)
    finally:
        stop.touch()
        if writer.is_alive():
            writer.kill()
            writer.join(5)
    assert during > 0  # a full ring: every row written during the copy overwrote one
    assert reply["copied_bytes"] == reply["bytes"]
    episodes = saved_episodes(tmp_path / "ck")
    assert len(episodes) > 150 and all(ep[0] < written for ep in episodes)
    check_restored(e2e_env, tmp_path / "ck", episodes)


def test_the_daemon_serves_everyone_while_a_checkpoint_copies(
    daemon, e2e_env, tmp_path, monkeypatch
):
    monkeypatch.setenv(ENV_TEST_SLEEP, "0.01")  # 256+ pieces: a copy of 2.5 s or more
    d = daemon(capacity=CAPACITY, unit="episode")
    write_episodes(d.name, 0, 150)
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["reply"] = checkpoint(d.name, tmp_path)
        except BaseException as exc:  # checked below
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: list(tmp_path.glob(".tmp-*/chunks/*")), 10, what="the copy to start")
        # a writer lapping the ring, a reader checking what it samples, stats, a second
        # checkpoint's refusal: all answered while the copy runs
        write_episodes(d.name, 150, 210)
        with Reader(d.name, timeout=5) as r, r.sample_episodes(20) as episodes:
            for ep in episodes:
                check_episode(ep)
        assert d.stats()["episodes"] > 0
        with pytest.raises(Exception, match="one at a time"):
            checkpoint(d.name, tmp_path / "other")
        assert thread.is_alive() and list(tmp_path.glob(".tmp-*")), "the copy ended too soon"
    finally:
        thread.join(60)
    assert "error" not in outcome, outcome.get("error")
    reply = outcome["reply"]
    assert reply["copied_bytes"] == reply["bytes"] > 0
    assert reply["max_pause_ms"] >= 0


def test_incremental_checkpoints_across_restore(daemon, e2e_env, tmp_path):
    d = daemon(capacity=CAPACITY, unit="episode")
    write_episodes(d.name, 0, 120)
    first = checkpoint(d.name, tmp_path)
    assert first["copied_bytes"] == first["bytes"] > 0
    again = checkpoint(d.name, tmp_path)  # nothing changed: every chunk linked
    assert again["copied_bytes"] == 0 and again["linked_bytes"] == again["bytes"]
    before = d.stats()
    assert d.stop() == 0

    restored = daemon(
        name=d.name, capacity=CAPACITY, unit="episode", args=["--restore", str(tmp_path)]
    )
    after = restored.stats()
    for key in ("episodes", "rows", "pointer", "rows_committed", "episodes_committed"):
        assert after[key] == before[key], key
    # the restored daemon's first checkpoint links what it restored
    assert checkpoint(restored.name, tmp_path)["copied_bytes"] == 0
    write_episodes(restored.name, 120, 20)  # 200 of 2000 rows: 10%
    third = checkpoint(restored.name, tmp_path)
    assert 0 < third["copied_bytes"] < third["bytes"] / 2
    episodes = saved_episodes(tmp_path)
    assert [ep[0] for ep in episodes] == list(range(140))
    check_restored(e2e_env, tmp_path, episodes)


def test_a_stop_during_a_checkpoint_keeps_the_previous_one(daemon, e2e_env, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_TEST_SLEEP, "0.01")  # a chunk of 18 pieces: 0.2 s of copy
    d = daemon(capacity=CAPACITY, unit="episode")
    write_episodes(d.name, 0, 50)
    checkpoint(d.name, tmp_path)
    first = saved_episodes(tmp_path)
    write_episodes(d.name, 50, 100)  # 8 or 9 chunks to copy again: well over a second
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["reply"] = checkpoint(d.name, tmp_path)
        except BaseException as exc:  # the stop's error reply
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_for(lambda: list(tmp_path.glob(".tmp-*/chunks/*")), 10, what="the copy to start")
    assert d.stop() == 0  # SIGTERM: the copy is cancelled, the daemon exits cleanly
    thread.join(30)
    assert "shutting down" in str(outcome.get("error")), outcome
    assert not list(tmp_path.glob(".tmp-*"))  # its temp folder went
    assert saved_episodes(tmp_path) == first  # the previous checkpoint, whole
    check_restored(e2e_env, tmp_path, first)
