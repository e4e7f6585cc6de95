"""``--sampler max-heap`` / ``--sampler min-heap``: the n distinct items of highest (lowest)
priority, best first. Reverb's ``HeapSelector`` (``reverb/cc/selectors/heap.h``), on the narrow
item contract (``selector.py``): the shared layer (``shapes.py``) takes the priorities as the
prioritized sampler takes them (on commit a scalar, one per item, or None for the largest seen
so far; ``update_priorities`` moves them; the same checks) and turns the items into rows,
episodes and slices (a slice starts at its selected row, so its priority is its first row's,
as with ``prioritized``).

One file holds both classes: they differ in one sign (a min-heap ranks ``-priority``).

* Ties are broken by commit order, **newest first**. Reverb takes the least recently inserted
  or updated item; the commit order is what a journal's replay and a resumed buffer
  reproduce, and new data, which gets the largest priority seen so far, then comes first.
* Nothing is random: ``probability`` is 1 for every item and the generator is never used.
  Nothing is consumed unless ``max_times_sampled`` is set (then an item selected K times
  retires, as under every sampler).

The data structure is a 16-ary tree over the ``C`` slots in flat numpy arrays: a leaf holds
its slot while an item lives there (-1 otherwise) and every inner node the slot of the best
item below it, "best" being the larger ``(rank, seq)`` pair, so each item is ranked uniquely.

* ``insert`` / ``delete`` / ``update`` of k items set the leaves and recompute the touched
  parents of each level from their 16 children: O(16 k log16 C) work in log16 C vectorised
  steps.
* ``select(n)`` walks down from the root keeping, at each level, the ``n`` children whose best
  items rank highest among the children of the nodes kept. Nothing of the answer is lost: the
  ``n`` best children's bests are ``n`` distinct items, so the ``n``-th best item ranks at
  least as high as the worst of them, and a child holding one of the ``n`` best items has a
  best at least as high. O(16 n log16 C) vectorised, plus sorting ``16 n`` candidates per
  level; independent of how many items are held. (A ``np.argpartition`` over a C-sized array
  would be O(C) per draw.)
* Memory: 8 B per slot each for the rank, the seq and the leaf, and about 0.5 B for the levels
  above (with the shared layer's 32-40 B per row).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from shmbuffer.samplers.base import MAX_TIMES_SAMPLED
from shmbuffer.samplers.selector import Items, Selection, Selector

__all__ = ["MaxHeapSelector", "MinHeapSelector"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

_FANOUT = 16
_COLUMNS = np.arange(_FANOUT, dtype=np.int64)


def _level_sizes(capacity: int) -> list[int]:
    """Entries per level, leaves first: each a multiple of the fanout, up to a root of one."""
    sizes = [-(-max(capacity, 1) // _FANOUT) * _FANOUT]
    while sizes[-1] > 1:
        parents = sizes[-1] // _FANOUT
        sizes.append(parents if parents == 1 else -(-parents // _FANOUT) * _FANOUT)
    return sizes


class RankTree:
    """The best item below every node of a 16-ary tree over ``capacity`` slots; see the
    module docstring. Not thread-safe: the owner serialises calls."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(capacity, 1)
        # One more entry than slots: index -1 (an empty node) reads it, and ranks below all.
        self.rank = np.full(self.capacity + 1, -np.inf)
        self.seq = np.full(self.capacity + 1, -1, dtype=np.int64)
        self.levels = [np.full(size, -1, dtype=np.int64) for size in _level_sizes(capacity)]

    def set(self, slots: I64, rank: F64, seqs: I64 | None = None) -> None:
        """Items at ``slots`` (distinct) with ``rank`` (and, for new ones, ``seqs``)."""
        self.rank[slots] = rank
        if seqs is not None:
            self.seq[slots] = seqs
        self.levels[0][slots] = slots
        self._refresh(slots)

    def remove(self, slots: I64) -> None:
        self.rank[slots] = -np.inf
        self.seq[slots] = -1
        self.levels[0][slots] = -1
        self._refresh(slots)

    def _best(self, block: I64) -> I64:
        """Per row of ``block`` (slots, -1 for none), the slot of its best item."""
        rank = self.rank[block]
        top = rank == rank.max(axis=1, keepdims=True)
        pick = np.where(top, self.seq[block], -2).argmax(axis=1)
        out: I64 = block[np.arange(block.shape[0]), pick]
        return out

    def _refresh(self, slots: I64) -> None:
        nodes = slots
        for below, above in zip(self.levels, self.levels[1:], strict=False):
            nodes = np.unique(nodes // _FANOUT)
            above[nodes] = self._best(below[nodes[:, None] * _FANOUT + _COLUMNS])

    def order(self, slots: I64) -> I64:
        """``slots`` best first."""
        out: I64 = slots[np.lexsort((self.seq[slots], self.rank[slots]))[::-1]]
        return out

    def top(self, n: int) -> I64:
        """The ``n`` best items' slots, best first (fewer if fewer are held)."""
        nodes = np.zeros(1, dtype=np.int64)
        for level in reversed(self.levels[:-1]):
            children = (nodes[:, None] * _FANOUT + _COLUMNS).reshape(-1)
            best = level[children]
            held = best >= 0
            children, best = children[held], best[held]
            if best.size > n:
                children = children[np.lexsort((self.seq[best], self.rank[best]))[::-1][:n]]
            nodes = children
        return self.order(nodes)  # at the leaves, a node is its slot


class _HeapSelector(Selector):
    """The n held items of highest ``sign * priority``, ties newest first."""

    has_priorities = True
    uses_rng = False
    anchor = "start"
    sign = 1.0

    def __init__(self, *, max_times_sampled: int | None = MAX_TIMES_SAMPLED.default) -> None:
        super().__init__(max_times_sampled=max_times_sampled)
        self._tree = RankTree(1)

    def clear(self, capacity: int) -> None:
        self._tree = RankTree(capacity)

    def insert(self, items: Items, priority: F64) -> None:
        self._tree.set(items.slots, self.sign * priority, items.seqs)

    def delete(self, slots: I64) -> None:
        self._tree.remove(slots)

    def update(self, slots: I64, priority: F64) -> None:
        self._tree.set(slots, self.sign * priority)

    def select(self, n: int, rng: np.random.Generator) -> Selection:
        return Selection(self._tree.top(n), np.ones(n))

    def stats(self) -> dict[str, Any]:
        best = int(self._tree.levels[-1][0])
        return {"priority_best": None if best < 0 else self.sign * float(self._tree.rank[best])}


class MaxHeapSelector(_HeapSelector):
    """``--sampler max-heap``: the n items of highest priority, ties newest first."""

    name = "max-heap"
    sign = 1.0


class MinHeapSelector(_HeapSelector):
    """``--sampler min-heap``: the n items of lowest priority, ties newest first."""

    name = "min-heap"
    sign = -1.0
