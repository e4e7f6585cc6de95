"""Rate limiters: Reverb's window in rows, min size, progress for large requests, live changes."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from shmbuffer.samplers import (
    MinSize,
    NoLimit,
    SampleToInsertRatio,
    make_rate_limiter,
)


def test_window_formulas() -> None:
    lim = SampleToInsertRatio(samples_per_insert=2.0, min_size=10, error_buffer=8.0)
    assert (lim.min_diff, lim.max_diff) == (12.0, 28.0)  # R*N -+ E
    assert not lim.can_sample(1)  # nothing samples before N rows exist
    assert lim.can_insert(1000)  # ... so inserts are never held back below N
    lim.on_insert(10)
    assert lim.diff == 20.0
    assert lim.can_sample(8)  # 20 - 8 >= 12
    assert not lim.can_sample(9)
    assert lim.can_insert(4)  # (10 + 4) * 2 - 0 <= 28
    lim.on_sample(8)
    assert lim.diff == 12.0 and not lim.can_sample(1)
    assert lim.can_insert(8)  # 18 * 2 - 8 = 28
    lim.on_insert(8)
    assert not lim.can_insert(1)  # 19 * 2 - 8 = 30 > 28, and samples can proceed
    assert lim.can_sample(16)


def test_min_size_counts_stored_rows() -> None:
    lim = SampleToInsertRatio(samples_per_insert=1.0, min_size=5, error_buffer=3.0)
    lim.on_insert(6)
    assert lim.can_sample(1)
    lim.on_delete(2)  # evicted rows: size 4 < 5
    assert lim.size == 4 and not lim.can_sample(1) and lim.can_insert(100)
    ms = MinSize(min_size=3)
    assert not ms.can_sample(1) and ms.can_insert(10**9)
    ms.on_insert(3)
    assert ms.can_sample(10**6)
    ms.on_delete(1)
    assert not ms.can_sample(1)
    none = NoLimit()
    assert none.can_sample(10) and none.can_insert(10)


def test_large_insert_makes_progress_at_the_lower_edge() -> None:
    lim = SampleToInsertRatio(samples_per_insert=1.0, min_size=0, error_buffer=4.0)
    assert not lim.can_insert(100)  # bigger than the window, and samples may still go
    while lim.can_sample(1):
        lim.on_sample(1)
    assert lim.diff == lim.min_diff  # samplers are starved: now the insert must go
    assert lim.can_insert(100)
    lim.on_insert(100)
    assert lim.can_sample(50)


def test_large_sample_makes_progress() -> None:
    lim = SampleToInsertRatio(samples_per_insert=1.0, min_size=0, error_buffer=4.0)
    lim.on_insert(4)
    assert not lim.can_insert(1)  # (4 + 1) * 1 - 0 > 4: the window is full
    assert not lim.can_sample(32)  # larger than the window; the limiter remembers the ask
    while not lim.can_sample(32):
        assert lim.can_insert(1)  # diff < R*N - E + 32: the sample waits on inserts
        lim.on_insert(1)
    assert lim.diff == lim.min_diff + 32


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_writer_and_reader_never_deadlock(seed: int) -> None:
    rng = np.random.default_rng(seed)
    ratio, min_size, error = 4.0, 50, 40.0
    lim = SampleToInsertRatio(samples_per_insert=ratio, min_size=min_size, error_buffer=error)
    largest_insert = 64
    for _ in range(2000):
        n_ins = int(rng.integers(1, largest_insert + 1))
        n_smp = int(rng.integers(1, 33))
        ins, smp = lim.can_insert(n_ins), lim.can_sample(n_smp)
        assert ins or smp, lim.blocked_reason()
        if smp and (not ins or rng.random() < 0.5):
            lim.on_sample(n_smp)
        else:
            lim.on_insert(n_ins)
        if lim.size >= min_size:
            assert lim.diff >= lim.min_diff - largest_insert * ratio
            assert lim.diff <= lim.max_diff + largest_insert * ratio
    observed = lim.sampled / lim.inserted
    assert abs(observed - ratio) * lim.inserted <= ratio * min_size + error + 64 * ratio


def test_configure_live_and_validation() -> None:
    lim = SampleToInsertRatio(samples_per_insert=1.0, min_size=10, error_buffer=5.0)
    lim.on_insert(20)
    lim.configure(samples_per_insert=2.0, error_buffer=10.0)
    assert lim.settings() == {"samples_per_insert": 2.0, "min_size": 10, "error_buffer": 10.0}
    assert lim.inserted == 20  # counts are kept
    for bad, match in [
        ({"samples_per_insert": 0}, "samples_per_insert"),
        ({"samples_per_insert": float("nan")}, "samples_per_insert"),
        ({"error_buffer": 1.5}, "error_buffer"),  # < max(1, R=2)
        ({"min_size": -1}, "min_size"),
        ({"ratio": 2}, "no option"),
    ]:
        with pytest.raises(ValueError, match=match):
            lim.configure(**bad)
        assert lim.settings()["samples_per_insert"] == 2.0  # nothing changed
    with pytest.raises(ValueError, match="error_buffer"):
        SampleToInsertRatio(samples_per_insert=0.5, min_size=1, error_buffer=0.5)  # < 1
    with pytest.raises(ValueError, match="no option"):
        NoLimit().configure(min_size=3)
    ms = MinSize(min_size=3)
    ms.configure(min_size=7)
    assert ms.min_size == 7
    with pytest.raises(TypeError):
        MinSize(min_size=True)


def test_blocked_reason_state_and_stats() -> None:
    lim = SampleToInsertRatio(samples_per_insert=2.0, min_size=4, error_buffer=2.0)
    lim.on_insert(5)
    lim.on_sample(3)
    lim.record_blocked("insert", 0.25)
    lim.record_blocked("sample", 1.5)
    reason = lim.blocked_reason()
    for part in ("sample-to-insert", "inserted=5", "sampled=3", "samples_per_insert=2.0"):
        assert part in reason
    stats = lim.stats()
    assert stats["insert_blocked_s"] == 0.25 and stats["sample_blocked_s"] == 1.5
    assert stats["limiter"] == "sample-to-insert" and stats["size"] == 5
    state = msgpack.unpackb(msgpack.packb(lim.state_dict()))
    copy = SampleToInsertRatio(samples_per_insert=2.0, min_size=4, error_buffer=2.0)
    copy.load_state_dict(state)
    assert copy.state_dict() == lim.state_dict()
    with pytest.raises(ValueError, match="limiter state"):
        MinSize(min_size=1).load_state_dict(state)
    with pytest.raises(ValueError, match="kind"):
        lim.record_blocked("read", 1.0)


def test_make_rate_limiter() -> None:
    assert isinstance(make_rate_limiter("none"), NoLimit)
    assert make_rate_limiter("min-size", min_size=5).min_size == 5  # type: ignore[attr-defined]
    lim = make_rate_limiter("sample-to-insert", samples_per_insert=1, min_size=1, error_buffer=2)
    assert isinstance(lim, SampleToInsertRatio)
    with pytest.raises(ValueError, match="expected one of"):
        make_rate_limiter("token-bucket")
    with pytest.raises(ValueError, match="sample-to-insert"):
        make_rate_limiter("sample-to-insert", samples_per_insert=1)  # missing options
