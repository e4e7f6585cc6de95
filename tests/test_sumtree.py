"""SumTree and MinTree against a plain numpy model: batch updates, prefix sums, searches."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmbuffer.samplers.sumtree import MinTree, SumTree


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
    capacity: int, batches: list[list[tuple[int, float]]], fractions: list[float]
) -> None:
    s, m = SumTree(capacity), MinTree(capacity)
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
