"""A learner's ``Reader(name).sample(n)`` on a uniform table draws its rows itself, over the runs
of live rows the daemon publishes (``registry/shared_spans.py``), without a round trip: the same
uniform draw, the same stamp checks, its counts reaching the daemon in bulk. Through real
daemons and processes: a writer lapping a ring of image rows as fast as it can while the reader
checks every row it gets whole, a writer SIGSTOPped mid-stream, the min-size limiter, the
samplers that keep the daemon's draw, the opt-out, and a daemon that dies or is resumed under
a reader drawing locally."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shmbuffer import Reader, Writer
from shmbuffer.cli.demo_loops import check_rows, make_episode
from shmbuffer.clients.connection import Connection
from shmbuffer.errors import DaemonUnavailableError, ShmBufferError, WaitTimeoutError
from tests._stats import P_MIN, chi2_p
from tests.e2e.conftest import wait_for

pytestmark = pytest.mark.timeout(90)

IMAGE = (64, 64)  # 4 KiB rows: a row's copy is many stores, so a torn one would show


def use_counts(d: Any) -> np.ndarray:
    return np.fromfile(Path(d.segment_path) / "use_counts.bin", dtype="<i4")


def fill(name: str, rows: int, first: int = 0) -> None:
    with Writer(name) as writer:
        writer.extend({"id": torch.arange(first, first + rows)})  # row i holds id i


def messages(reader: Reader) -> int:
    return int(reader.stats()["messages"])


@pytest.mark.parametrize("lane", ["1", "0"], ids=["lane", "zmq"])
def test_a_uniform_sample_asks_the_daemon_nothing_and_is_counted(
    daemon: Any, monkeypatch: pytest.MonkeyPatch, lane: str
) -> None:
    monkeypatch.setenv("SHMBUFFER_LANE", lane)  # the reports' frames both ways
    d = daemon(capacity=256, unit="transition")
    fill(d.name, 256)
    with Reader(d.name) as reader:
        reader.sample(8)  # attaches
        assert reader.local_draws
        before = reader.stats()
        counts = use_counts(d)
        sent = messages(reader)
        for _ in range(200):
            batch = reader.sample(64)
            assert batch["id"].shape == (64,) and (batch["id"] < 256).all()
        # a few bulk reports of what was drawn, not one request per sample
        assert messages(reader) - sent < 40
        after = reader.stats()
    assert after["samples"] - before["samples"] == 200
    assert after["rows_sampled"] - before["rows_sampled"] == 200 * 64
    assert after["rate_limiter"]["sampled"] - before["rate_limiter"]["sampled"] == 200 * 64
    assert int((use_counts(d) - counts).sum()) == 200 * 64


def test_draws_are_uniform_over_every_run_and_their_info_is_right(daemon: Any) -> None:
    """Live rows in two runs (a writer's reservation open in the middle of the ring): each
    live row equally likely, the reserved ones never, the info a uniform draw's."""
    d = daemon(capacity=64, unit="transition")
    fill(d.name, 64)
    fill(d.name, 32, first=64)  # rows 0..31 hold ids 64..95; the pointer is at 32
    writer = Connection(d.name, "writer")
    try:
        held = writer.call("reserve", rows=16)  # rows 32..47 evicted, in flight
        assert held["ranges"] == [[32, 48]]
        with Reader(d.name) as reader:
            counts = np.zeros(64)
            for _ in range(20):
                batch, info = reader.sample(960, return_info=True)
                assert reader.local_draws
                index = info["index"].numpy()
                assert np.array_equal(batch["id"].numpy() % 64, index)
                assert np.array_equal(info["probability"].numpy(), np.full(960, 1 / 48))
                assert (info["weight"] == 1).all() and info["weight"].dtype == torch.float32
                stamps = reader.segment.generations[index]  # type: ignore[union-attr]
                assert np.array_equal(info["generation"].numpy(), stamps)
                np.add.at(counts, index, 1)
    finally:
        writer.close()
    assert counts[32:48].sum() == 0, "a row in flight was drawn"
    live = np.r_[counts[:32], counts[48:]]
    assert chi2_p(live, np.full(48, 20 * 960 / 48)) > P_MIN


def test_the_seed_makes_a_readers_draws_repeat(daemon: Any) -> None:
    d = daemon(capacity=128, unit="transition", args=["--seed", "5"])
    fill(d.name, 128)

    def draws() -> list[int]:
        with Reader(d.name) as reader:
            return [int(i) for _ in range(3) for i in reader.sample(32)["id"]]

    first = draws()
    assert first != draws()  # another client id: another stream
    d2 = daemon(capacity=128, unit="transition", args=["--seed", "5"])
    fill(d2.name, 128)
    with Reader(d2.name) as reader:
        assert [int(i) for _ in range(3) for i in reader.sample(32)["id"]] == first


@pytest.mark.parametrize("unit", ["transition", "episode"])
def test_no_torn_row_while_a_writer_laps_the_ring(daemon: Any, children: Any, unit: str) -> None:
    """A writer process overwrites a ring of 4 KiB rows as fast as it can; every row the
    reader's own draws hand out is whole (its image agrees with its writer, episode and step
    columns), and the writer's rows in flight are never drawn."""
    d = daemon(capacity=8 * 32, unit=unit)
    with Writer(d.name) as writer:  # the ring full before the reader starts
        for e in range(8):
            writer.add_episode(make_episode(0, e, 32, IMAGE))
    children.spawn("w", "write_episodes", d.name, 1, 100_000, 32, IMAGE)
    checked = resamples = 0
    with Reader(d.name, timeout=10) as reader:
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:
            batch = reader.sample(128)
            check_rows(batch)
            checked += len(batch)
        assert reader.local_draws
        resamples = reader.resamples
        laps = (int(reader.stats()["rows_committed"]) - 256) // 256
    print(f"\n{unit}: {checked} rows checked whole, {resamples} redrawn, the ring lapped {laps}x")
    assert laps >= 2, "the writer never lapped the ring: nothing was tested"


def test_rows_overwritten_during_the_copy_are_drawn_again_here(
    daemon: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer reserves the oldest episode's rows while the reader copies a sample that
    holds some of them (a real write, made from inside the gather): the reader draws those
    rows again itself, with no round trip and no lease, and hands out only whole rows."""
    from shmbuffer.storage import rows

    d = daemon(capacity=8 * 32, unit="episode")
    with Writer(d.name) as writer, Reader(d.name, timeout=10) as reader:
        for e in range(8):
            writer.add_episode(make_episode(0, e, 32, IMAGE))
        writer.flush()
        reader.sample(8)
        assert reader.local_draws
        real, overwritten = rows.gather, []

        def gather_then_overwrite(*args: Any, **kwargs: Any) -> Any:
            out = real(*args, **kwargs)
            if not overwritten:  # the first gather only: the sample's own
                overwritten.append(True)
                writer.add_episode(make_episode(0, 8, 32, IMAGE))  # evicts episode 0
                writer.flush()
            return out

        monkeypatch.setattr(rows, "gather", gather_then_overwrite)
        batch = reader.sample(128)  # 128 of 256 rows: episode 0's 32 are all but certainly in
        check_rows(batch)
        assert reader.resamples > 0, "no drawn row was overwritten: nothing was tested"
        assert reader.local_redraws == reader.resamples
        assert set(batch["episode"].tolist()) <= set(range(1, 9))


def test_a_stopped_writer_holds_nobody_back_and_its_rows_are_never_drawn(
    daemon: Any, children: Any
) -> None:
    """A writer SIGSTOPped wherever it is (mid-copy included) keeps its reserved rows; a
    reader drawing itself goes on sampling the rest, and every row it gets is whole."""
    d = daemon(capacity=8 * 32, unit="transition")
    with Writer(d.name) as writer:
        for e in range(8):
            writer.add_episode(make_episode(0, e, 32, IMAGE))
    proc = children.spawn("w", "write_episodes", d.name, 1, 100_000, 32, IMAGE)
    rng = np.random.default_rng(0)
    with Reader(d.name, timeout=5) as reader:
        reader.sample(8)
        wait_for(lambda: reader.stats()["rows_committed"] > 2 * 256, 60, what="the writer")
        for _ in range(4):
            time.sleep(float(rng.uniform(0.05, 0.3)))
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                stopped_at = time.monotonic()
                calls = 0
                while time.monotonic() - stopped_at < 0.5:
                    check_rows(reader.sample(128))
                    calls += 1
                assert calls > 10, "the reader waited for the stopped writer"
            finally:
                os.kill(proc.pid, signal.SIGCONT)
        assert reader.local_draws


def test_min_size_waits_in_the_daemon_until_met(daemon: Any) -> None:
    limiter = ["--rate-limiter", "min-size", "--min-size", "100"]
    d = daemon(capacity=256, unit="transition", args=limiter)
    fill(d.name, 60)
    with Reader(d.name, sample_timeout=0.3) as reader:
        with pytest.raises(WaitTimeoutError):
            reader.sample(4)  # 60 of 100 rows: the daemon holds the sample
        fill(d.name, 40, first=60)
        sent = messages(reader)
        for _ in range(50):
            assert (reader.sample(16)["id"] < 100).all()
        assert messages(reader) - sent < 20, "met: the reader draws itself"
        admin = d.admin()
        try:
            admin.call("configure", min_size=200)
        finally:
            admin.close()
        with pytest.raises(WaitTimeoutError):
            reader.sample(4)  # the daemon's word changed with its settings


RATIO = ["--rate-limiter", "sample-to-insert", "--samples-per-insert", "9", "--error-buffer", "1e6"]


@pytest.mark.parametrize(
    "args",
    [["--sampler", "prioritized"], ["--max-times-sampled", "1000"], RATIO],
    ids=["prioritized", "max-times-sampled", "sample-to-insert"],
)
def test_other_tables_keep_the_daemons_draw(daemon: Any, args: list[str]) -> None:
    d = daemon(capacity=128, unit="transition", args=args)
    fill(d.name, 128)
    with Reader(d.name, prefetch=False) as reader:
        reader.sample(4)
        sent = messages(reader)
        for _ in range(20):
            reader.sample(4)
        assert messages(reader) - sent >= 21  # a request per sample (a release too), the stats


def test_local_draws_can_be_turned_off(daemon: Any) -> None:
    d = daemon(capacity=128, unit="transition")
    fill(d.name, 128)
    with Reader(d.name, local_draws=False, prefetch=False) as reader:
        reader.sample(4)
        assert not reader.local_draws
        sent = messages(reader)
        for _ in range(20):
            reader.sample(4)
        assert messages(reader) - sent == 21


def test_a_dead_daemon_is_noticed_within_the_timeout(daemon: Any) -> None:
    d = daemon(capacity=128, unit="transition")
    fill(d.name, 128)
    reader = Reader(d.name, timeout=2)
    try:
        reader.sample(4)
        assert reader.local_draws
        d.process.kill()
        d.process.wait(10)
        killed = time.monotonic()
        with pytest.raises(DaemonUnavailableError):
            while time.monotonic() - killed < 20:
                reader.sample(4)
                time.sleep(0.01)
        assert time.monotonic() - killed < 2 + 1.0
    finally:
        reader.close()


def test_a_resumed_daemon_publishes_before_it_serves(daemon: Any) -> None:
    """SIGKILL and ``--resume``: the runs are published again in the file the old readers
    map (in place), from the whole replayed state; a new reader draws over them, and one of
    the dead daemon learns of the restart instead of drawing on."""
    d = daemon(capacity=128, unit="transition")
    fill(d.name, 100)
    old = Reader(d.name, timeout=3)
    try:
        old.sample(4)
        inode = (Path(d.segment_path) / "spans.bin").stat().st_ino
        d.process.kill()
        d.process.wait(10)
        resumed = daemon(name=d.name, capacity=128, unit="transition", args=["--resume"])
        assert (Path(d.segment_path) / "spans.bin").stat().st_ino == inode
        fill(d.name, 50, first=100)  # laps the ring: rows 0..21 hold ids 128..149
        with Reader(d.name) as reader:
            ids = reader.sample(2000)["id"].numpy()
            assert reader.local_draws
            assert set(ids) <= set(range(22, 150)) and len(set(ids)) > 100
        with pytest.raises(ShmBufferError):  # the restart, or the lost requests
            for _ in range(500):
                batch = old.sample(64)
                assert set(batch["id"].numpy()) <= set(range(22, 150)), "stale rows handed out"
                time.sleep(0.01)
        assert resumed.process.poll() is None
    finally:
        old.close()
