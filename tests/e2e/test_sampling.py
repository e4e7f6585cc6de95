"""Samplers and flow control through a real daemon: prioritized replay (frequencies, info,
updates from another reader, stale updates), slices and padded slices, a without-replacement
epoch and a FIFO queue shared by two reader processes, the samples-per-insert ratio between a
real writer and a real reader process, ``configure`` live, priorities across SIGKILL +
``--resume`` and checkpoint + ``--restore``, bad input, and a remote (tcp) reader.

Statistical checks use fixed seeds (``--seed``) and Pearson's chi-square at p > P_MIN
(tests/_stats.py); each test stays within a few seconds on 2 cores.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from shmbuffer import Reader, Writer, cli
from shmbuffer.errors import InvalidArgumentError, ProtocolError, WaitTimeoutError
from shmbuffer.wire.protocol import encode_f64, encode_i64
from tests._stats import P_MIN, chi2_p
from tests.e2e.conftest import wait_for

pytestmark = pytest.mark.timeout(60)

ALPHA = 0.7


def _ids(n: int, first: int = 0) -> dict[str, torch.Tensor]:
    return {"id": torch.arange(first, first + n)}


def _expected_probability(priority: np.ndarray, alpha: float = ALPHA) -> np.ndarray:
    weight = priority**alpha
    return weight / weight.sum()


def _prioritized(daemon: Any, capacity: int = 32, *extra: str) -> Any:
    return daemon(
        capacity=capacity,
        unit="transition",
        args=[
            "--sampler",
            "prioritized",
            "--priority-exponent",
            str(ALPHA),
            "--priority-eps",
            "0",
            "--seed",
            "7",
            *extra,
        ],
    )


# -- prioritized -------------------------------------------------------------------------------


def test_prioritized_frequencies_match_priority_alpha_and_updates_reach_another_reader(
    daemon: Any, children: Any
) -> None:
    d = _prioritized(daemon)
    priority = np.arange(1, 17, dtype=np.float64)
    with Writer(d.name) as writer:
        writer.extend(_ids(16), priority=priority)  # row i holds id i
    expected = _expected_probability(priority)
    with Reader(d.name) as reader:
        counts = np.zeros(16)
        for _ in range(20):
            batch, info = reader.sample(1000, return_info=True)
            assert (batch["id"] == info["index"]).all()
            assert info["weight"].dtype == torch.float32 and info["index"].dtype == torch.int64
            np.add.at(counts, info["index"].numpy(), 1)
        # 20,000 draws: frequencies follow priority**alpha ...
        assert chi2_p(counts, 20_000 * expected) > P_MIN
        # ... and each draw's probability and weight are the formulas' values
        index = info["index"].numpy()
        np.testing.assert_allclose(info["probability"].numpy(), expected[index], rtol=1e-9)
        weight = (expected[index] / expected.min()) ** -0.4  # (N P)^-beta / max, beta default
        np.testing.assert_allclose(info["weight"].numpy(), weight, rtol=1e-6)
        _, annealed = reader.sample(64, return_info=True, beta=1.0)
        lowest = expected.min()
        want = (expected[annealed["index"].numpy()] / lowest) ** -1.0
        np.testing.assert_allclose(annealed["weight"].numpy(), want, rtol=1e-6)

        # this reader's update changes what another reader process samples: rows 4.. vanish
        new = np.where(np.arange(16) < 4, np.arange(1, 17), 0.0)
        index, gens = torch.arange(16), reader.sample(1, return_info=True)[1]["generation"]
        assert reader.update_priorities(index, torch.from_numpy(new), gens.expand(16)) == 16
    children.spawn("other", "count_sampled_rows", d.name, 4000, 500)
    other = np.array(children.collect({"other"}, timeout=30)["other"])
    assert other[4:].sum() == 0, "a row whose priority was set to 0 was still sampled"
    assert chi2_p(other[:4], 4000 * _expected_probability(new[:4])) > P_MIN
    stats = d.stats()
    assert stats["priority_updates"] == 16 and stats["sampler"]["kind"] == "prioritized"


def test_stale_priority_updates_are_skipped_and_counted(daemon: Any) -> None:
    d = _prioritized(daemon, capacity=8)
    with Writer(d.name) as writer, Reader(d.name) as reader:
        writer.extend(_ids(8))
        writer.flush()
        _, info = reader.sample(8, return_info=True)
        writer.extend(_ids(4, first=100))  # the ring overwrites rows 0..3
        writer.flush()
        fresh = info["index"] >= 4
        updated = reader.update_priorities(info["index"], 5.0, info["generation"])
        assert updated == int(fresh.sum())
        stats = reader.stats()
        assert stats["priority_updates_stale"] == int((~fresh).sum())
        assert stats["priority_updates"] == updated
        # the new data in rows 0..3 kept the priority it was committed with (the largest seen
        # then, 1), never the 5.0 meant for the rows it replaced
        prio = np.ones(8)
        prio[info["index"][fresh].numpy()] = 5.0
        _, now = reader.sample(200, return_info=True)
        want = _expected_probability(prio)[now["index"].numpy()]
        np.testing.assert_allclose(now["probability"].numpy(), want, rtol=1e-9)
        assert writer.rows_committed == 12


def test_an_update_without_generation_is_checked_with_the_stamps_its_sample_had(
    daemon: Any,
) -> None:
    """``update_priorities(info["index"], p)`` without ``generation=``: the reader already
    holds the stamps of the rows it handed out, so rows overwritten since are skipped as
    stale all the same; an index array it never handed out is applied to the rows as they
    are, and so is any update once the sample is no longer among the last ones."""
    d = _prioritized(daemon, capacity=8)
    with Writer(d.name) as writer, Reader(d.name) as reader:
        writer.extend(_ids(8))
        writer.flush()
        _, info = reader.sample(8, return_info=True)
        _, later = reader.sample(8, return_info=True)  # a pipeline: updates one batch late
        writer.extend(_ids(4, first=100))  # the ring overwrites rows 0..3
        writer.flush()
        fresh = info["index"] >= 4
        assert reader.update_priorities(info["index"], 5.0) == int(fresh.sum())
        stats = reader.stats()
        assert stats["priority_updates_stale"] == int((~fresh).sum())
        assert reader.update_priorities(later["index"], 5.0) == int((later["index"] >= 4).sum())
        # rows this reader never handed out as one sample: no stamps to check, applied
        assert reader.update_priorities(torch.arange(8), 1.0) == 8


# -- slices ------------------------------------------------------------------------------------


def _episode(ep: int, length: int) -> dict[str, torch.Tensor]:
    return {"ep": torch.full((length,), ep), "step": torch.arange(length) + 1}


def test_slices_stay_inside_episodes_and_padded_slices_carry_a_prefix_mask(daemon: Any) -> None:
    d = daemon(capacity=64, unit="episode", args=["--seed", "3"])
    lengths = [3, 5, 8]
    with Writer(d.name) as writer:
        for ep, length in enumerate(lengths):
            writer.add_episode(_episode(ep, length))
    with Reader(d.name) as reader:
        slices = reader.sample_slices(3000, 4)
        ep, step = slices["ep"], slices["step"]
        assert (ep == ep[:, :1]).all(), "a slice crossed an episode end"
        assert (step == step[:, :1] + torch.arange(4)).all()
        # every valid start equally likely: (ep 1: 2 starts, ep 2: 5 starts; ep 0 is too short)
        starts = [(e, s) for e in (1, 2) for s in range(1, lengths[e] - 4 + 2)]
        keys = list(zip(ep[:, 0].tolist(), step[:, 0].tolist(), strict=True))
        counts = np.array([keys.count(k) for k in starts])
        assert counts.sum() == 3000
        assert chi2_p(counts, np.full(len(starts), 3000 / len(starts))) > P_MIN

        padded = reader.sample_slices(600, 6, strict=False)
        mask, ep, step = padded["mask"], padded["ep"], padded["step"]
        assert mask.dtype == torch.bool and mask.shape == (600, 6)
        real = mask.sum(dim=1)
        assert (mask == (torch.arange(6) < real[:, None])).all(), "mask is not a prefix"
        for e, length in enumerate(lengths):
            rows = ep[:, 0] == e
            assert rows.any(), f"episode {e} never sampled"
            assert (real[rows] == min(length, 6)).all()
        assert (step[~mask] == 0).all() and (ep[~mask] == 0).all(), "padding is not zero"
        short = ep[:, 0] == 0
        assert (step[short, :3] == torch.arange(1, 4)).all(), "a short episode starts its slice"


# -- consume once: epochs and FIFO across reader processes -------------------------------------


def test_without_replacement_epoch_hands_every_row_out_once_across_two_readers(
    daemon: Any, children: Any
) -> None:
    """Two reader processes (a spawned one and this one) share one epoch of 120 rows."""
    d = daemon(capacity=200, unit="transition", args=["--sampler", "without-replacement"])
    with Writer(d.name) as writer:
        writer.extend(_ids(120))
    children.spawn("other", "sample_row_ids", d.name, 6, 10)
    assert children.get(timeout=30)[1] == "ready"
    mine: list[int] = []
    with Reader(d.name) as reader:
        assert not reader.prefetch, "a consume-once sampler must never be sampled ahead"
        for _ in range(6):
            mine += reader.sample(10)["id"].tolist()
    other = children.collect({"other"}, timeout=30)["other"]
    assert sorted(mine + other) == list(range(120)), "an epoch row was missed or repeated"
    assert mine and other


def test_fifo_hands_each_episode_to_one_reader_in_order_while_the_writer_waits(
    daemon: Any, children: Any
) -> None:
    """Two reader processes (a spawned one, and a thread of this one) and a writer process:
    8 episodes of 5 fill the ring, so the writer's 30 must wait for the readers to consume."""
    d = daemon(capacity=40, unit="episode", args=["--sampler", "fifo", "--max-times-sampled", "1"])
    children.spawn("reader", "consume_fifo_episodes", d.name, 0.02, 30.0, 1.0)
    # A reader process starts slower than the writer (it imports tensordict): until it is
    # connected, the thread below could consume all 30 before it asks for any.
    assert children.get(timeout=30)[:2] == ("reader", "ready")
    children.spawn("writer", "write_fifo_episodes", d.name, 30, 5)
    mine: list[int] = []

    def consume() -> None:
        from tests.e2e._workers import consume_fifo_episodes

        mine.extend(consume_fifo_episodes(d.name, 0.02, 30.0, 1.0, say=lambda *a: None))

    thread = threading.Thread(target=consume)
    thread.start()
    got = children.collect({"reader", "writer"}, timeout=45)
    thread.join(15)
    assert not thread.is_alive()
    other = got["reader"]
    assert sorted(mine + other) == list(range(30)), "an episode was lost, or handed out twice"
    assert mine == sorted(mine) and other == sorted(other), "episodes out of insertion order"
    assert mine and other, "one reader got everything"
    stats = d.stats()
    assert stats["rate_limiter"]["insert_blocked_s"] > 0, "the writer was never held back"
    assert stats["rows_committed"] == 150 and stats["sampler"]["figures"]["dropped_rows"] == 0


def test_fifo_rows_consumed_under_back_pressure_are_never_lost(daemon: Any) -> None:
    """Rows a FIFO sample consumes free the rows a parked writer waits for, and the writer is
    retried at once: the reader's copy must still get them (its sample leases them until the
    copy is checked), not find them torn, sample again and so lose them."""
    d = daemon(
        capacity=40, unit="transition", args=["--sampler", "fifo", "--max-times-sampled", "1"]
    )

    def write() -> None:
        with Writer(d.name, reserve_timeout=20.0, batch_bytes=0) as writer:
            for chunk in range(30):
                writer.extend(_ids(10, first=10 * chunk))
            writer.flush()

    thread = threading.Thread(target=write)
    thread.start()  # it fills the ring, then waits for the reader at every chunk
    wait_for(lambda: d.stats()["rate_limiter"]["inserts_waiting"] == 1, 10, what="back-pressure")
    got: list[int] = []
    with Reader(d.name, sample_timeout=20.0) as reader:
        while len(got) < 300:
            got += reader.sample(10)["id"].tolist()
        assert reader.resamples == 0
    thread.join(20)
    assert got == list(range(300)), "rows lost, repeated or out of order"
    assert d.stats()["rate_limiter"]["insert_blocked_s"] > 0


def test_a_parked_sample_never_blocks_the_insert_that_lets_it_through(daemon: Any) -> None:
    """A FIFO sample with nothing to consume is parked first; then a reservation is parked on
    a reader's lease. Once the lease ends, the insert must go (and with it the sample): in one
    shared queue it would wait behind the parked sample until that one timed out."""
    d = daemon(capacity=10, unit="episode", args=["--sampler", "fifo", "--max-times-sampled", "1"])
    with Writer(d.name) as writer:
        for ep in range(2):  # the ring is full
            writer.add_episode(_episode(ep, 5))
    holder = Reader(d.name)
    got: dict[str, Any] = {}

    def sample() -> None:
        with Reader(d.name, sample_timeout=20.0) as late, late.sample_episodes(1) as eps:
            got["ep"] = int(eps[0]["ep"][0])
            got["at"] = time.monotonic()

    def write() -> None:
        with Writer(d.name, reserve_timeout=20.0) as late:
            late.add_episode(_episode(2, 5))
            late.flush()

    try:
        with holder.sample_episodes(2) as leased:  # consumes both; the lease pins them
            assert sorted(int(ep["ep"][0]) for ep in leased) == [0, 1]
            sampler = threading.Thread(target=sample)
            sampler.start()
            wait_for(lambda: d.stats()["rate_limiter"]["samples_waiting"] == 1, 10)
            writer_thread = threading.Thread(target=write)
            writer_thread.start()
            wait_for(lambda: d.stats()["rate_limiter"]["inserts_waiting"] == 1, 10)
            released = time.monotonic()
        writer_thread.join(10)
        sampler.join(10)
        assert not writer_thread.is_alive() and not sampler.is_alive()
        assert got["ep"] == 2 and got["at"] - released < 5.0
    finally:
        holder.close()


# -- the rate limiter ---------------------------------------------------------------------------


def test_samples_per_insert_ratio_stays_within_the_error_buffer(daemon: Any, children: Any) -> None:
    """A writer process inserting 4 rows at a time and a reader (this process) sampling 8 at
    a time as fast as each can: the limiter keeps ``inserted * R - sampled`` in its window."""
    ratio, min_size, error = 2.0, 10, 40.0
    d = daemon(
        capacity=1000,
        unit="transition",
        args=[
            "--rate-limiter",
            "sample-to-insert",
            "--samples-per-insert",
            str(ratio),
            "--min-size",
            str(min_size),
            "--error-buffer",
            str(error),
        ],
    )
    children.spawn("writer", "write_rows_steadily", d.name, 100, 4)
    sampled: list[int] = []

    def read() -> None:
        from tests.e2e._workers import sample_until_starved

        sampled.append(sample_until_starved(d.name, 8, 30.0, 1.0, say=lambda *a: None))

    reader = threading.Thread(target=read)
    reader.start()
    low, high = ratio * min_size - error, ratio * min_size + error
    seen = []
    conn = d.admin()
    try:
        while reader.is_alive():
            limiter = conn.call("stats")["stats"]["rate_limiter"]
            seen.append(limiter["inserted"] * ratio - limiter["sampled"])
            time.sleep(0.005)
        final = conn.call("stats")["stats"]["rate_limiter"]
    finally:
        conn.close()
    assert children.collect({"writer"}, timeout=30)["writer"] == 400
    assert final["inserted"] == 400 and final["sampled"] == sampled[0]
    # inserted * R - sampled never left the window [R N - E, R N + E] (a 4-row insert may
    # overshoot the upper edge by at most its own 4 R), polled about 1,000 times
    assert min(seen) >= low and max(seen) <= high + 4 * ratio, (min(seen), max(seen))
    assert abs(final["sampled"] - ratio * final["inserted"]) <= error + ratio * min_size
    assert final["insert_blocked_s"] + final["sample_blocked_s"] > 0


def test_configure_changes_the_ratio_live_and_a_parked_insert_goes_through(
    daemon: Any, e2e_env: Any, capsys: Any
) -> None:
    d = daemon(
        capacity=100,
        unit="transition",
        args=[
            "--rate-limiter",
            "sample-to-insert",
            "--samples-per-insert",
            "1",
            "--min-size",
            "1",
            "--error-buffer",
            "4",
        ],
    )
    with Writer(d.name, reserve_timeout=0.3, batch_bytes=0) as writer:
        writer.extend(_ids(5))  # (5 * 1 - 0) <= R N + E = 5
        writer.flush()
        with pytest.raises(WaitTimeoutError) as info:
            writer.extend(_ids(1, first=5))
        for word in ("sample-to-insert", "samples_per_insert=1", "inserted=5", "sampled=0"):
            assert word in str(info.value)
        writer.flush()
    # a writer parked in the daemon now, released by configure (R 0.5: 6 * 0.5 <= 4.5)
    result: dict[str, Any] = {}

    def write() -> None:
        with Writer(d.name, reserve_timeout=20.0, batch_bytes=0) as parked:
            t0 = time.monotonic()
            parked.extend(_ids(1, first=5))
            parked.flush()
            result["waited"] = time.monotonic() - t0

    thread = threading.Thread(target=write)
    thread.start()
    wait_for(lambda: d.stats()["rate_limiter"]["inserts_waiting"] == 1, 10, what="a parked insert")
    done = e2e_env.cli(
        "configure", "--name", d.name, "--samples-per-insert", "0.5", "--error-buffer", "4"
    )
    assert done.returncode == 0, done.stderr
    assert "samples_per_insert=0.5" in done.stdout
    thread.join(15)
    assert not thread.is_alive() and result["waited"] < 15
    limiter = d.stats()["rate_limiter"]
    assert limiter["settings"]["samples_per_insert"] == 0.5 and limiter["inserted"] == 6
    assert limiter["insert_blocked_s"] > 0
    assert cli.main(["status", "--name", d.name]) == 0
    status = capsys.readouterr().out
    assert "limiter     sample-to-insert" in status and "blocked: inserts" in status
    assert "sampler     uniform" in status
    # out of range: refused, nothing changed
    bad = ["configure", "--name", d.name, "--samples-per-insert", "0.5", "--error-buffer", "0.1"]
    assert cli.main(bad) == 1
    assert "--error-buffer" in capsys.readouterr().err  # named as the flag
    assert d.stats()["rate_limiter"]["settings"]["error_buffer"] == 4
    # this daemon's sampler (uniform) keeps no priorities: refused by the writer and the daemon
    with Writer(d.name) as writer, Reader(d.name) as reader:
        with pytest.raises(InvalidArgumentError, match="keeps no priorities"):
            writer.extend(_ids(2), priority=1.0)
        with pytest.raises(InvalidArgumentError, match="uniform"):
            reader.update_priorities([0], [1.0])


# -- persistence ---------------------------------------------------------------------------------


def test_priorities_survive_sigkill_resume_and_checkpoint_restore(
    daemon: Any, tmp_path: Any, capsys: Any
) -> None:
    d = _prioritized(daemon, 32)
    priority = np.arange(1, 17, dtype=np.float64)
    with Writer(d.name) as writer, Reader(d.name) as reader:
        writer.extend(_ids(16), priority=priority)
        writer.flush()
        priority[:4] = [40.0, 0.5, 0.25, 9.0]  # an update after the commit
        assert reader.update_priorities(torch.arange(4), torch.from_numpy(priority[:4])) == 4
    assert cli.main(["checkpoint", "--name", d.name, "--to", str(tmp_path)]) == 0
    expected = _expected_probability(priority)

    def check(name: str) -> None:
        with Reader(name) as reader:
            _, info = reader.sample(500, return_info=True)
            index = info["index"].numpy()
            np.testing.assert_allclose(info["probability"].numpy(), expected[index], rtol=1e-9)
            assert set(index.tolist()) <= set(range(16))

    os.kill(d.pid, signal.SIGKILL)
    d.process.wait(10)
    # the saved sampler is not the one asked for: refused, naming both
    start = ["start", "--name", d.name, "--storage-dir", str(d.storage_dir), "--resume"]
    assert cli.main([*start, "--sampler", "uniform"]) == 1
    assert "sampler: requested uniform, saved prioritized" in capsys.readouterr().err
    resumed = daemon(name=d.name, capacity=32, unit="transition", args=["--resume"])
    assert resumed.stats()["sampler"]["settings"]["priority_exponent"] == ALPHA
    check(resumed.name)
    resumed.stop()
    restored = daemon(
        name=d.name, capacity=32, unit="transition", args=["--restore", str(tmp_path)]
    )
    check(restored.name)


# -- bad input -----------------------------------------------------------------------------------


def test_bad_input_gets_a_clear_error_and_changes_nothing(
    daemon: Any, e2e_env: Any, capsys: Any
) -> None:
    d = _prioritized(daemon, 16)
    with Writer(d.name) as writer, Reader(d.name) as reader:
        writer.extend(_ids(8), priority=2.0)
        writer.flush()
        before = reader.stats()["sampler"]["figures"]["priority_total"]
        for index, priority, words in [
            ([0, 1], [1.0, -1.0], ["priority[1]", "-1.0", ">= 0"]),
            ([0, 1], [1.0, math.nan], ["priority[1]", "nan"]),
            ([0, 1], [1.0, 2.0, 3.0], ["priority", "2 values"]),
            ([0, 99], [1.0, 1.0], ["index 99", "capacity 16"]),
        ]:
            with pytest.raises(InvalidArgumentError) as info:
                reader.update_priorities(index, priority)
            for word in words:
                assert word in str(info.value), (word, str(info.value))
        # the daemon checks again what a client did not (here: sent raw)
        for fields, words in [
            ({"index": encode_i64([3]), "priority": encode_f64([math.nan])}, ["priority[0]"]),
            ({"index": encode_i64([-1]), "priority": encode_f64([1.0])}, ["index -1"]),
        ]:
            with pytest.raises(InvalidArgumentError) as info:
                reader.conn.call("update_priorities", **fields)
            for word in words:
                assert word in str(info.value)
        with pytest.raises(ProtocolError, match="'priority'"):
            reader.conn.call(
                "update_priorities", index=encode_i64([1, 2]), priority=encode_f64([1])
            )
        with pytest.raises(InvalidArgumentError, match="beta"):
            reader.sample(4, beta=-1.0)
        for priority in ([1.0] * 3, -1.0, [1.0, 1.0, math.inf, 1.0]):
            with pytest.raises(InvalidArgumentError, match="priority"):
                writer.extend(_ids(4, first=50), priority=priority)
        with pytest.raises(InvalidArgumentError, match="priority"):  # raw: refused at reserve
            writer.conn.call("reserve", rows=2, priority=encode_f64([1.0, -2.0]))
        writer.flush()
        stats = reader.stats()
        assert stats["rows"] == 8 and stats["reservations"] == 0
        assert stats["sampler"]["figures"]["priority_total"] == before
        assert stats["priority_updates"] == 0

    # sampler and limiter options that do not fit: refused at start, before anything exists
    out = e2e_env.cli("start", "--name", "bad", "--sampler", "fifo", "--priority-exponent", "1")
    assert out.returncode == 1 and "--priority-exponent" in out.stderr and "fifo" in out.stderr
    for args, words in [
        (["--sampler", "prioritized", "--priority-exponent", "-1"], ["--priority-exponent"]),
        (["--rate-limiter", "sample-to-insert"], ["--samples-per-insert", "--error-buffer"]),
        (
            [
                "--rate-limiter",
                "sample-to-insert",
                "--samples-per-insert",
                "4",
                "--error-buffer",
                "1",
            ],
            ["--error-buffer", ">= max(1, --samples-per-insert)"],
        ),
        (["--min-size", "3"], ["'none'", "--min-size"]),
        (["--max-times-sampled", "0"], ["--max-times-sampled", ">= 1"]),
    ]:
        assert cli.main(["start", "--name", "bad", "--storage-dir", str(d.storage_dir), *args]) == 1
        err = capsys.readouterr().err
        for word in words:
            assert word in err, (word, err)
    assert not e2e_env.runtime_file("bad").exists() and not (d.storage_dir / "bad").exists()


# -- remote -------------------------------------------------------------------------------------


def test_a_remote_tcp_reader_and_writer_get_the_same(daemon: Any) -> None:
    d = daemon(
        capacity=64,
        unit="transition",
        args=["--endpoint", "tcp://127.0.0.1:0", "--sampler", "prioritized", "--seed", "1"],
    )
    with Writer(d.endpoint, remote=True) as writer:
        writer.extend(_ids(10), priority=np.full(10, 2.0))
        writer.extend({"id": torch.arange(10, 13)})  # the largest seen so far: 2.0
        writer.flush()
    with Reader(d.endpoint, remote=True) as reader:
        assert reader.remote
        batch, info = reader.sample(200, return_info=True)
        assert (batch["id"] == info["index"]).all()
        np.testing.assert_allclose(info["probability"].numpy(), 1 / 13)
        assert reader.update_priorities(info["index"][:1], 0.0, info["generation"][:1]) == 1
        padded = reader.sample_slices(20, 16, strict=False)
        assert padded["mask"].shape == (20, 16) and (padded["mask"].sum(dim=1) <= 13).all()
        assert ((padded["id"] == 0) | padded["mask"]).all()
        rows = [
            r
            for rank in (0, 1)
            for part in reader.iterate(4, rank=rank, world_size=2, drop_last=False)
            for r in part["id"].tolist()
        ]
        assert sorted(set(rows)) == list(range(13)) and len(rows) == 14  # one padded repeat


def test_sampler_and_limiter_settings_from_a_toml_file(tmp_path: Any) -> None:
    """The TOML keys are the flags' names with underscores; the same checks apply."""
    from shmbuffer.daemon.config import DaemonConfig
    from shmbuffer.errors import ConfigError

    good = tmp_path / "good.toml"
    good.write_text(
        'sampler = "prioritized"\npriority_exponent = 0.5\nseed = 3\n'
        'rate_limiter = "sample-to-insert"\nsamples_per_insert = 4\nerror_buffer = 8\n'
    )
    config = DaemonConfig.load(good, importance_exponent=0.9)  # a flag over the file
    sampler, limiter = config.make_sampler(), config.make_rate_limiter()
    assert sampler.settings()["priority_exponent"] == 0.5
    assert sampler.settings()["importance_exponent"] == 0.9
    assert limiter.settings() == {"samples_per_insert": 4.0, "min_size": 1, "error_buffer": 8.0}
    for text, words in [
        ('sampler = "fifo"\npriority_eps = 0.1\n', ["--priority-eps", "fifo"]),
        ('sampler = "prioritized"\npriority_exponent = "high"\n', ["--priority-exponent"]),
        ('rate_limiter = "min-size"\nmin_size = 2.5\n', ["--min-size", "integer"]),
        ('sampler = "no-such-sampler"\n', ["--sampler", "'no-such-sampler'", "fifo"]),
    ]:
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        with pytest.raises(ConfigError) as info:
            DaemonConfig.load(bad)
        for word in words:
            assert word in str(info.value), (word, str(info.value))
