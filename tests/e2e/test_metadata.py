"""Episode metadata through a real daemon: what writers attach rides on their commits, is
checked by the daemon, queried by readers (``Reader.episodes``, ``where=`` on draws, the
``episodes`` command), and comes back whole after a SIGKILL + ``--resume`` and a checkpoint +
``--restore``; a bad value is refused naming the name, with nothing stored changed."""

from __future__ import annotations

import json
import os
import signal
import socket

import numpy as np
import pytest
import torch

from shmbuffer import Reader, Writer
from shmbuffer.errors import InvalidArgumentError, QueryError, WaitTimeoutError

LENGTH = 5


def episode(number: int) -> dict[str, torch.Tensor]:
    return {"obs": torch.full((LENGTH, 2), float(number)), "step": torch.arange(LENGTH)}


def write(name: str, numbers: range, **writer: object) -> None:
    with Writer(name, timeout=5, **writer) as w:  # type: ignore[arg-type]
        for i in numbers:
            w.add_episode(episode(i), meta={"ret": i * 1.5, "env_id": f"e{i % 3}", "pv": i // 4})
        w.flush()


def table(name: str) -> dict[int, dict[str, object]]:
    with Reader(name, timeout=5) as r:
        return {row["id"]: row for row in r.episodes().rows()}


def test_writers_meta_is_queried_and_filters_draws(daemon):
    d = daemon(capacity=200, unit="episode")
    write(d.name, range(12))
    with Reader(d.name, timeout=5) as r:
        found = r.episodes(where="ret > 6 and env_id != 'e0'", order_by="-ret", limit=3)
        assert found.ids.tolist() == [11, 10, 8]
        assert found["ret"].tolist() == [16.5, 15.0, 12.0]
        row = found.rows()[0]
        assert row["env_id"] == "e2" and row["pv"] == 2 and row["length"] == LENGTH
        assert row["writer"] == f"{os.getpid()}@{socket.gethostname()}"
        assert abs(float(row["commit_time"]) - __import__("time").time()) < 60

        # draws only from what the filter selects: episodes 8..11 have pv == 2
        rows = r.sample(200, where="pv == 2")
        assert set(rows["obs"][:, 0].tolist()) == {8.0, 9.0, 10.0, 11.0}
        with r.sample_episodes(20, where="env_id in ('e1',)") as eps:
            assert {int(e["obs"][0, 0]) for e in eps} <= {1, 4, 7, 10}
        slices = r.sample_slices(10, 3, where="id < 2")
        assert set(slices["obs"][:, :, 0].flatten().tolist()) <= {0.0, 1.0}

        with pytest.raises(QueryError, match="position"):
            r.episodes(where="ret >> 1")
        with pytest.raises(QueryError, match="nope"):
            r.sample(4, where="nope > 1")


def test_a_bad_value_is_refused_naming_it_and_nothing_changes(daemon):
    d = daemon(capacity=200, unit="episode")
    write(d.name, range(3))
    before = table(d.name)
    with Writer(d.name, timeout=5) as w:
        with pytest.raises(InvalidArgumentError, match="'ret' holds float"):
            w.add_episode(episode(9), meta={"ret": "high"})
        with pytest.raises(InvalidArgumentError, match="'length' is recorded by the buffer"):
            w.add_episode(episode(9), meta={"length": 3})
        with pytest.raises(InvalidArgumentError, match=r"'obs'.*scalar"):
            w.add_episode(episode(9), meta={"obs": [1, 2]})
        w.flush()
    # a value another writer's kind refuses at the commit (this writer had not seen it)
    with Writer(d.name, timeout=5) as w:
        w._meta_kinds.pop("env_id")  # as a writer that connected before the name was used
        with pytest.raises(InvalidArgumentError, match="'env_id' holds str"):
            w.add_episode(episode(9), meta={"env_id": 3})
            w.flush()
    assert table(d.name) == before


def test_declared_names_only(daemon):
    d = daemon(capacity=200, unit="episode", args=["--meta", "ret:float", "--meta", "env:str"])
    with Writer(d.name, timeout=5) as w:
        w.add_episode(episode(0), meta={"ret": 3})  # an int where a float is kept
        with pytest.raises(InvalidArgumentError, match="'seed' is not declared"):
            w.add_episode(episode(1), meta={"seed": 7})
        w.flush()
    with Reader(d.name, timeout=5) as r:
        assert r.conn.buffer["meta"]["declared"] is True
        assert r.episodes()["ret"].tolist() == [3.0]


def test_add_transition_meta_is_merged_and_attached_at_the_end(daemon):
    d = daemon(capacity=200, unit="episode")
    with Writer(d.name, timeout=5) as w:
        for t in range(4):
            step = {"obs": torch.zeros(2), "terminated": torch.tensor(t == 3)}
            w.add_transition("e7", step, meta={"pv": 1} if t == 0 else {"ret": float(t)})
        w.flush()
    rows = list(table(d.name).values())
    assert [(r["pv"], r["ret"], r["length"]) for r in rows] == [(1, 3.0, 4)]


def test_remote_writer_meta(daemon):
    d = daemon(capacity=200, unit="episode")
    write(d.name, range(2), remote=True)
    assert [r["env_id"] for r in table(d.name).values()] == ["e0", "e1"]


def sigkill(d) -> None:
    d.process.send_signal(signal.SIGKILL)
    d.process.wait(10)


def test_meta_comes_back_after_sigkill_and_resume(daemon):
    d = daemon(capacity=150, unit="episode")
    write(d.name, range(40))  # the ring wrapped: the first ten episodes are gone
    before = table(d.name)
    assert sorted(before) == list(range(10, 40))
    sigkill(d)
    resumed = daemon(name=d.name, capacity=150, unit="episode", args=["--resume"])
    assert table(resumed.name) == before  # commit times and writers too
    write(resumed.name, range(40, 42))
    after = table(resumed.name)
    assert sorted(after) == list(range(12, 42)) and after[41]["ret"] == 61.5


def test_meta_comes_back_after_checkpoint_and_restore(daemon, e2e_env, tmp_path):
    d = daemon(capacity=100, unit="episode")
    write(d.name, range(6))
    before = table(d.name)
    out = e2e_env.cli("checkpoint", "--name", d.name, "--to", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert d.stop() == 0
    restored = daemon(name=d.name, capacity=100, unit="episode", args=["--restore", str(tmp_path)])
    assert table(restored.name) == before


def test_episodes_command(daemon, e2e_env):
    d = daemon(capacity=100, unit="episode")
    write(d.name, range(9))
    out = e2e_env.cli("episodes", "--name", d.name, "--where", "env_id == 'e2'", "--order-by=-ret")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["id", "length", "commit_time", "writer", "env_id", "pv", "ret"]
    assert [int(line.split()[0]) for line in lines[1:]] == [8, 5, 2]
    js = e2e_env.cli("episodes", "--name", d.name, "--limit", "2", "--json")
    rows = [json.loads(line) for line in js.stdout.splitlines()]
    assert [r["id"] for r in rows] == [0, 1] and rows[1]["ret"] == 1.5
    bad = e2e_env.cli("episodes", "--name", d.name, "--where", "ret >")
    assert bad.returncode == 1 and "position 5" in bad.stderr
    assert np.isfinite(rows[0]["commit_time"])


def test_bounded_tables_through_the_daemon_and_their_status(daemon, e2e_env):
    tables = ["--table", "replay:uniform", "--table", "recent:uniform,max-episodes=3"]
    tables += ["--table", "fresh:uniform,max-staleness=1"]
    d = daemon(capacity=200, unit="episode", args=tables)
    with Writer(d.name, timeout=5) as w:
        for i in range(10):
            w.add_episode(episode(i), meta={"policy_version": i // 3})  # versions 0..3
        w.flush()
    with Reader(d.name, table="recent", timeout=5) as r:
        assert set(r.sample(200)["obs"][:, 0].tolist()) == {7.0, 8.0, 9.0}
    with Reader(d.name, table="fresh", timeout=5) as r:  # versions 2 and 3: episodes 6..9
        assert set(r.sample(400)["obs"][:, 0].tolist()) == {6.0, 7.0, 8.0, 9.0}
        assert set(r.sample(100, where="policy_version == 3")["obs"][:, 0].tolist()) == {9.0}
    status = e2e_env.cli("status", "--name", d.name)
    assert "bounds max_episodes=3" in status.stdout, status.stdout
    lags = "newest policy_version 3  episodes by lag 0: 1  1: 3  2: 3  3: 3  4+: 0  none: 0"
    assert lags in status.stdout, status.stdout
    bad = e2e_env.cli("start", "--name", "x", "--table", "a:uniform,max-episodes=lots")
    assert bad.returncode != 0 and "max-episodes must be an integer" in bad.stderr, bad.stderr


def members_of(name: str, table: str, n: int = 400) -> set[int]:
    """The episode numbers a table's uniform draws find (n draws: every one of a few shows)."""
    with Reader(name, table=table, timeout=5) as r:
        return {int(v) for v in r.sample(n)["obs"][:, 0].tolist()}


def test_an_episode_in_only_some_tables_through_the_daemon_and_a_resume(daemon, e2e_env, tmp_path):
    tables = ["--table", "replay:uniform", "--table", "eval:fifo,max-times-sampled=1"]
    tables += ["--table", "other:uniform"]
    d = daemon(capacity=200, unit="episode", args=tables)
    with Writer(d.name, timeout=5) as w:
        w.add_episode(episode(0))  # every table
        w.add_episode(episode(1), tables=["replay"])
        w.add_episode(episode(2), tables=["eval", "other"], meta={"ret": 2.0})
        for t in range(3):  # the last tables named for the episode win
            step = {"obs": torch.full((2,), 3.0), "step": torch.tensor(t)}
            w.add_transition("e", step, tables=["other"] if t == 0 else ["replay", "other"])
        w.end_episode("e")
        with pytest.raises(InvalidArgumentError, match="no table named 'nope'; the tables are"):
            w.add_episode(episode(9), tables=["nope"])
        with pytest.raises(InvalidArgumentError, match="empty list"):
            w.add_episode(episode(9), tables=[])
        w.flush()
    expected = {"replay": {0, 1, 3}, "other": {0, 2, 3}}
    assert {t: members_of(d.name, t) for t in expected} == expected
    with Reader(d.name, table="eval", timeout=5) as r, r.sample_episodes(1) as eps:
        assert [int(e["obs"][0, 0]) for e in eps] == [0]  # its own two, the oldest first

    sigkill(d)  # the journal's COMMIT records say which tables
    resumed = daemon(name=d.name, capacity=200, unit="episode", args=["--resume"])
    assert {t: members_of(resumed.name, t) for t in expected} == expected
    with Reader(resumed.name, table="eval", timeout=5, sample_timeout=0.5) as r:
        with r.sample_episodes(1) as eps:  # the one not handed out before the kill
            assert [int(e["obs"][0, 0]) for e in eps] == [2]
        with pytest.raises(WaitTimeoutError), r.sample_episodes(1):
            pass

    out = e2e_env.cli("checkpoint", "--name", resumed.name, "--to", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert resumed.stop() == 0
    restored = daemon(name=d.name, capacity=200, unit="episode", args=["--restore", str(tmp_path)])
    assert {t: members_of(restored.name, t) for t in expected} == expected
