"""The shard host's daemon supervisor without Ray: a real ``shmbuffer-daemon start`` child,
killed with SIGKILL and resumed with every committed episode, stopped with nothing left behind;
a dead daemon's leftovers cleared at start. Two or three daemon starts: slow."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import torch

from shmbuffer import Reader, Writer, runtime
from shmbuffer.cluster.options import start_flags
from shmbuffer.cluster.supervisor import DaemonSupervisor
from tests.e2e.conftest import Env, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _supervisor(env: Env, name: str) -> DaemonSupervisor:
    flags = [*start_flags({}, 0), "--capacity", "500", "--unit", "episode"]
    return DaemonSupervisor(name, flags, storage_dir=str(env.storage_dir), ready_timeout=120)


def _write(endpoint: str, episodes: int) -> None:
    writer = Writer(endpoint, remote=False)
    try:
        for i in range(episodes):
            writer.add_episode({"obs": torch.full((6, 2), float(i)), "done": torch.arange(6) == 5})
        writer.flush()
    finally:
        writer.close()


def test_a_killed_daemon_is_resumed_on_its_endpoint_and_stopped_cleanly(e2e_env: Env) -> None:
    sup = _supervisor(e2e_env, "sup-a.0123")
    try:
        info = sup.start()
        assert info["alive"] and info["endpoint"].startswith("tcp://127.0.0.1:")
        assert not info["endpoint"].endswith(":0")
        _write(info["endpoint"], 7)
        os.kill(info["pid"], signal.SIGKILL)
        back = wait_for(
            lambda: sup.info() if sup.info()["alive"] and sup.restarts == 1 else None,
            120,
            what="the resumed daemon",
        )
        assert back["pid"] != info["pid"] and back["endpoint"] == info["endpoint"]
        reader = Reader(back["endpoint"], remote=True)
        try:
            assert len(reader) == 7  # every committed episode, served again
        finally:
            reader.close()
    finally:
        code = sup.stop()
    assert code == 0  # SIGTERM: the daemon's clean stop
    assert not runtime.pid_alive(back["pid"])
    assert not (e2e_env.storage_dir / "sup-a.0123").exists()
    assert not list(e2e_env.runtime_dir.glob("sup-a.0123*"))  # runtime file, pid, log


def test_start_clears_what_a_dead_daemon_of_its_name_left(e2e_env: Env, daemon: Any) -> None:
    dead = daemon(name="sup-b.0123", capacity=500, unit="episode")
    _write(dead.endpoint, 2)
    dead.process.kill()  # a host killed with its daemon: runtime file and segment stay
    dead.process.wait(10)
    assert (e2e_env.storage_dir / "sup-b.0123").exists()
    assert e2e_env.read_runtime("sup-b.0123") is not None
    sup = _supervisor(e2e_env, "sup-b.0123")
    try:
        fresh = sup.start()
        assert fresh["pid"] != dead.pid
        reader = Reader(fresh["endpoint"], remote=True)
        try:
            assert len(reader) == 0  # a new host starts its shard empty
        finally:
            reader.close()
    finally:
        assert sup.stop() == 0
    assert not (e2e_env.storage_dir / "sup-b.0123").exists()
