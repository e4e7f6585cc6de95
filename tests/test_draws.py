"""The two ways a uniform row draw runs (shmbuffer.spans and _draw_jit): numpy and the compiled
loop give the same rows from the same words, both are uniform, and a process switches to the
compiled loop only after :data:`~shmbuffer.spans.LOAD_AFTER` draws."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmbuffer import spans
from shmbuffer.container import Container
from shmbuffer.registry import EpisodeRegistry
from tests._stats import P_MIN, chi2_p

KERNELS = spans.load_compiled_draws()
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


def test_multiply_high_matches_python_integers() -> None:
    words = np.random.default_rng(0).bit_generator.random_raw(2_000)
    words[:4] = [0, 1, (1 << 64) - 1, 1 << 63]
    for high in [1, 2, 3, 1000, (1 << 32) - 1, 1 << 32, (1 << 32) + 1, (1 << 40) + 3, 1 << 62]:
        expected = [(int(w) * high) >> 64 for w in words]
        assert spans.multiply_high(words, high).tolist() == expected, high


@needs_numba
@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    high=st.one_of(st.integers(1, 5_000), st.integers(1, (1 << 62))),
    n=st.integers(1, 300),
)
def test_the_compiled_loop_gives_the_rows_numpy_gives(seed: int, high: int, n: int) -> None:
    assert KERNELS is not None
    words = np.random.default_rng(seed).bit_generator.random_raw(n)
    spans.redraw_rejected(np.random.default_rng(seed + 1), words, high)
    # Three spans splitting [0, high) and moved apart: both map positions the same way too.
    cut = sorted({0, high // 3, (2 * high) // 3, high} - {0})
    ends = np.array(cut, dtype=np.int64)
    shift = np.arange(len(cut), dtype=np.int64) * 1000
    out = np.empty(n, dtype=np.int64)
    assert KERNELS.span_rows(words, high, ends, shift, out) == -1
    pos = spans.multiply_high(words, high)
    assert np.array_equal(out, pos + shift[np.searchsorted(ends, pos, side="right")])


@needs_numba
def test_the_compiled_loop_stops_at_a_rejected_word() -> None:
    # 2**64 mod 3 == 1: the word 0 has a product of 0, under it, and is drawn again.
    assert KERNELS is not None
    words = np.array([5, 0, 7], dtype=np.uint64)
    one = np.zeros(1, dtype=np.int64)
    assert KERNELS.span_rows(words, 3, one + 3, one, np.empty(3, dtype=np.int64)) == 1
    spans.redraw_rejected(np.random.default_rng(0), words, 3)
    assert words[0] == 5 and words[1] != 0 and words[2] == 7


def test_a_rejected_word_mid_batch_is_drawn_again_the_same_either_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A generator whose third raw word is rejected for 3 live rows (2**64 mod 3 == 1: only
    # the word 0 is): both ways draw it again, in place, and give the same rows.
    class Words(np.random.PCG64):
        def random_raw(self, size: int | None = None, output: bool = True) -> np.ndarray:
            drawn = np.asarray(super().random_raw(size))
            self.calls = getattr(self, "calls", 0) + 1
            if self.calls == 1:
                drawn[2] = 0
            return drawn

    reg = EpisodeRegistry(10)
    reg.add(4, 7)
    got = []
    for kernels in [None, KERNELS] if KERNELS is not None else [None]:
        monkeypatch.setattr(spans._Draws, "kernels", kernels)
        monkeypatch.setattr(spans._Draws, "tried", True)
        words = Words(5)
        rows = reg.sample_rows(6, np.random.Generator(words))
        assert words.calls == 2  # the rejected word was drawn again
        assert set(rows.tolist()) <= {4, 5, 6}
        got.append(rows)
    assert all(np.array_equal(got[0], rows) for rows in got)


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
    container.commit(container.reserve(10, [10]).id)
    before = container.use_counts.copy()
    container.count_use(np.array([3, 3, 0, 9], dtype=np.int64))
    assert (container.use_counts - before).tolist() == [1, 0, 0, 2, 0, 0, 0, 0, 0, 1]
    container.count_use(np.array([1, 1], dtype=np.int32))  # another dtype: numpy's scatter
    assert container.use_counts[1] - before[1] == 2
    with pytest.raises(IndexError):
        container.count_use(np.array([2, 10], dtype=np.int64))


def test_a_process_loads_the_loop_only_after_many_draws(monkeypatch: pytest.MonkeyPatch) -> None:
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
