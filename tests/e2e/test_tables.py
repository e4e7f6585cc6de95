"""Several tables over one daemon, through the real CLI: a consume-once FIFO table and a
prioritized replay table under SIGKILL + ``start --resume`` and under ``checkpoint`` +
``start --restore`` (nothing lost, nothing consumed twice, priorities kept), and each table's
draws by its own sampler over the same rows (chi-square)."""

from __future__ import annotations

import signal
from typing import Any

import numpy as np
import pytest

from shmbuffer import Reader, Writer
from shmbuffer.cli.demo_loops import check_episode, make_episode
from shmbuffer.errors import InvalidArgumentError, WaitTimeoutError
from tests._stats import P_MIN, chi2_p
from tests.e2e.conftest import wait_for

LENGTH = 10
OBS = (2, 3)
N = 20
TABLES = ["--table", "replay:prioritized", "--table", "online:fifo,max-times-sampled=1"]


def write_episodes(name: str, first: int, count: int) -> None:
    with Writer(name, timeout=5) as w:
        for e in range(first, first + count):
            w.add_episode(make_episode(0, e, LENGTH, OBS))
        w.flush()


def consume(name: str, n: int, calls: int | None = None) -> list[int]:
    """Episode numbers the ``online`` table hands out, ``n`` a call, each checked whole, until
    it has none left (or after ``calls`` calls)."""
    got: list[int] = []
    with Reader(name, timeout=5, sample_timeout=0.5, table="online") as r:
        assert r.consumes  # the table's word, not the default table's
        while calls is None or len(got) < calls * n:
            try:
                with r.sample_episodes(n) as episodes:
                    for ep in episodes:
                        check_episode(ep)
                        got.append(int(ep["episode"][0]))
            except WaitTimeoutError:
                break
    return got


def replay_probabilities(name: str) -> dict[int, float]:
    """Each episode's draw probability in the ``replay`` table (keyed by its first row), read
    back from many draws with ``info``."""
    with Reader(name, timeout=5, table="replay") as r:
        reply = r.conn.call("sample", kind="episodes", n=4000, info=True, table="replay")
    index = np.frombuffer(reply["index"], dtype="<i8")
    probability = np.frombuffer(reply["probability"], dtype="<f8")
    return {int(i): float(p) for i, p in zip(index, probability, strict=True)}


def set_priorities(name: str) -> None:
    """Episode k (first row ``k * LENGTH``) gets priority ``k + 1`` in the replay table."""
    with Reader(name, timeout=5, table="replay") as r:
        starts = np.arange(N) * LENGTH
        assert r.update_priorities(starts, np.arange(N) + 1.0) == N


def sigkill(d: Any) -> None:
    d.process.send_signal(signal.SIGKILL)
    d.process.wait(10)


def test_a_consume_once_and_a_replay_table_survive_sigkill_and_resume(daemon: Any) -> None:
    d = daemon(capacity=1000, unit="episode", args=TABLES)
    write_episodes(d.name, 0, N)
    first = consume(d.name, 3, calls=3)
    assert first == list(range(9))  # oldest first
    set_priorities(d.name)
    probabilities = replay_probabilities(d.name)
    assert len(probabilities) == N
    before = d.stats()["tables"]
    sigkill(d)

    resumed = daemon(name=d.name, capacity=1000, unit="episode", args=["--resume"])
    after = resumed.stats()["tables"]
    assert list(after) == ["replay", "online"]  # the dead daemon's tables, not --table given
    assert after["online"]["sampler"]["figures"] == before["online"]["sampler"]["figures"]
    assert after["replay"]["sampler"]["figures"] == before["replay"]["sampler"]["figures"]
    assert after["replay"]["priority_updates"] == before["replay"]["priority_updates"] == N
    assert replay_probabilities(d.name) == probabilities  # the same priorities, exactly
    rest = consume(d.name, 2, calls=5) + consume(d.name, 1)  # an odd one is left for the last
    assert sorted(first + rest) == list(range(N))  # each handed out once across the kill
    wait_for(lambda: resumed.stats()["leases"] == 0, 10, what="the consumer's leases to go")
    write_episodes(d.name, N, 2)  # and it goes on
    assert consume(d.name, 1) == [N, N + 1]


def test_a_consume_once_and_a_replay_table_survive_checkpoint_and_restore(
    daemon: Any, e2e_env: Any, tmp_path: Any
) -> None:
    d = daemon(capacity=1000, unit="episode", args=TABLES)
    write_episodes(d.name, 0, N)
    first = consume(d.name, 4, calls=2)
    set_priorities(d.name)
    probabilities = replay_probabilities(d.name)
    wait_for(lambda: d.stats()["leases"] == 0, 10, what="the consumer's leases to go")
    out = e2e_env.cli("checkpoint", "--name", d.name, "--to", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert d.stop() == 0

    restored = daemon(name=d.name, capacity=1000, unit="episode", args=["--restore", str(tmp_path)])
    assert list(restored.stats()["tables"]) == ["replay", "online"]
    assert replay_probabilities(d.name) == probabilities
    rest = consume(d.name, 1)
    assert first == list(range(8))
    assert sorted(first + rest) == list(range(N))


def test_a_resume_with_other_tables_is_refused_naming_them(daemon: Any, e2e_env: Any) -> None:
    d = daemon(capacity=1000, unit="episode", args=TABLES)
    write_episodes(d.name, 0, 2)
    sigkill(d)
    argv = ["start", "--name", d.name, "--storage-dir", str(e2e_env.storage_dir), "--resume"]
    out = e2e_env.cli(*argv, "--table", "replay:prioritized", "--table", "online:uniform")
    assert out.returncode != 0
    assert "table 'online': requested the uniform sampler, saved fifo" in out.stderr


def test_an_unknown_table_is_refused_listing_the_tables(daemon: Any) -> None:
    d = daemon(capacity=100, unit="episode", args=TABLES)
    with pytest.raises(InvalidArgumentError, match="no table named 'nope'; the tables are"):
        Reader(d.name, timeout=5, table="nope")


def test_each_table_draws_by_its_own_sampler_over_the_same_rows(daemon: Any) -> None:
    """Two tables over the same 8 rows: the uniform one draws each alike, the prioritized
    one (exponent 1) in proportion to the priorities set in it, whatever the other has."""
    args = ["--table", "flat:uniform", "--table", "replay:prioritized,priority-exponent=1"]
    d = daemon(capacity=8, unit="transition", args=[*args, "--seed", "7"])
    with Writer(d.name, timeout=5) as w:
        w.add_episode(make_episode(0, 0, 8, OBS))
        w.flush()
    priorities = np.arange(8) + 1.0
    with Reader(d.name, timeout=5, table="replay", prefetch=False) as replay:
        assert replay.update_priorities(np.arange(8), priorities) == 8
        drawn = [replay.sample(500, return_info=True)[1]["index"].numpy() for _ in range(20)]
    counts = np.bincount(np.concatenate(drawn), minlength=8)
    assert chi2_p(counts, counts.sum() * priorities / priorities.sum()) > P_MIN
    with Reader(d.name, timeout=5, table="flat", prefetch=False) as flat:
        drawn = [flat.sample(500, return_info=True)[1]["index"].numpy() for _ in range(20)]
    counts = np.bincount(np.concatenate(drawn), minlength=8)
    assert chi2_p(counts, np.full(8, counts.sum() / 8)) > P_MIN
    tables = d.stats()["tables"]
    assert tables["replay"]["rate_limiter"]["sampled"] == 10_000
    assert tables["flat"]["rate_limiter"]["sampled"] == 10_000


def test_torchrl_daemon_samplers_of_two_tables_share_one_storage(daemon: Any) -> None:
    torchrl = pytest.importorskip("torchrl")
    import torch
    from tensordict import TensorDict

    from shmbuffer.torchrl import DaemonSampler, DaemonStorage, DaemonWriter

    args = ["--table", "flat:uniform", "--table", "replay:prioritized", "--seed", "3"]
    d = daemon(capacity=64, unit="transition", args=args)
    storage = DaemonStorage(d.name)
    try:
        buffers = torchrl.data.ReplayBuffer
        flat = buffers(
            storage=storage, writer=DaemonWriter(), sampler=DaemonSampler(), batch_size=512
        )
        replay = buffers(
            storage=storage,
            writer=DaemonWriter(),
            sampler=DaemonSampler(table="replay"),
            batch_size=512,
        )
        flat.extend(TensorDict({"id": torch.arange(16)}, [16]))
        _, info = replay.sample(return_info=True)
        hot = int(info["index"][0])
        replay.update_priority(info["index"], torch.where(info["index"] == hot, 1e6, 1e-6))
        _, info = replay.sample(return_info=True)
        assert (info["index"] == hot).sum() >= 500  # the replay table's priorities
        assert (flat.sample(return_info=True)[1]["index"] == hot).sum() < 100  # not the flat one's
        assert "table='replay'" in repr(replay.sampler)
    finally:
        storage.close()


def test_status_shows_each_table_and_the_one_holding_writes_back_and_configure_reaches_it(
    daemon: Any, e2e_env: Any
) -> None:
    from shmbuffer.clients.connection import Connection

    online = "online:fifo,max-times-sampled=1,rate-limiter=min-size"
    d = daemon(
        capacity=40, unit="episode", args=["--table", "replay:prioritized", "--table", online]
    )
    write_episodes(d.name, 0, 4)  # full: the next write evicts what online has not read
    writer = Connection(d.name, "writer", timeout=5)
    try:
        seq = writer.send("reserve", rows=LENGTH, timeout_ms=20_000)
        held = wait_for(
            lambda: d.stats()["tables"]["online"]["holds_writes"], 10, what="the write to park"
        )
        assert "table 'online'" in held and "fifo" in held
        assert d.stats()["tables"]["replay"]["holds_writes"] is None
        out = e2e_env.cli("status", "--name", d.name)
        assert out.returncode == 0, out.stderr
        lines = [line.strip() for line in out.stdout.splitlines()]
        assert any(
            line.startswith("tables      replay (default): prioritized")
            for line in out.stdout.splitlines()
        )
        assert any(line.startswith("online: fifo") and "HOLDS WRITES" in line for line in lines)
        assert consume(d.name, 1, calls=1) == [0]  # its rows let go: the write goes on
        writer.wait(seq)
    finally:
        writer.close()
    out = e2e_env.cli("configure", "--name", d.name, "--table", "online", "--min-size", "5")
    assert out.returncode == 0, out.stderr
    assert "table 'online'" in out.stdout
    tables = d.stats()["tables"]
    assert tables["online"]["rate_limiter"]["settings"]["min_size"] == 5
    out = e2e_env.cli("configure", "--name", d.name, "--table", "nope", "--min-size", "5")
    assert out.returncode != 0 and "no table named 'nope'" in out.stderr
