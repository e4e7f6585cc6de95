"""``--sampler lifo``: the newest data first. Reverb's ``LifoSelector``
(``reverb/cc/selectors/lifo.h``), on the narrow item contract (``selector.py``).

``select(n)`` is the ``n`` newest held items by commit order, newest first. Through the shared
layer (``shapes.py``, anchor ``"end"``):

* ``sample(n)``: the ``n`` newest distinct rows, newest first (in episode unit: the newest
  episode's rows from its last one back, then the episode before it, ...);
  ``sample_episodes(n)``: the ``n`` newest distinct episodes (chunks in transition unit),
  newest first.
* ``sample_slices(n, length)``: ``n`` disjoint slices ending at the newest rows they can end
  at, newest first: in episode unit the last ``length`` rows of each of the ``n`` newest
  episodes long enough (``strict=False``: of the ``n`` newest, a shorter one whole); in
  transition unit the newest chunk cut back from its end into slices of ``length`` rows, then
  the chunk before it, a remainder shorter than ``length`` passed over (``strict=False``: a
  chunk shorter than ``length`` whole).

An aborted reservation's restored items go back to their place in the order, not on top
(their commit order comes back with them). Priorities are not kept; ``probability`` is 1 for
every item and the generator is never used. Nothing is consumed unless ``max_times_sampled``
is set: with ``--max-times-sampled 1`` it is a consume-once stack, every item handed out
once, newest first.

The data structure is a 16-ary tree over the ``C`` slots in flat numpy arrays, each node
holding the largest commit order (``seq``) below it, -1 where nothing is held. ``insert`` and
``delete`` of k items recompute the touched parents level by level, O(16 k log16 C) in log16 C
vectorised steps; ``select(n)`` walks down from the root keeping at each level the ``n``
children of largest ``seq``, which hold the ``n`` newest items (seqs are unique), O(16 n
log16 C). Reverb's linked list is O(1) per call but cannot put a restored item back in its
place. Memory: 8 B per slot and about 0.5 B for the levels above (with the shared layer's
24-32 B per row).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from shmbuffer.samplers.base import MAX_TIMES_SAMPLED
from shmbuffer.samplers.selector import Items, Selection, Selector

__all__ = ["LifoSelector"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

_FANOUT = 16
_COLUMNS = np.arange(_FANOUT, dtype=np.int64)


class LifoSelector(Selector):
    """``--sampler lifo``: the n newest held items, newest first; see the module docstring."""

    name = "lifo"
    uses_rng = False
    anchor = "end"

    def __init__(self, *, max_times_sampled: int | None = MAX_TIMES_SAMPLED.default) -> None:
        super().__init__(max_times_sampled=max_times_sampled)
        self.clear(1)

    def clear(self, capacity: int) -> None:
        sizes = [-(-max(capacity, 1) // _FANOUT) * _FANOUT]  # each a multiple of the fanout
        while sizes[-1] > 1:
            parents = sizes[-1] // _FANOUT
            sizes.append(parents if parents == 1 else -(-parents // _FANOUT) * _FANOUT)
        #: levels[0][slot]: the seq of the item at ``slot``; above: the largest below.
        self._levels = [np.full(size, -1, dtype=np.int64) for size in sizes]

    def insert(self, items: Items, priority: F64) -> None:
        self._levels[0][items.slots] = items.seqs
        self._refresh(items.slots)

    def delete(self, slots: I64) -> None:
        self._levels[0][slots] = -1
        self._refresh(slots)

    def update(self, slots: I64, priority: F64) -> None:
        """Priorities mean nothing here (the shared layer never calls it: none are kept)."""

    def _refresh(self, slots: I64) -> None:
        nodes = slots
        for below, above in zip(self._levels, self._levels[1:], strict=False):
            nodes = np.unique(nodes // _FANOUT)
            above[nodes] = below[nodes[:, None] * _FANOUT + _COLUMNS].max(axis=1)

    def select(self, n: int, rng: np.random.Generator) -> Selection:
        nodes = np.zeros(1, dtype=np.int64)
        for level in reversed(self._levels[:-1]):
            children = (nodes[:, None] * _FANOUT + _COLUMNS).reshape(-1)
            seqs = level[children]
            children, seqs = children[seqs >= 0], seqs[seqs >= 0]
            if seqs.size > n:
                children = children[np.argpartition(seqs, seqs.size - n)[-n:]]
            nodes = children
        newest = nodes[np.argsort(self._levels[0][nodes])[::-1]]  # at the leaves: slots
        return Selection(newest, np.ones(newest.size))
