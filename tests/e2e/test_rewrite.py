"""Committed rows changed in place (``Writer.rewrite``, the daemon's ``rewrite``), through a real
daemon and real processes: readers sampling image rows while their rows are rewritten never get
one half changed, by their own draws or the daemon's; a reader's lease (its process stopped
with SIGSTOP, or killed) holds a rewrite back until it ends; a refusal changes nothing; the
rows keep their places, episodes and priorities."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shmbuffer import Reader, Writer
from shmbuffer.errors import InvalidArgumentError, SchemaError, WaitTimeoutError
from tests.e2e.conftest import wait_for

pytestmark = pytest.mark.timeout(90)

IMAGE = (64, 64)  # 4 KiB rows: a copy is many stores, so a torn one would show


def rows_of(value: np.ndarray) -> dict[str, Any]:
    img = np.empty((value.size, *IMAGE), dtype=np.uint8)
    img.reshape(value.size, -1)[:] = (value % 256).astype(np.uint8)[:, None]
    return {"img": img, "v": value.astype(np.int64)}


def stored(name: str, rows: np.ndarray) -> dict[str, np.ndarray]:
    with Reader(name) as reader:
        physical, gens = reader.committed_rows()
        stamps = dict(zip(physical.tolist(), gens.tolist(), strict=True))
        data, moved = reader.read(rows, np.array([stamps[int(r)] for r in rows]))
    assert not moved.any()
    return {"img": data["img"].numpy(), "v": data["v"].numpy()}


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"], ids=["own-draws", "daemon-draws"])
def test_readers_never_get_a_half_rewritten_row(daemon: Any, children: Any, sampler: str) -> None:
    d = daemon(capacity=64, unit="transition", args=["--sampler", sampler])
    with Writer(d.name) as writer:
        writer.extend(rows_of(np.arange(64)))
        children.spawn("reader", "sample_whole_rows", d.name, 3.0)
        tag, status, local = children.get(30)
        assert (tag, status) == ("reader", "started")
        assert local or sampler != "uniform"  # uniform: drawn by the reader itself
        rng = np.random.default_rng(0)
        rewrites, value = 0, 1000
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            target = rng.choice(64, size=8, replace=False)
            values = value + np.arange(8)
            assert writer.rewrite(target, rows_of(values)).all()
            value += 8
            rewrites += 1
        checked, torn = children.collect({"reader"}, 30)["reader"]
    assert rewrites > 50 and checked > 1000
    assert torn == 0
    assert d.stats()["rows_rewritten"] == 8 * rewrites


def test_some_columns_only_and_the_rows_keep_their_places_and_priorities(daemon: Any) -> None:
    d = daemon(capacity=32, unit="transition", args=["--sampler", "prioritized"])
    with Writer(d.name) as writer:
        writer.extend(rows_of(np.arange(32)), priority=np.arange(1, 33, dtype=np.float64))
        writer.flush()
        before = d.stats()
        assert writer.rewrite([3, 7], {"v": torch.tensor([300, 700])}).all()
    after = d.stats()
    data = stored(d.name, np.array([3, 7, 8]))
    assert data["v"].tolist() == [300, 700, 8]
    assert (data["img"][:2].reshape(2, -1) == np.array([[3], [7]], dtype=np.uint8)).all()
    assert after["rows"] == before["rows"] == 32 and after["pointer"] == before["pointer"]
    total = after["sampler"]["figures"].get("total_priority")
    assert total == before["sampler"]["figures"].get("total_priority")
    with Reader(d.name) as reader:
        counts = np.bincount(reader.sample(4000)["v"].numpy(), minlength=701)
    assert counts[31] > counts[1]  # row 31 (priority 32) still drawn far more than row 1


def test_a_refused_rewrite_changes_nothing(daemon: Any) -> None:
    d = daemon(capacity=16, unit="transition")
    with Writer(d.name) as writer:
        writer.extend(rows_of(np.arange(10)))
        bad: list[tuple[Any, dict[str, Any], type[Exception], str]] = [
            ([1, 12], {"v": np.array([5, 6])}, InvalidArgumentError, "rows [12]"),
            ([1, 40], {"v": np.array([5, 6])}, InvalidArgumentError, "row 40"),
            ([1], {"w": np.array([5])}, SchemaError, "'w'"),
            ([1], {"v": np.array([[5, 6]])}, SchemaError, "'v'"),
            ([1], {"v": np.array([5.5])}, SchemaError, "'v'"),
            ([1, 2], {"v": np.array([5])}, SchemaError, "2 rows"),
        ]
        for index, data, error, words in bad:
            with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
                writer.rewrite(index, data)
    data = stored(d.name, np.arange(10))
    assert data["v"].tolist() == list(range(10))
    assert d.stats()["rows_rewritten"] == 0


def test_stamps_seen_before_an_overwrite_skip_the_rows(daemon: Any) -> None:
    d = daemon(capacity=8, unit="transition")
    with Writer(d.name) as writer, Reader(d.name) as reader:
        writer.extend(rows_of(np.arange(8)))
        writer.flush()
        physical, gens = reader.committed_rows()
        writer.extend(rows_of(np.arange(100, 102)))  # rows 0 and 1 written again
        done = writer.rewrite(physical[:4], rows_of(np.arange(50, 54)), generation=gens[:4])
    assert done.tolist() == [False, False, True, True]
    assert stored(d.name, np.arange(4))["v"].tolist() == [100, 101, 52, 53]


@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_a_rewrite_waits_for_a_readers_lease(daemon: Any, children: Any, how: str) -> None:
    """A reader holding zero-copy views of the episodes keeps the rows as they are: the
    rewrite waits, while the reader is stopped (SIGSTOP) until its lease's TTL runs out, or
    until the daemon finds its process gone."""
    d = daemon(capacity=16, unit="episode", args=["--lease-ttl", "2"])
    with Writer(d.name) as writer:
        writer.extend({**rows_of(np.arange(16)), "step": np.arange(16)})  # one episode
        writer.flush()
        proc = children.spawn("lease", "lease_and_hang", d.name, 1)
        got = children.get(30)
        assert got[:2] == ("lease", "leased"), got
        os.kill(proc.pid, signal.SIGSTOP if how == "stopped" else signal.SIGKILL)
        try:
            if how == "stopped":  # a short wait first: refused, naming the leases
                writer._pipe.reserve_timeout = 0.3
                with pytest.raises(WaitTimeoutError, match="leased"):
                    writer.rewrite([4], {"v": np.array([44])})
                assert stored(d.name, np.array([4]))["v"].tolist() == [4]
                writer._pipe.reserve_timeout = 30.0
            t0 = time.monotonic()
            assert writer.rewrite([4], {"v": np.array([44])}).all()
            assert time.monotonic() - t0 < 10
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
    wait_for(lambda: stored(d.name, np.array([4]))["v"].tolist() == [44], 5)


def whole_rows(name: str) -> tuple[np.ndarray, np.ndarray]:
    """Every committed row's ``v``, and whether its ``img`` is all ``v % 256``."""
    with Reader(name) as reader:
        physical, gens = reader.committed_rows()
        data, moved = reader.read(physical, gens)
    assert not moved.any()
    img = data["img"].reshape(len(physical), -1).numpy()
    v = data["v"].numpy()
    return v, (img == (v % 256).astype(np.uint8)[:, None]).all(axis=1)


def test_a_daemon_killed_mid_rewrite_resumes_without_those_episodes(
    daemon: Any, children: Any
) -> None:
    """SIGKILL while the daemon copies a rewrite (caught by ``spans.bin``'s sequence number,
    odd from the new stamps to the last byte): ``--resume`` serves no half-changed row; the
    episode the rewrite touched is gone, the other is whole. A rewrite that finished before the
    kill comes back as written."""
    big = (1024, 1024)  # 1 MiB rows: the copy of 48 takes tens of milliseconds
    d = daemon(capacity=96, unit="transition")

    def rows(first: int, n: int) -> dict[str, Any]:
        v = np.arange(first, first + n)
        img = np.empty((n, *big), dtype=np.uint8)
        img.reshape(n, -1)[:] = (v % 256).astype(np.uint8)[:, None]
        return {"img": img, "v": v}

    with Writer(d.name) as writer:
        writer.extend(rows(0, 48))  # episode A: rows 0..47
        writer.flush()
        writer.extend(rows(48, 48))  # episode B: rows 48..95
        writer.flush()
        done = {"img": np.full((1, *big), 700 % 256, np.uint8), "v": np.array([700])}
        assert writer.rewrite([60], done).all()  # finished: kept across the kill
    words = np.memmap(Path(d.segment_path) / "spans.bin", dtype=np.int64, mode="r", shape=(8,))
    before = int(words[0])
    children.spawn("rewrite", "rewrite_big", d.name, list(range(48)), 1000)
    assert children.get(30)[:2] == ("rewrite", "sending")
    deadline = time.monotonic() + 20
    while not (int(words[0]) & 1 and int(words[0]) > before):
        assert time.monotonic() < deadline, "the rewrite never began its copy"
    time.sleep(0.002)  # into the copy
    d.process.kill()
    d.process.wait(10)
    del words
    daemon(name=d.name, capacity=96, unit="transition", args=["--resume"])
    v, whole = whole_rows(d.name)
    assert whole.all(), f"half-changed rows served: {v[~whole].tolist()}"
    assert set(v.tolist()) >= set(range(48, 96)) - {60} | {700}  # episode B, its rewrite kept
    assert not set(v.tolist()) & set(range(48))  # episode A: gone, or rewritten whole


def test_a_row_named_twice_gets_its_last_value(daemon: Any) -> None:
    d = daemon(capacity=8, unit="transition")
    with Writer(d.name) as writer:
        writer.extend(rows_of(np.arange(8)))
        assert writer.rewrite([5, 2, 5], {"v": np.array([50, 20, 55])}).all()
    assert stored(d.name, np.array([2, 5]))["v"].tolist() == [20, 55]
    assert d.stats()["rows_rewritten"] == 2
