"""Sum and min trees over a fixed number of leaves: 16-ary, flat arrays, vectorised per level.

The prioritized sampler keeps one weight per row (or per episode start row) in a
:class:`SumTree` to draw in proportion to weight and a :class:`PositiveMinTree` for the smallest
positive weight (the PER paper's weight normalisation): a :class:`MinTree` whose leaves are the
sum tree's own, a zero leaf counting as +inf. They share one layout:

* ``size`` is the next power of two >= ``capacity``. ``levels[0]`` holds the ``size`` leaves
  (past ``capacity``: the neutral value, 0 for sums, +inf for minima, never written);
  ``levels[l + 1][p]`` combines the :data:`FANOUT` = 16 consecutive entries
  ``levels[l][16p : 16p + 16]``, up to a *top* level of at most :data:`TOP` = 16384 entries.
  So 10M leaves take 3 levels of 16-ary steps under a top of 4096, 100k take 1 under 8192 and
  10k none (the top is the leaves). A row of 16 siblings is 128 contiguous bytes: a step down
  touches two cache lines per query where a binary tree would touch four levels' worth, and
  each step is a handful of whole-batch numpy calls where a binary tree needs four times the
  steps: per-call overhead, not arithmetic, is what a batch of 256 costs.
* Invariant: every inner entry equals ``op(children)``, recomputed from the children on each
  update (never adjusted by deltas), so sums never drift, however many updates there are.
  The top's running sum (and minimum) is recomputed from the top on the first read after an
  update: ``total`` is that running sum's last value, exactly what a draw scales by.
* :meth:`_Tree.update` takes a whole batch: duplicates are resolved first (the last write wins,
  as if the writes were applied in order), then each level's parents are recomputed with a
  gather of their 16-entry child rows, one row-wise reduction and one scatter: O(k log n) work
  in O(log16 n) steps. Parents shared by several updated leaves are written more than once
  with the same value, which is cheaper than deduplicating every level. A dense batch (a
  committed or evicted row range) recomputes each level's contiguous run of parents from
  slices instead: O(k).
* :meth:`SumTree.find_prefix_sum` descends all queries together: one ``searchsorted`` over the
  top's running sum, then per 16-ary level one gather of each query's child row, its running
  sums (a row-wise cumsum) and the first child whose running sum passes the query (a compare
  and an ``argmax``).
* Rounding: a parent is BLAS's sum of its children (a product with a vector of ones, in an
  order of its own) and a descent compares against their sequential running sums, which may
  differ in the last bit. A query a rounding error past its node's running sums goes to the
  last child, so it can end on an empty leaf; every result is checked and those few are redone
  by a slow descent that never enters a subtree of sum zero: no zero-weight leaf is reachable.
* Compiled trees (``jit``, the default where numba is installed: the ``fast`` extra) keep this
  layout, 16-ary up to a top of :data:`JIT_TOP` entries, with every level of a tree inside one
  flat array; ``draw``, ``find_prefix_sum``, :func:`update_pair` and :func:`assign_pair` of up
  to 512 leaves then run ``_jit.py``'s loops (its docstring says how they walk), and everything
  else (dense runs, fills, prefix sums) the numpy code below. Same leaves for the same queries,
  but within rounding of a boundary; a zero-weight leaf is unreachable in both.

numpy does the 1-D work; torch does the two row-wise reductions numpy is slow at (on views of
the same memory): for [256, 16] rows numpy's ``cumsum(axis=1)`` and ``min(axis=1)`` cost a
multiple of torch's (figures in ``docs/sampling.md``). ``torch.searchsorted`` would batch the
search, but it forks threads from 200 queries, which stalls for milliseconds on a busy machine.

Not thread-safe; the owning sampler serialises calls.
"""

from __future__ import annotations

import functools
import itertools
import operator
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from shmbuffer import jit

if TYPE_CHECKING:
    import torch

__all__ = [
    "FANOUT",
    "TOP",
    "MinTree",
    "PositiveMinTree",
    "SumTree",
    "assign_pair",
    "jit_available",
    "update_pair",
]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

FANOUT = 16
_SHIFT = 4  # log2(FANOUT)
#: Most entries the top level may have: its running sum (one torch cumsum) is recomputed on
#: the first draw after an update, which up to this size costs less than the gathers and
#: scatters one more 16-ary level adds to a sample and an update of 256.
TOP = 16384
#: Queries one descent step handles at once: bounds its [n, 16] temporaries (8 MB).
_CHUNK = 1 << 16
_ONES = np.ones(FANOUT)
#: Batches above this size are checked for being one dense run of leaves.
_DENSE_CHECK = 512
#: A compiled tree's top: 16-ary all the way up, since a compiled step costs little more
#: than the memory it touches (the numpy top's running sum was a large share of a draw).
JIT_TOP = FANOUT


@functools.cache
def jit_available() -> ModuleType | None:
    """The compiled kernels (``_jit.py``), or None: numba is not installed (the ``fast``
    extra), or ``SHMBUFFER_JIT=0`` asks for the numpy loops. Imported on first use."""
    return jit.load("shmbuffer.samplers._jit")


def _flat_levels(sizes: list[int], neutral: float) -> tuple[F64, I64, list[F64]]:
    """One array holding every level (the kernels walk it), its level offsets, and views."""
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    flat = np.full(int(offsets[-1]), neutral, dtype=np.float64)
    return flat, offsets, [flat[a:b] for a, b in itertools.pairwise(offsets)]


def _top_used(capacity: int, depth: int) -> int:
    """Top entries with a leaf under them: the rest hold the neutral value for good, so the
    top's running sum and minimum skip them (10k leaves in a top of 16384: 40% less work)."""
    return -(-capacity >> (_SHIFT * depth))


class _Tree:
    """Shared storage and batch update; subclasses fix the operation and its neutral value."""

    _neutral: float = 0.0

    def __init__(self, capacity: int, *, top: int = TOP) -> None:
        # torch is bound here when the first tree is built, not on import: the sampler
        # declarations (read by the command line's parser) then import without it.
        global torch  # noqa: PLW0603
        import torch

        capacity, top = operator.index(capacity), operator.index(top)
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if top < 1:
            raise ValueError(f"top must be >= 1, got {top}")
        self.capacity: int = capacity
        self.size: int = 1 << max(capacity - 1, 0).bit_length()
        sizes = [self.size]  # powers of two: each one >= 16 divides by 16
        while sizes[-1] > top and sizes[-1] >= FANOUT:
            sizes.append(sizes[-1] // FANOUT)
        #: 16-ary steps between the leaves and the top.
        self.depth: int = len(sizes) - 1
        self._flat, self._offsets, self.levels = _flat_levels(sizes, self._neutral)
        #: ``_rows[l][p]``: the 16 entries of level ``l`` under entry ``p`` of level l + 1.
        self._rows = [lv.reshape(-1, FANOUT) for lv in self.levels[:-1]]
        self._top_used = _top_used(capacity, self.depth)
        self._top_dirty = True

    def _combine(self, rows: F64, level: int) -> F64:
        """One value per row of 16 children of ``level`` (a new [m] array)."""
        raise NotImplementedError

    def _refresh_top(self) -> None:
        """Recompute what is cached from the top level (called when it changed)."""

    @property
    def leaves(self) -> F64:
        """A read-only view of the ``capacity`` leaf values."""
        view = self.levels[0][: self.capacity]
        view.flags.writeable = False
        return view

    def get(self, index: npt.ArrayLike) -> F64:
        idx = self._check_index(index)
        out: F64 = self.levels[0][idx]
        return out

    def get_unchecked(self, index: I64) -> F64:
        """:meth:`get` for int64 indices known to be in range (the samplers' hot path)."""
        out: F64 = self.levels[0].take(index)
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
        self.update_unique(*_last_writes(idx, vals))

    def update_unique(self, index: I64, values: F64) -> None:
        """:meth:`update` for int64 indices already known to be in range and distinct (the
        sampler's hot path: it has deduplicated them once already)."""
        if index.size == 0:
            return
        self.levels[0][index] = values
        self.refresh(index)

    def refresh(self, index: I64) -> None:
        """Recompute the ancestors of leaves ``index`` (int64, in range, any order)."""
        self._top_dirty = True
        if self.depth == 0 or index.size == 0:
            return
        if index.size > _DENSE_CHECK:
            lo, hi = int(index.min()), int(index.max())
            if hi - lo < 4 * index.size:
                self._recompute(lo, hi + 1)
                return
        # Sparse batch: one gather, combine and scatter per level.
        parent = np.right_shift(index, _SHIFT)
        levels, rows = self.levels, self._rows
        for level in range(self.depth):
            if level:
                np.right_shift(parent, _SHIFT, out=parent)
            levels[level + 1][parent] = self._combine(rows[level].take(parent, axis=0), level)

    def _recompute(self, lo: int, hi: int) -> None:
        """Recompute every ancestor of leaves ``[lo, hi)`` from contiguous child rows."""
        for level in range(self.depth):
            lo, hi = lo >> _SHIFT, ((hi - 1) >> _SHIFT) + 1
            self.levels[level + 1][lo:hi] = self._combine(self._rows[level][lo:hi], level)

    def fill(self, values: npt.ArrayLike) -> None:
        """Replace every leaf (``capacity`` values) and rebuild the tree bottom-up, O(n)."""
        vals = np.asarray(values, dtype=np.float64)
        if vals.shape != (self.capacity,):
            raise ValueError(f"need {self.capacity} leaf values, got shape {vals.shape}")
        leaves = self.levels[0]
        leaves[: self.capacity] = vals
        leaves[self.capacity :] = self._neutral
        self.rebuild()

    def rebuild(self) -> None:
        """Recompute every inner entry from the leaves, O(n)."""
        self._top_dirty = True
        step = _CHUNK * FANOUT  # bounds the temporaries of one combine
        for lo in range(0, self.size, step):
            self._recompute(lo, min(lo + step, self.size))

    def clear(self) -> None:
        for level in self.levels:
            level[:] = self._neutral
        self._top_dirty = True


def update_pair(sums: SumTree, mins: PositiveMinTree, index: I64, values: F64) -> None:
    """``sums.update_unique(index, values)`` and the refresh of ``mins`` (over ``sums``): each
    level's parents computed once and each row of 16 leaves gathered once for both trees (the
    prioritized sampler's update of a sampled batch)."""
    if mins.sums is not sums:
        raise ValueError("update_pair needs the PositiveMinTree of this very SumTree")
    if index.size == 0:
        return
    if _compiled(sums, index):
        _assign_compiled(sums, mins, index, values)
        return
    if sums.depth == 0:  # leaves only; the min tree keeps its copy
        sums.levels[0][index] = values
        mins.levels[0][index] = (
            values if values.min() > 0.0 else np.where(values > 0, values, np.inf)
        )
        sums._top_dirty = mins._top_dirty = True
        return
    if index.size > _DENSE_CHECK:
        sums.update_unique(index, values)
        mins.refresh(index)
        return
    sums.levels[0][index] = values
    sums._top_dirty = mins._top_dirty = True
    parent = np.right_shift(index, _SHIFT)
    for level in range(sums.depth):
        if level:
            np.right_shift(parent, _SHIFT, out=parent)
        rows = sums._rows[level].take(parent, axis=0)
        sums.levels[level + 1][parent] = sums._combine(rows, level)
        if level:
            rows = mins._rows[level].take(parent, axis=0)
        mins.levels[level + 1][parent] = mins._combine(rows, level)


def assign_pair(sums: SumTree, mins: PositiveMinTree, index: I64, values: F64) -> int:
    """Set leaves ``index`` (int64, in range, repeats allowed: the last write wins, as if they
    were applied in order) to ``values`` (>= 0) in ``sums`` and refresh ``mins`` over it;
    return the change in the number of positive leaves. A compiled tree applies the writes
    in order, without sorting out the repeats first."""
    if mins.sums is not sums:
        raise ValueError("assign_pair needs the PositiveMinTree of this very SumTree")
    if index.size == 0:
        return 0
    if _compiled(sums, index):
        return _assign_compiled(sums, mins, index, values)
    index, values = _last_writes(index, values)
    before = int(np.count_nonzero(sums.levels[0].take(index)))
    update_pair(sums, mins, index, values)
    return int(np.count_nonzero(values)) - before


def _last_writes(index: I64, values: F64) -> tuple[I64, F64]:
    """``index`` without repeats and each one's last value (unchanged if it has none)."""
    if index.size > 1:
        # np.unique on the reversed batch keeps each index's first hit there = last write.
        uniq, first = np.unique(index[::-1], return_index=True)
        if uniq.size != index.size:
            return uniq, values[::-1][first]
    return index, values


def _compiled(sums: SumTree, index: I64) -> bool:
    """Whether an update of ``index`` goes through the kernels: a compiled tree with 16-ary
    levels, and a sparse batch (a dense run is cheaper as the numpy slices below)."""
    return sums.kernels is not None and sums.depth > 0 and index.size <= _DENSE_CHECK


def _assign_compiled(sums: SumTree, mins: PositiveMinTree, index: I64, values: F64) -> int:
    assert sums.kernels is not None
    sums._top_dirty = mins._top_dirty = True
    gained: int = sums.kernels.assign(
        sums._flat, sums._offsets, mins._flat, mins._offsets, sums.depth, index, values
    )
    return gained


class _Scratch:
    """The descent's temporaries for one batch size, kept while that size repeats (a learner
    samples at one batch size: allocating these per call was a visible share of a draw)."""

    def __init__(self, n: int) -> None:
        # Row i of ``starts``: where each of node i's 16 children starts (column 0 stays 0,
        # columns 1..15 take the running sums of children 0..14), then +inf (column 16). The
        # first of columns 1..16 above v always exists: its offset there is the child that
        # holds v (column 0, never above v, is left out of the search).
        self.n = n
        self.starts = np.zeros((n, FANOUT + 1), dtype=np.float64)
        self.starts[:, FANOUT] = np.inf
        self.flat = self.starts.reshape(-1)
        self.sums = torch.from_numpy(self.starts)[:, 1:FANOUT]
        self.above = np.empty((n, FANOUT), dtype=np.bool_)
        self.ends = self.starts[:, 1:]
        self.rows = np.empty((n, FANOUT), dtype=np.float64)
        self.head = torch.from_numpy(self.rows)[:, : FANOUT - 1]
        #: ``base[i] + child[i]`` is the flat index of row i's column ``child[i]``.
        self.base = np.arange(0, n * (FANOUT + 1), FANOUT + 1, dtype=np.int64)


class SumTree(_Tree):
    """Leaf weights with their running sums: O(log n) draws proportional to weight."""

    _neutral = 0.0

    def __init__(self, capacity: int, *, top: int | None = None, jit: bool | None = None) -> None:
        """``jit``: walk the tree with the compiled kernels (None: when numba is installed;
        True requires it). ``top``: the top level's largest size (None: :data:`TOP`, or
        :data:`JIT_TOP` for a compiled tree)."""
        kernels = jit_available() if jit is None or jit else None
        if jit and kernels is None:
            raise RuntimeError("SumTree(jit=True) needs numba (pip install 'shmbuffer[fast]')")
        #: The compiled kernels this tree uses, or None for the numpy loops.
        self.kernels: ModuleType | None = kernels
        super().__init__(capacity, top=(JIT_TOP if kernels else TOP) if top is None else top)
        used = self._top_used  # the entries past it stay 0: their running sums are the total
        self._top_cum: F64 = np.zeros(used + 1)
        # The top entries' running sums but the last: searchsorted(right) over them is the
        # entry holding v, the last one for any v beyond (rounding at the total).
        self._top_search: F64 = self._top_cum[1:used]
        # torch's cumsum: numpy's accumulate is several times slower per value.
        self._top_t = torch.from_numpy(self.levels[-1][:used])
        self._top_cum_t = torch.from_numpy(self._top_cum)[1:]
        self._scratch = _Scratch(0)

    def _combine(self, rows: F64, level: int) -> F64:
        # A matrix-vector product with ones (BLAS): a fraction of np.sum's time for [256, 16].
        out: F64 = rows @ _ONES
        return out

    def _refresh_top(self) -> None:
        torch.cumsum(self._top_t, 0, out=self._top_cum_t)
        self._top_dirty = False

    @property
    def total(self) -> float:
        if self._top_dirty:
            self._refresh_top()
        return float(self._top_cum[-1])

    def find_prefix_sum(self, values: npt.ArrayLike) -> I64:
        """For each value ``v`` the leaf ``j`` with ``sum(leaf[:j]) <= v < sum(leaf[:j+1])``.

        Negative values (and NaN) count as 0. While ``total > 0`` every result is a leaf of
        positive weight: where rounding lets the fast descent end on an empty leaf (``v`` on a
        boundary, or ``v >= total``), that query is redone by a descent that never enters a
        subtree of sum zero, ending on the last positive leaf starting at or before ``v``.
        That is what makes a zero-weight row unreachable.
        """
        v = np.fmax(np.asarray(values, dtype=np.float64).reshape(-1), 0.0)
        if self.kernels is not None:
            return self._descend_compiled(v, 1.0)[0]
        return self._find(v)[0]

    def sample(self, n: int, rng: np.random.Generator) -> I64:
        """``n`` leaves drawn with replacement in proportion to their weight (total > 0)."""
        return self.draw(n, rng)[0]

    def draw(self, n: int, rng: np.random.Generator) -> tuple[I64, F64]:
        """:meth:`sample`, with the drawn leaves' weights."""
        u = rng.random(n)
        if self.kernels is not None:
            return self._descend_compiled(u, self.total)
        return self._find(u * self.total, u)

    def _descend_compiled(self, queries: F64, scale: float) -> tuple[I64, F64]:
        """Leaves and weights for ``queries * scale`` (>= 0), by the compiled descent."""
        if self._top_dirty:
            self._refresh_top()
        nodes = np.empty(queries.size, dtype=np.int64)
        weights = np.empty(queries.size, dtype=np.float64)
        assert self.kernels is not None
        self.kernels.descend(
            self._flat, self._offsets, self.depth, self._top_used, queries, scale, nodes, weights
        )
        return nodes, weights

    def _find(self, v: F64, kept: F64 | None = None) -> tuple[I64, F64]:
        """Leaves and their weights for values ``v`` (float64, >= 0, consumed); ``kept``:
        ``v`` before it is consumed, times any positive factor (None: copied here)."""
        if v.size > _CHUNK:
            parts = [self._find(v[i : i + _CHUNK].copy()) for i in range(0, v.size, _CHUNK)]
            return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        if self._top_dirty:
            self._refresh_top()
        original = v.copy() if kept is None else kept
        # The queries in ascending order: the binary search over the top then mispredicts far
        # less (a large share of the descent unsorted), and each level's gathers walk memory
        # in address order. The leaves go back to the draws' own order at the end.
        order = v.argsort()
        v = v.take(order)
        found = self._top_search.searchsorted(v, side="right")  # the top entry holding v
        if self.depth:
            v -= self._top_cum.take(found)
            self._descend(found, v)
        node = np.empty_like(found)
        node[order] = found
        weight = self.levels[0].take(node)
        if weight.size and weight.min() <= 0.0 and self.total > 0.0:
            bad = np.flatnonzero(weight <= 0.0)
            scale = 1.0 if kept is None else self.total
            node[bad] = self._careful(original[bad] * scale)
            weight[bad] = self.levels[0].take(node[bad])
        return node, weight

    def _descend(self, node: I64, v: F64) -> None:
        """Walk ``node`` (top entries, in place) down to leaves, ``v`` (in place) the offset
        inside each: per level, the child whose running-sum interval holds ``v``."""
        n = v.size
        scratch = self._scratch
        if scratch.n != n:
            scratch = self._scratch = _Scratch(n)
        flat, sums, above, ends = scratch.flat, scratch.sums, scratch.above, scratch.ends
        rows, head, base, children = scratch.rows, scratch.head, scratch.base, self._rows
        v_col = v[:, None]
        for level in range(self.depth - 1, -1, -1):
            children[level].take(node, axis=0, out=rows)
            torch.cumsum(head, 1, out=sums)
            np.greater(ends, v_col, out=above)
            child = above.argmax(axis=1)  # not torch.searchsorted: see the module docstring
            v -= flat.take(np.add(base, child))
            node *= FANOUT
            node += child

    def _careful(self, v: F64) -> I64:
        """The slow, exact descent for the few queries the fast one ended on an empty leaf:
        at every step, the last child of positive sum starting at or before ``v``."""
        v = np.fmax(v, 0.0)
        top = self.levels[-1][: self._top_used]
        node = self._last_positive(top[None, :], self._top_cum[None, :-1], v)
        v = v - self._top_cum[node]
        rows = np.arange(v.size)
        for level in range(self.depth - 1, -1, -1):
            kids = self.levels[level].reshape(-1, FANOUT)[node]
            start = np.zeros_like(kids)
            np.cumsum(kids[:, :-1], axis=1, out=start[:, 1:])
            child = self._last_positive(kids, start, v)
            v = v - start[rows, child]
            node = node * FANOUT + child
        return node

    @staticmethod
    def _last_positive(weights: F64, starts: F64, v: F64) -> I64:
        ok = (weights > 0.0) & (starts <= v[:, None])
        # A subtree of positive sum always has one: its first positive child starts at 0.
        out: I64 = ok.shape[1] - 1 - np.argmax(ok[:, ::-1], axis=1)
        return out

    def prefix_sum(self, index: npt.ArrayLike) -> F64:
        """``sum(leaf[:i])`` for each ``i`` in ``[0, capacity]``, O(log n) each, vectorised."""
        idx = np.asarray(index, dtype=np.int64).reshape(-1)
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) > self.capacity):
            raise IndexError(f"prefix end out of range [0, {self.capacity}]")
        if self._top_dirty:
            self._refresh_top()
        acc = np.zeros(idx.shape, dtype=np.float64)
        pos = idx.copy()
        for level in range(self.depth):
            # The siblings before pos in its row of 16 (none when pos starts a row).
            rows = self.levels[level].reshape(-1, FANOUT)
            kids = rows[np.minimum(pos >> _SHIFT, len(rows) - 1)]
            col = pos & (FANOUT - 1)
            before = np.where(np.arange(FANOUT) < col[:, None], kids, 0.0)
            acc += np.cumsum(before, axis=1)[:, -1]
            pos >>= _SHIFT
        acc += self._top_cum[pos]
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

    def __init__(self, capacity: int, *, top: int = TOP) -> None:
        super().__init__(capacity, top=top)
        self._min = float("inf")

    def _combine(self, rows: F64, level: int) -> F64:
        # torch's row minimum: numpy's reduction over rows of 16 is slower.
        out: F64 = torch.amin(torch.from_numpy(rows), 1).numpy()
        return out

    def _refresh_top(self) -> None:
        self._min = float(self.levels[-1][: self._top_used].min())
        self._top_dirty = False

    @property
    def min(self) -> float:
        if self._top_dirty:
            self._refresh_top()
        return self._min


class PositiveMinTree(MinTree):
    """The smallest positive leaf of a :class:`SumTree`: a min tree whose level 0 *is* the sum
    tree's leaves (a zero leaf counting as +inf), not a copy of them. That saves 8 B per row
    (143 MB at 10M rows) and, at 10M rows, 256 cache misses per update: :func:`update_pair`
    gathers each row of 16 leaves once for both trees. A sum tree without 16-ary levels (up to
    :data:`TOP` leaves) gets a copy after all, zeros as +inf: a masked minimum over the top's
    leaves costs an order of magnitude more than a plain one.

    The sum tree writes the leaves; this tree is told which changed (:meth:`refresh`) or to
    recompute everything (:meth:`rebuild`). ``min`` is +inf while no leaf is positive.
    """

    def __init__(self, sums: SumTree) -> None:
        self.sums = sums
        self.capacity, self.size, self.depth = sums.capacity, sums.size, sums.depth
        self._copy = sums.depth == 0
        # Its own levels in one array (the kernels walk it), offsets as the sum tree's from
        # level 1 up; ``_offsets[0]`` is unused (level 0 is the sum tree's leaves).
        sizes = [len(lv) for lv in sums.levels[1:]]
        self._flat, offsets, upper = _flat_levels(sizes, np.inf)
        self._offsets = np.concatenate([[0], offsets]).astype(np.int64)
        self.levels = [np.full(sums.size, np.inf) if self._copy else sums.levels[0], *upper]
        self._rows = [lv.reshape(-1, FANOUT) for lv in self.levels[:-1]]
        self._top_used = sums._top_used
        self._top_dirty = True
        self._min = float("inf")

    def _combine(self, rows: F64, level: int) -> F64:
        out = super()._combine(rows, level)
        if level == 0 and out.size and out.min() <= 0.0:
            # Only rows holding an empty leaf (weights are >= 0: a row minimum of 0) need the
            # masked minimum; masking every row first cost two [k, 16] passes per update.
            fix = np.flatnonzero(out <= 0.0)
            part = rows[fix]
            out[fix] = super()._combine(np.where(part > 0.0, part, np.inf), level)
        return out

    def refresh(self, index: I64) -> None:
        if self._copy:
            weights = self.sums.levels[0].take(index)
            self.levels[0][index] = np.where(weights > 0.0, weights, np.inf)
        super().refresh(index)

    def rebuild(self) -> None:
        if self._copy:
            leaves = self.sums.levels[0]
            self.levels[0][:] = np.where(leaves > 0.0, leaves, np.inf)
        super().rebuild()

    def update_unique(self, index: I64, values: F64) -> None:
        raise TypeError("a PositiveMinTree's leaves are its SumTree's: update those, then refresh")

    def fill(self, values: npt.ArrayLike) -> None:
        raise TypeError("a PositiveMinTree's leaves are its SumTree's: fill those, then rebuild")

    def clear(self) -> None:
        for level in self.levels[0 if self._copy else 1 :]:
            level[:] = np.inf
        self._top_dirty = True
