"""Sum and min segment trees over a fixed number of leaves, vectorised with numpy.

The prioritized sampler keeps one weight per row (or per episode start row) in a
:class:`SumTree` to draw in proportion to weight and a :class:`MinTree` for the smallest
weight (the PER paper's weight normalisation). Both are array-backed complete binary trees:

* ``size`` is the next power of two >= ``capacity``; node ``1`` is the root, node ``i`` has
  children ``2i`` and ``2i + 1``, leaf ``j`` is node ``size + j``. Leaves past ``capacity``
  hold the neutral value (0 for sums, +inf for minima) and are never written.
* Invariant: every inner node equals ``op(left, right)`` of its children, recomputed from the
  children on each update (never adjusted by deltas), so sums never drift, however many
  updates there are.
* :meth:`_Tree.update` takes a whole batch: duplicates are resolved first (the last write wins,
  as if the writes were applied in order), then the parents are recomputed one level at a time
  with one fancy-indexed numpy operation per level, O(k log n) work in O(log n) numpy calls.
  Parents shared by several updated leaves are written more than once with the same value,
  which is cheaper than deduplicating every level. A dense batch (a committed or evicted row
  range) recomputes each level's contiguous run of parents with slices instead: O(k).
* :meth:`SumTree.find_prefix_sum` descends all queries together, one level per numpy step.

Not thread-safe; the owning sampler serialises calls.
"""

from __future__ import annotations

import operator

import numpy as np
import numpy.typing as npt

__all__ = ["MinTree", "SumTree"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


class _Tree:
    """Shared storage and batch update; subclasses fix the operation and its neutral value."""

    _neutral: float = 0.0

    def __init__(self, capacity: int) -> None:
        capacity = operator.index(capacity)
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity: int = capacity
        self.size: int = 1 << max(capacity - 1, 0).bit_length()
        self.depth: int = self.size.bit_length() - 1
        self._nodes: F64 = np.full(2 * self.size, self._neutral, dtype=np.float64)
        self._pairs: F64 = self._nodes.reshape(-1, 2)

    def _combine(self, left: F64, right: F64) -> F64:
        raise NotImplementedError

    @property
    def leaves(self) -> F64:
        """A read-only view of the ``capacity`` leaf values."""
        view = self._nodes[self.size : self.size + self.capacity]
        view.flags.writeable = False
        return view

    def get(self, index: npt.ArrayLike) -> F64:
        idx = self._check_index(index)
        out: F64 = self._nodes[idx + self.size]
        return out

    def get_unchecked(self, index: I64) -> F64:
        """:meth:`get` for int64 indices known to be in range (the samplers' hot path)."""
        out: F64 = self._nodes.take(index + self.size)
        return out

    def _check_index(self, index: npt.ArrayLike) -> I64:
        idx = np.asarray(index)
        if idx.dtype.kind not in "iu" and idx.size:
            raise TypeError(f"tree indices must be integers, got dtype {idx.dtype}")
        idx = idx.astype(np.int64, copy=False).reshape(-1)
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= self.capacity):
            raise IndexError(f"tree index out of range [0, {self.capacity})")
        return idx

    def update(self, index: npt.ArrayLike, values: npt.ArrayLike) -> None:
        """Set leaves ``index`` to ``values``; with repeated indices the last value wins."""
        idx = self._check_index(index)
        vals = np.broadcast_to(np.asarray(values, dtype=np.float64), idx.shape)
        if idx.size > 1:
            # np.unique on the reversed batch keeps each index's first hit there = last write.
            uniq, first = np.unique(idx[::-1], return_index=True)
            if uniq.size != idx.size:
                idx, vals = uniq, vals[::-1][first]
        self.update_unique(idx, vals)

    def update_unique(self, index: I64, values: F64) -> None:
        """:meth:`update` for int64 indices already known to be in range and distinct (the
        sampler's hot path: it has deduplicated them once already)."""
        if index.size == 0:
            return
        nodes = self._nodes
        node = index + self.size
        nodes[node] = values
        lo, hi = int(node.min()), int(node.max())
        if hi - lo < 4 * index.size:
            # Dense batch (a committed or evicted row range): the parents at each level are
            # one contiguous run, recomputed with slices; O(k) in total instead of O(k log n)
            # (evicting a 1M-row chunk at 10M leaves: ~10 ms instead of ~0.5 s).
            for _ in range(self.depth):
                lo, hi = lo >> 1, hi >> 1
                kids = nodes[2 * lo : 2 * hi + 2]
                nodes[lo : hi + 1] = self._combine(kids[0::2], kids[1::2])
            return
        # Row ``i`` of the pairs view is the children of node ``i``: one gather per level reads
        # both (measured ~1.5x faster than two separate gathers at 10M leaves).
        pairs = self._pairs
        for _ in range(self.depth):
            node >>= 1
            both = pairs.take(node, axis=0)
            nodes[node] = self._combine(both[:, 0], both[:, 1])

    def fill(self, values: npt.ArrayLike) -> None:
        """Replace every leaf (``capacity`` values) and rebuild the tree bottom-up, O(n)."""
        vals = np.asarray(values, dtype=np.float64)
        if vals.shape != (self.capacity,):
            raise ValueError(f"need {self.capacity} leaf values, got shape {vals.shape}")
        nodes = self._nodes
        nodes[:] = self._neutral
        nodes[self.size : self.size + self.capacity] = vals
        lo = self.size
        while lo > 1:
            hi, lo = lo, lo >> 1
            nodes[lo:hi] = self._combine(nodes[2 * lo : 2 * hi : 2], nodes[2 * lo + 1 : 2 * hi : 2])

    def clear(self) -> None:
        self._nodes[:] = self._neutral


class SumTree(_Tree):
    """Leaf weights with their running sums: O(log n) draws proportional to weight."""

    _neutral = 0.0

    def _combine(self, left: F64, right: F64) -> F64:
        out: F64 = left + right
        return out

    @property
    def total(self) -> float:
        return float(self._nodes[1])

    def find_prefix_sum(self, values: npt.ArrayLike) -> I64:
        """For each value ``v`` the leaf ``j`` with ``sum(leaf[:j]) <= v < sum(leaf[:j+1])``.

        Negative values count as 0. While ``total > 0`` every result is a leaf of positive
        weight: where rounding lets the fast descent end on an empty leaf (``v`` on a boundary,
        or ``v >= total``), that query is redone by a descent that never enters a subtree of
        sum zero. That is what makes a zero-weight row unreachable.
        """
        v = np.array(values, dtype=np.float64, copy=True).reshape(-1)
        np.maximum(v, 0.0, out=v)
        nodes = self._nodes
        node = np.ones(v.shape, dtype=np.int64)
        lsum = np.empty_like(v)
        right = np.empty(v.shape, dtype=np.bool_)
        for _ in range(self.depth):
            node <<= 1
            nodes.take(node, out=lsum)
            np.greater_equal(v, lsum, out=right)
            np.subtract(v, lsum, out=v, where=right)
            node += right
        bad = np.flatnonzero(nodes.take(node) <= 0.0)
        if bad.size and self.total > 0.0:
            node[bad] = self._careful_descent(np.asarray(values, dtype=np.float64).reshape(-1)[bad])
        out: I64 = node - self.size
        return out

    def _careful_descent(self, v: F64) -> I64:
        nodes = self._nodes
        v = np.clip(v, 0.0, None)
        node = np.ones(v.shape, dtype=np.int64)
        for _ in range(self.depth):
            left = node << 1
            lsum = nodes[left]
            right = ((v >= lsum) & (nodes[left + 1] > 0.0)) | (lsum <= 0.0)
            v = np.where(right, v - lsum, v)
            node = left + right
        return node

    def sample(self, n: int, rng: np.random.Generator) -> I64:
        """``n`` leaves drawn with replacement in proportion to their weight (total > 0)."""
        return self.find_prefix_sum(rng.random(n) * self.total)

    def prefix_sum(self, index: npt.ArrayLike) -> F64:
        """``sum(leaf[:i])`` for each ``i`` in ``[0, capacity]``, O(log n) each, vectorised."""
        idx = np.asarray(index, dtype=np.int64).reshape(-1)
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) > self.capacity):
            raise IndexError(f"prefix end out of range [0, {self.capacity}]")
        nodes = self._nodes
        acc = np.zeros(idx.shape, dtype=np.float64)
        full = idx >= self.size  # only when capacity == size: the whole tree
        pos = np.where(full, 0, idx)
        node = np.ones(idx.shape, dtype=np.int64)
        for level in range(self.depth - 1, -1, -1):
            bit = (pos >> level) & 1
            left = node << 1
            acc += np.where(bit == 1, nodes[left], 0.0)
            node = left + bit
        acc[full] = nodes[1]
        return acc

    def range_sum(self, start: npt.ArrayLike, stop: npt.ArrayLike) -> F64:
        """``sum(leaf[start:stop])`` elementwise (two prefix sums; never negative)."""
        s = np.asarray(start, dtype=np.int64).reshape(-1)
        e = np.asarray(stop, dtype=np.int64).reshape(-1)
        both = self.prefix_sum(np.concatenate([s, e]))
        out: F64 = np.maximum(both[s.size :] - both[: s.size], 0.0)
        return out


class MinTree(_Tree):
    """Leaf values with their running minima; empty leaves hold +inf."""

    _neutral = float("inf")

    def _combine(self, left: F64, right: F64) -> F64:
        out: F64 = np.minimum(left, right)
        return out

    @property
    def min(self) -> float:
        return float(self._nodes[1])
