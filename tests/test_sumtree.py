"""SumTree and MinTree against a plain numpy model: batch updates, prefix sums, searches.

``top=`` shrinks the top level so that small trees get the 16-ary levels a large buffer has
(``top=1``: 16-ary all the way up). Every test runs twice: with the numpy loops and with the
compiled kernels (``_jit.py``; skipped where numba, the ``fast`` extra, is not installed).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmbuffer.samplers import sumtree
from shmbuffer.samplers.sumtree import (
    FANOUT,
    TOP,
    MinTree,
    PositiveMinTree,
    SumTree,
    assign_pair,
    update_pair,
)

COMPILED = sumtree.jit_available()


@pytest.fixture(scope="module", autouse=True, params=["numpy", "compiled"])
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Which loops ``SumTree(jit=None)`` gets in this module's tests (module scope: one
    switch per backend, and hypothesis's tests may use it)."""
    if request.param == "compiled" and COMPILED is None:
        pytest.skip("numba (the fast extra) is not installed")
    found = sumtree.jit_available
    setattr(sumtree, "jit_available", (lambda: None) if request.param == "numpy" else found)  # noqa: B010
    yield str(request.param)
    setattr(sumtree, "jit_available", found)  # noqa: B010


def model_find(leaves: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The leaf j with cumsum[j-1] <= v < cumsum[j], by a linear model."""
    cum = np.cumsum(leaves)
    return np.searchsorted(cum, values, side="right")


@pytest.mark.parametrize("capacity", [1, 2, 3, 7, 8, 9, 1000])
def test_shapes_and_neutral_values(capacity: int) -> None:
    s, m = SumTree(capacity), MinTree(capacity)
    assert s.size >= capacity and s.size & (s.size - 1) == 0
    assert s.total == 0.0 and m.min == np.inf
    assert s.leaves.shape == (capacity,)
    with pytest.raises(ValueError):
        s.leaves[0] = 1.0  # read-only view


def test_capacity_and_index_validation() -> None:
    with pytest.raises(ValueError, match="capacity"):
        SumTree(0)
    s = SumTree(10)
    with pytest.raises(IndexError):
        s.update([10], [1.0])
    with pytest.raises(IndexError):
        s.update([-1], [1.0])
    with pytest.raises(TypeError):
        s.update(np.array([1.5]), [1.0])
    with pytest.raises(IndexError):
        s.prefix_sum([11])
    with pytest.raises(ValueError, match="leaf values"):
        s.fill(np.ones(9))


def test_update_duplicates_last_write_wins() -> None:
    s, m = SumTree(16), MinTree(16)
    s.update([3, 5, 3, 3], [1.0, 2.0, 7.0, 4.0])
    m.update([3, 5, 3, 3], [1.0, 2.0, 7.0, 4.0])
    assert s.get([3, 5]).tolist() == [4.0, 2.0]
    assert s.total == 6.0 and m.min == 2.0
    s.update([3], [0.0])
    assert s.total == 2.0


def test_fill_matches_updates() -> None:
    rng = np.random.default_rng(1)
    leaves = rng.random(37)
    a, b = SumTree(37), SumTree(37)
    a.fill(leaves)
    b.update(np.arange(37), leaves)
    assert a.total == pytest.approx(b.total, rel=1e-12)
    assert np.array_equal(a.find_prefix_sum([0.5, 3.3]), b.find_prefix_sum([0.5, 3.3]))
    mn = MinTree(37)
    mn.fill(leaves)
    assert mn.min == leaves.min()


def test_find_never_returns_an_empty_leaf() -> None:
    s = SumTree(8)
    s.update([2, 5], [1.0, 3.0])
    # On a boundary, at the total and beyond it: always a positive leaf.
    got = s.find_prefix_sum([0.0, 1.0, 3.999999, 4.0, 10.0, -1.0])
    assert got.tolist() == [2, 5, 5, 5, 5, 2]
    rng = np.random.default_rng(0)
    assert set(s.sample(1000, rng).tolist()) == {2, 5}


def test_sample_frequencies() -> None:
    s = SumTree(5)
    s.update(np.arange(5), [1.0, 0.0, 2.0, 3.0, 4.0])
    counts = np.bincount(s.sample(100_000, np.random.default_rng(3)), minlength=5)
    assert counts[1] == 0
    assert np.allclose(counts / 100_000, np.array([1, 0, 2, 3, 4]) / 10, atol=0.01)


@settings(max_examples=60, deadline=None)
@given(
    top=st.sampled_from([1, 2, 16, TOP]),
    capacity=st.integers(1, 70),
    batches=st.lists(
        st.lists(
            st.tuples(st.integers(0, 69), st.floats(0, 100, allow_nan=False)),
            min_size=1,
            max_size=20,
        ),
        min_size=1,
        max_size=5,
    ),
    fractions=st.lists(st.floats(0, 1, exclude_max=True), min_size=1, max_size=10),
)
def test_against_model(
    top: int, capacity: int, batches: list[list[tuple[int, float]]], fractions: list[float]
) -> None:
    s, m = SumTree(capacity, top=top), MinTree(capacity, top=top)
    model = np.zeros(capacity)
    for batch in batches:
        idx = np.array([i % capacity for i, _ in batch], dtype=np.int64)
        vals = np.array([v for _, v in batch])
        for i, v in zip(idx, vals, strict=True):  # sequential writes: the last one wins
            model[i] = v
        s.update(idx, vals)
        m.update(idx, np.where(vals > 0, vals, np.inf))
        assert np.array_equal(s.leaves, model)
        assert s.total == pytest.approx(model.sum(), rel=1e-9, abs=1e-9)
        positive = model[model > 0]
        assert m.min == (positive.min() if positive.size else np.inf)
    ends = np.arange(capacity + 1)
    assert np.allclose(s.prefix_sum(ends), np.concatenate([[0.0], np.cumsum(model)]))
    if model.sum() > 0:
        values = np.array(fractions) * s.total
        got = s.find_prefix_sum(values)
        assert np.all(model[got] > 0)
        want = model_find(model, values)
        # Equal unless a value sits within rounding of a boundary.
        cum = np.cumsum(model)
        near = np.isclose(values[:, None], cum[None, :], rtol=1e-9, atol=1e-9).any(axis=1)
        assert np.array_equal(got[~near], want[~near])


def test_range_sum() -> None:
    s = SumTree(10)
    s.fill(np.arange(10, dtype=np.float64))
    assert s.range_sum([0, 2, 9], [10, 5, 10]).tolist() == [45.0, 9.0, 9.0]


@pytest.mark.parametrize(
    ("capacity", "top", "depth"),
    [
        (8, TOP, 0),
        (TOP, TOP, 0),
        (TOP + 1, TOP, 1),
        (300, 1, 2),
        (5000, 1, 3),
        (5000, 16, 3),
        (5000, 512, 1),
    ],
)
def test_levels(capacity: int, top: int, depth: int) -> None:
    s = SumTree(capacity, top=top)
    assert s.depth == depth
    assert [len(level) for level in s.levels] == [s.size // FANOUT**i for i in range(depth + 1)]
    assert len(s.levels[-1]) <= top or len(s.levels[-1]) < FANOUT


def brute_find(leaves: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The reference: a running sum and a binary search, then the last positive leaf at or
    before the one found (where rounding or ``v >= total`` lands past the weight)."""
    cum = np.cumsum(leaves)
    got = np.minimum(np.searchsorted(cum, values, side="right"), leaves.size - 1)
    positive = np.flatnonzero(leaves > 0)
    for i, j in enumerate(got):
        if leaves[j] <= 0:
            before = positive[positive <= j]
            got[i] = before[-1] if before.size else positive[0]
    return got


@settings(max_examples=80, deadline=None)
@given(
    top=st.sampled_from([1, 4, 64]),
    capacity=st.integers(1, 3000),
    seed=st.integers(0, 2**32 - 1),
    zeros=st.floats(0, 0.95),
    rounds=st.integers(1, 4),
)
def test_deep_trees_match_cumsum_searchsorted(
    top: int, capacity: int, seed: int, zeros: float, rounds: int
) -> None:
    """Random sparse, dense and repeated updates (many leaves empty), then every query of a
    batch against the brute-force running sum: same leaf unless within rounding of a
    boundary, and never an empty one; prefix sums, totals and minima likewise."""
    rng = np.random.default_rng(seed)
    s, m = SumTree(capacity, top=top), MinTree(capacity, top=top)
    positive = PositiveMinTree(s)
    model = np.zeros(capacity)
    for _ in range(rounds):
        kind = rng.integers(3)
        if kind == 0:  # sparse, with repeats: the last write wins
            idx = rng.integers(0, capacity, size=rng.integers(1, 600))
        elif kind == 1:  # one dense run (a commit or an eviction)
            lo = int(rng.integers(0, capacity))
            idx = np.arange(lo, int(rng.integers(lo, capacity)) + 1)
        else:
            idx = rng.permutation(capacity)[: rng.integers(1, capacity + 1)]
        vals = rng.uniform(0, 10, idx.size) * (rng.random(idx.size) >= zeros)
        for i, v in zip(idx.tolist(), vals.tolist(), strict=True):
            model[i] = v
        s.update(idx, vals)
        positive.refresh(idx)
        m.update(idx, np.where(vals > 0, vals, np.inf))
    assert np.array_equal(s.leaves, model)
    assert s.total == pytest.approx(model.sum(), rel=1e-12, abs=1e-12)
    assert m.min == (model[model > 0].min() if (model > 0).any() else np.inf)
    assert positive.min == m.min
    ends = rng.integers(0, capacity + 1, size=50)
    assert np.allclose(s.prefix_sum(ends), np.concatenate([[0.0], np.cumsum(model)])[ends])
    if model.sum() == 0:
        return
    cum = np.cumsum(model)
    values = np.concatenate([rng.random(400) * s.total, cum[:20], [s.total, s.total * 2]])
    got = s.find_prefix_sum(values)
    assert np.all(model[got] > 0)
    near = np.isclose(values[:, None], cum[None, :], rtol=1e-12, atol=1e-12).any(axis=1)
    assert np.array_equal(got[~near], brute_find(model, values)[~near])
    keys, weights = s.draw(500, rng)
    assert np.all(model[keys] > 0) and np.array_equal(weights, model[keys])


def test_draw_frequencies_in_a_deep_tree() -> None:
    rng = np.random.default_rng(5)
    weights = rng.uniform(0, 1, 200) * (rng.random(200) < 0.5)
    s = SumTree(200, top=1)
    s.fill(weights)
    counts = np.bincount(s.sample(400_000, rng), minlength=200)
    assert counts[weights == 0].sum() == 0
    assert np.allclose(counts / counts.sum(), weights / weights.sum(), atol=0.002)


@pytest.mark.parametrize("top", [16, TOP])
def test_update_pair_equals_two_updates(top: int) -> None:
    """A PositiveMinTree over a SumTree, updated together, equals a SumTree and a MinTree of
    the positive leaves (zeros as +inf) updated apart, level by level."""
    rng = np.random.default_rng(2)
    sums = SumTree(5000, top=top)
    mins = PositiveMinTree(sums)
    ref_sums, ref_mins = SumTree(5000, top=top), MinTree(5000, top=top)
    assert mins.min == np.inf
    for size in (3, 200, 700, 5000):  # over the dense check: the fallback path
        idx = np.unique(rng.integers(0, 5000, size))
        vals = rng.uniform(0.1, 2, idx.size) * (rng.random(idx.size) < 0.8)
        update_pair(sums, mins, idx, vals)
        ref_sums.update_unique(idx, vals)
        ref_mins.update_unique(idx, np.where(vals > 0, vals, np.inf))
        # A compiled tree adds 16 children in order, BLAS in an order of its own: sums agree
        # to rounding, minima exactly.
        for p, q in zip(sums.levels[1:], ref_sums.levels[1:], strict=True):
            assert np.allclose(p, q, rtol=1e-13, atol=0)
        for p, q in zip(mins.levels[1:], ref_mins.levels[1:], strict=True):
            assert np.array_equal(p, q)
        assert sums.total == pytest.approx(ref_sums.total, rel=1e-13)
        assert mins.min == ref_mins.min
    sums.clear()
    mins.clear()
    assert mins.min == np.inf
    sums.fill(np.where(np.arange(5000) == 7, 0.5, 0.0))
    mins.rebuild()
    assert mins.min == 0.5
    with pytest.raises(TypeError):
        mins.update_unique(np.array([1]), np.array([1.0]))
    with pytest.raises(ValueError, match="very SumTree"):
        update_pair(SumTree(5000, top=top), mins, idx, vals)


def test_many_queries_go_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sumtree, "_CHUNK", 7)
    s = SumTree(100, top=1)
    s.fill(np.arange(100, dtype=np.float64))
    values = np.linspace(0, s.total, 50, endpoint=False)
    assert np.array_equal(s.find_prefix_sum(values), brute_find(s.leaves.copy(), values))


def test_clear_and_nan_queries() -> None:
    s = SumTree(40, top=1)
    s.fill(np.ones(40))
    assert s.find_prefix_sum([np.nan]).tolist() == [0]  # NaN counts as 0
    s.clear()
    assert s.total == 0.0 and not s.leaves.any()


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(1, 5000),
    seed=st.integers(0, 2**32 - 1),
    rounds=st.integers(1, 6),
    batch=st.sampled_from([1, 7, 256, 600]),
)
def test_assign_pair_equals_writes_in_order(
    capacity: int, seed: int, rounds: int, batch: int
) -> None:
    """``assign_pair``: writes with repeats (the last one wins) and zeros, then the leaves,
    every level of both trees, the count of positive leaves and the leaf of every boundary
    query are those of the model. Integer weights keep every sum exact in any order, so the
    compiled and numpy trees must agree bit for bit."""
    rng = np.random.default_rng(seed)
    sums = SumTree(capacity, top=16)
    mins = PositiveMinTree(sums)
    model = np.zeros(capacity)
    positive = 0
    for _ in range(rounds):
        idx = rng.integers(0, capacity, size=batch)
        vals = rng.integers(0, 5, size=batch).astype(np.float64)
        positive += assign_pair(sums, mins, idx, vals)
        for i, v in zip(idx.tolist(), vals.tolist(), strict=True):
            model[i] = v
        assert positive == np.count_nonzero(model)
    ref = SumTree(capacity, top=16, jit=False)
    ref.fill(model)
    ref_mins = PositiveMinTree(ref)
    ref_mins.rebuild()
    assert np.array_equal(sums.leaves, model)
    for tree, other in ((sums, ref), (mins, ref_mins)):
        assert all(np.array_equal(p, q) for p, q in zip(tree.levels, other.levels, strict=True))
    assert sums.total == model.sum() and mins.min == ref_mins.min
    if model.sum() == 0:
        return
    cum = np.cumsum(model)
    values = np.concatenate([cum, cum - 0.5, [0.0, sums.total * 3, np.nan, -1.0]])
    got = sums.find_prefix_sum(values)
    assert np.array_equal(got, brute_find(model, np.fmax(np.nan_to_num(values), 0.0)))
    keys, weights = sums.draw(300, np.random.default_rng(seed))
    ref_keys, ref_weights = ref.draw(300, np.random.default_rng(seed))
    assert np.array_equal(keys, ref_keys) and np.array_equal(weights, ref_weights)


def test_jit_asked_for_without_numba(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sumtree, "jit_available", lambda: None)
    with pytest.raises(RuntimeError, match="numba"):
        SumTree(4, jit=True)
    assert SumTree(4).kernels is None and SumTree(4, jit=False).kernels is None
