"""The two ways a uniform row draw runs (shmbuffer.registry.spans and _draw_jit): numpy and the
loop give the same rows from the same words, both are uniform, and a process switches to the
compiled loop only after :data:`~shmbuffer.registry.spans.LOAD_AFTER` draws."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmbuffer import jit
from shmbuffer.registry import spans
from shmbuffer.registry.intervals import EpisodeRegistry
from shmbuffer.ring.container import Container
from tests._stats import P_MIN, chi2_p

# The kernel module itself: loading it through spans would switch the whole test process
# to the compiled draws from collection on.
KERNELS = jit.load("shmbuffer.registry._draw_jit")
needs_numba = pytest.mark.skipif(KERNELS is None, reason="numba (the fast extra) not installed")


@pytest.fixture(params=["numpy", "compiled"])
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Draws in this test go one way only."""
    if request.param == "compiled" and KERNELS is None:
        pytest.skip("numba (the fast extra) not installed")
    monkeypatch.setattr(spans._Draws, "kernels", KERNELS if request.param == "compiled" else None)
    monkeypatch.setattr(spans._Draws, "tried", True)
    yield request.param


def ring_with_holes() -> EpisodeRegistry:
    """Live rows in four spans of unequal length: [0, 7), [10, 30), [31, 32), [40, 100)."""
    reg = EpisodeRegistry(100)
    for start, end in [(0, 3), (3, 7), (10, 30), (31, 32), (40, 70), (70, 100)]:
        reg.add(start, end)
    return reg


def _call(
    words: np.ndarray, high: int, ends: np.ndarray, shift: np.ndarray
) -> tuple[int, np.ndarray]:
    assert KERNELS is not None
    out = np.empty(words.size, dtype=np.int64)
    return KERNELS.span_rows(words, high, ends, shift, out), out


@needs_numba
@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    high=st.one_of(
        st.integers(1, 5_000), st.integers(1, (1 << 62)), st.sampled_from([1, 2, 3, 1 << 40])
    ),
    n=st.integers(1, 300),
)
def test_the_compiled_loop_gives_the_rows_numpy_gives(seed: int, high: int, n: int) -> None:
    words = np.random.default_rng(seed).bit_generator.random_raw(n)
    words[0] = (1 << 64) // high * high - 1  # the largest word kept
    words[-1] = (1 << 64) - 1  # kept only when high divides 2**64
    spans.redraw_rejected(np.random.default_rng(seed + 1), words, high)
    # Three spans splitting [0, high) and moved apart: both map positions the same way too.
    cut = sorted({0, high // 3, (2 * high) // 3, high} - {0})
    ends = np.array(cut, dtype=np.int64)
    shift = np.arange(len(cut), dtype=np.int64) * 1000
    stop, out = _call(words, high, ends, shift)
    assert stop == -1
    pos = (words % np.uint64(high)).astype(np.int64)
    assert pos.tolist() == [int(w) % high for w in words]
    assert np.array_equal(out, pos + shift[np.searchsorted(ends, pos, side="right")])


@needs_numba
def test_the_compiled_loop_stops_at_a_rejected_word() -> None:
    # 2**64 mod 3 == 1: only the word 2**64 - 1 lies past the last multiple of 3.
    words = np.array([5, (1 << 64) - 1, 7], dtype=np.uint64)
    one = np.zeros(1, dtype=np.int64)
    assert _call(words, 3, one + 3, one)[0] == 1
    spans.redraw_rejected(np.random.default_rng(0), words, 3)
    assert words[0] == 5 and words[1] != (1 << 64) - 1 and words[2] == 7


def test_a_seeded_draw_is_the_same_either_way(monkeypatch: pytest.MonkeyPatch) -> None:
    reg = ring_with_holes()
    monkeypatch.setattr(spans._Draws, "tried", True)
    monkeypatch.setattr(spans._Draws, "kernels", None)
    by_numpy = [reg.sample_rows(n, np.random.default_rng(7)) for n in (1, 256, 5_000)]
    if KERNELS is None:
        pytest.skip("numba (the fast extra) not installed")
    monkeypatch.setattr(spans._Draws, "kernels", KERNELS)
    by_loop = [reg.sample_rows(n, np.random.default_rng(7)) for n in (1, 256, 5_000)]
    for a, b in zip(by_numpy, by_loop, strict=True):
        assert np.array_equal(a, b)


def test_rows_are_uniform_over_the_live_rows(way: str) -> None:
    reg = ring_with_holes()
    live = np.concatenate([np.arange(0, 7), np.arange(10, 32), np.arange(40, 100)])
    live = live[live != 30]
    rows = np.concatenate([reg.sample_rows(256, np.random.default_rng(s)) for s in range(200)])
    assert np.isin(rows, live).all()
    counts = np.bincount(rows, minlength=100)[live]
    assert chi2_p(counts, np.full(live.size, rows.size / live.size)) > P_MIN


def test_use_counts_count_repeats_and_refuse_rows_out_of_range(way: str) -> None:
    container = Container(10, unit="transition")
    container.commit(container.reserve_rows(10, [10]).id)
    before = container.use_counts.copy()
    container.count_use(np.array([3, 3, 0, 9], dtype=np.int64))
    assert (container.use_counts - before).tolist() == [1, 0, 0, 2, 0, 0, 0, 0, 0, 1]
    container.count_use(np.array([1, 1], dtype=np.int32))  # another dtype: numpy's scatter
    assert container.use_counts[1] - before[1] == 2
    with pytest.raises(IndexError):
        container.count_use(np.array([2, 10], dtype=np.int64))


def test_a_process_loads_the_loop_only_after_many_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spans, "LOAD_AFTER", 300)
    monkeypatch.setattr(spans._Draws, "kernels", None)
    monkeypatch.setattr(spans._Draws, "tried", False)
    monkeypatch.setattr(spans._Draws, "calls", 0)
    reg = ring_with_holes()
    for _ in range(spans.LOAD_AFTER - 1):
        reg.sample_rows(2, np.random.default_rng(0))
    assert spans._Draws.kernels is None and not spans._Draws.tried
    reg.sample_rows(2, np.random.default_rng(0))
    assert spans._Draws.tried and spans._Draws.kernels is KERNELS


def test_shmbuffer_jit_0_keeps_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHMBUFFER_JIT", "0")
    monkeypatch.setattr(spans._Draws, "kernels", None)
    monkeypatch.setattr(spans._Draws, "tried", False)
    assert spans.load_compiled_draws() is None
    assert spans.compiled_draws() is None


def test_a_server_loads_the_loop_on_a_thread_and_draws_on_meanwhile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(spans._Draws, "kernels", None)
    monkeypatch.setattr(spans._Draws, "tried", False)
    monkeypatch.setattr(spans._Draws, "calls", spans.LOAD_AFTER - 1)
    monkeypatch.setattr(spans._Draws, "on_a_thread", False)
    spans.load_on_a_thread()
    reg = ring_with_holes()
    expected = reg.sample_rows(64, np.random.default_rng(3))  # the draw that starts the thread
    assert spans._Draws.tried
    deadline = time.monotonic() + 60
    while spans._Draws.kernels is None and KERNELS is not None and time.monotonic() < deadline:
        assert np.array_equal(reg.sample_rows(64, np.random.default_rng(3)), expected)
        time.sleep(0.01)
    assert spans._Draws.kernels is KERNELS
    assert np.array_equal(reg.sample_rows(64, np.random.default_rng(3)), expected)
