"""The sum tree's two hot loops, compiled by numba (the optional ``fast`` extra).

Imported only through :func:`shmbuffer.samplers.sumtree.jit_available`, never at package
import: numba is costly to import (CPU and memory), which only a prioritized sampler pays.

Both kernels walk a tree stored as one flat float64 array per tree, level ``l`` at
``flat[offsets[l] : offsets[l] + len(level l)]`` (level 0: the leaves; each entry of level
``l + 1`` combines 16 consecutive entries of level ``l``; the top level, at ``offsets[depth]``,
has ``top_used`` entries that matter). Per batch of 256 queries the numpy descent is ~10 whole-
array calls per level; here it is one call whose cost is the memory it touches.

* :func:`descend`: per query, at each level the first child whose sequential running sum
  passes the query, skipping children of weight 0; past every child (a rounding error at a
  boundary, or a query at or beyond the total) the last child of positive weight. A node of
  positive weight has a child of positive weight, so a descent that starts under a positive
  total ends on a positive leaf: a zero-weight leaf is never drawn.
* :func:`assign`: the writes applied one after another (with a repeated leaf the last one
  wins), then, level by level, each ancestor of a written leaf recomputed once from its 16
  children in both trees: sums, and the smallest positive leaf (a zero leaf counts as +inf).
  Inner entries are recomputed, never adjusted by deltas, so they never drift.

Thread safety: pure functions of their arguments; the tree's owner serialises calls.
"""

from __future__ import annotations

import numba
import numpy as np

_FANOUT = 16
_SHIFT = 4


@numba.njit(cache=True, nogil=True)
def descend(
    flat: np.ndarray,
    offsets: np.ndarray,
    depth: int,
    top_used: int,
    queries: np.ndarray,
    scale: float,
    nodes: np.ndarray,
    weights: np.ndarray,
) -> float:  # pragma: no cover - compiled; tested through SumTree
    """``nodes[i]``: the leaf holding ``queries[i] * scale`` (queries >= 0); ``weights[i]``
    its weight. All queries go down one level at a time: each level first touches every
    query's row of 16 (independent loads the CPU overlaps, as numpy's ``take`` does), then
    scans them from cache; one query at a time waited for each of its cache misses in turn
    (slower at 10M leaves, level in some runs). Returns the touched values' sum
    (kept live, never used)."""
    n = queries.size
    v = queries * scale
    sink = 0.0
    for level in range(depth, -1, -1):
        if level < depth:
            base = offsets[level]
            for i in range(n):
                row = base + nodes[i] * _FANOUT
                sink += flat[row] + flat[row + 8]  # both cache lines of the row
        for i in range(n):
            if level == depth:
                start, count = offsets[depth], top_used
            else:
                start, count = offsets[level] + nodes[i] * _FANOUT, _FANOUT
            vi = v[i]
            running = 0.0
            chosen = -1
            last = -1
            last_start = 0.0
            for k in range(count):
                w = flat[start + k]
                if w > 0.0:
                    nxt = running + w
                    if vi < nxt:
                        chosen = k
                        break
                    last, last_start = k, running
                    running = nxt
            if chosen >= 0:
                vi -= running
            elif last >= 0:
                chosen = last
                vi -= last_start
            else:  # a zero subtree: only under a zero total
                chosen = 0
            v[i] = vi
            nodes[i] = chosen if level == depth else nodes[i] * _FANOUT + chosen
    for i in range(n):
        weights[i] = flat[nodes[i]]
    return sink


#: Sums may be reassociated (added in SIMD lanes); infinities and NaN keep their meaning
#: (+inf is the min tree's empty value), so numba's full ``fastmath`` is not taken.
_SIMD = {"reassoc", "nsz", "contract"}


@numba.njit(cache=True, nogil=True, fastmath=_SIMD)
def assign(
    sums: np.ndarray,
    sum_offsets: np.ndarray,
    mins: np.ndarray,
    min_offsets: np.ndarray,
    depth: int,
    index: np.ndarray,
    values: np.ndarray,
) -> int:  # pragma: no cover - compiled; tested through SumTree
    """Set leaves ``index`` to ``values`` in order and refresh their ancestors in the sum
    tree ``sums`` and the positive-min tree ``mins`` (whose level 0 is ``sums``' leaves: its
    own levels start at ``min_offsets[1]``). Return the change in the number of positive
    leaves. Ancestors are recomputed once per level however many written leaves share them
    (the parents sorted, repeats adjacent): ~2x fewer rows than once per leaf."""
    gained = 0
    n = index.size
    for i in range(n):
        leaf = index[i]
        new = values[i]
        gained += (1 if new > 0.0 else 0) - (1 if sums[leaf] > 0.0 else 0)
        sums[leaf] = new
    parents = np.sort(index)
    for level in range(depth):
        m = 0
        prev = -1
        for i in range(n):
            p = parents[i] >> _SHIFT
            if p != prev:
                parents[m] = p
                m += 1
                prev = p
        n = m
        for i in range(n):
            parent = parents[i]
            first = sum_offsets[level] + (parent << _SHIFT)
            total = 0.0
            lowest = np.inf
            if level == 0:
                for k in range(_FANOUT):
                    w = sums[first + k]
                    total += w
                    lowest = min(lowest, w if w > 0.0 else np.inf)
            else:
                kids = min_offsets[level] + (parent << _SHIFT)
                for k in range(_FANOUT):
                    total += sums[first + k]
                    lowest = min(lowest, mins[kids + k])
            sums[sum_offsets[level + 1] + parent] = total
            mins[min_offsets[level + 1] + parent] = lowest
    return gained
