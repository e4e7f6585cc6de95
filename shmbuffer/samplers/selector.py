"""The narrow sampler contract: which items to hand out, given which items are live.

A :class:`Selector` sees items, never rows, episodes or slices: the shared layer
(:class:`~shmbuffer.samplers.shapes.SelectorSampler`) follows the ring (commits, evictions,
an abort's restores, clears), tells the selector which items come and go, and turns what it
selects into the three draw shapes of either unit. So a new sampler is one small class: five
methods (:meth:`~Selector.clear`, :meth:`~Selector.insert`, :meth:`~Selector.delete`,
:meth:`~Selector.update`, :meth:`~Selector.select`), three more where it keeps state of its own
(``state_dict``, ``load_state_dict``, ``stats``) and its declarations. Reverb's ``ItemSelector``
(``reverb/cc/selectors/interface.h``) is the model; the samplers written this way are
``lifo.py`` and ``heap.py``. The tuned samplers (``uniform``, ``prioritized``,
``without-replacement``, ``fifo``) implement the wide :class:`~shmbuffer.samplers.base.Sampler`
contract themselves, for exact slice masses and compiled draws.

**Items.** An item is a row in transition unit, an episode in episode unit. The shared layer
names each one by two integers (:class:`Items`):

* ``slot``: where it lives, in ``[0, capacity)`` and unique among the items held: its row, or
  its episode's first row. Once an item is deleted its slot may come back holding another
  item, so a selector may keep capacity-sized arrays indexed by slot.
* ``seq``: its commit order, unique among the items held: a larger ``seq`` is newer data (an
  episode's rows in order, first to last). An item an aborted reservation publishes again
  comes back with the ``seq`` it had, so it takes its old place, never the newest one. Only
  the order means anything: a resumed buffer numbers its items afresh, in the same order.

**Rules.** The concurrency rule first, as Reverb's header states its own:

* Calls are serialised by the buffer's owner (the daemon loop, or the caller of an in-process
  ``Buffer``) and come from the shared layer only: a selector takes no locks, never blocks and
  never sleeps. Every method is O(k log C) or better for k items (C the capacity) and
  ``select`` O(n log C) for n items, so the daemon loop never stalls on one.
* :meth:`insert` gets items not held; :meth:`delete` and :meth:`update` get slots of held items;
  the slots of one call are distinct. Retired items (``max_times_sampled``) are deleted by the
  shared layer, which applies that option for every selector.
* :meth:`select` is called with ``1 <= n <=`` the number of items held: the shared layer checks,
  and raises :class:`~shmbuffer.errors.EmptyBufferError` naming how many are live otherwise.
  It returns ``n`` *distinct* held items (no slot twice in one selection; a later call may
  select an item again, unless the shared layer retired it), best first, and the probability
  each was selected with. It is a function of the items held (slots, seqs, priorities), the
  selector's :meth:`state_dict` and the generator only, and changes nothing unless the class
  declares ``draws_change_state``: a journal's replay must select again exactly what was
  selected.
* Priorities are float64, finite and >= 0, checked by the shared layer as the prioritized
  sampler checks them (:func:`~shmbuffer.samplers.base.check_priority`), which also gives new
  data its default (the largest priority seen so far). A selector that declares
  ``has_priorities = False`` gets zeros.
* :meth:`state_dict` is what the selector keeps beyond its items: the shared layer saves the
  items, priorities and counts itself and inserts them again before :meth:`load_state_dict`,
  so a selector whose draws are a function of its items keeps nothing.

**Declarations** (:class:`~shmbuffer.samplers.declare.Declared`, plus the few below):
``name`` (``--sampler``), ``options`` (the constructor's keywords; ``max_times_sampled`` is
every sampler's), ``has_priorities``, ``uses_rng``, ``draws_change_state`` and ``anchor``.
A selector never consumes by itself (``consumes`` and ``waits_for_data`` stay False):
``max_times_sampled`` is what makes its samples consume.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from shmbuffer.samplers.base import MAX_TIMES_SAMPLED, check_count
from shmbuffer.samplers.declare import Declared, Option

__all__ = ["ANCHORS", "Items", "Selection", "Selector"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

#: Where a selected item sits in what is drawn for it (see :attr:`Selector.anchor`).
ANCHORS = ("start", "end")


class Items(NamedTuple):
    """Items by ``slots`` (where each lives) and ``seqs`` (commit order): see the module
    docstring."""

    slots: I64
    seqs: I64


class Selection(NamedTuple):
    """``n`` distinct held items, best first, and the probability each was selected with."""

    slots: I64
    probability: F64


class Selector(Declared, ABC):
    """Which items to hand out, given which are live; see the module docstring for the rules."""

    options: tuple[Option[Any], ...] = (MAX_TIMES_SAMPLED,)
    #: Whether :meth:`select` takes numbers from the generator (the journal then keeps its
    #: state where a refused draw may have moved it).
    uses_rng: bool = True
    #: Whether :meth:`select` changes the selector's state (a journal then replays every draw).
    draws_change_state: bool = False
    #: Where a selected item sits in what the shared layer draws for it: ``"start"``, a slice
    #: begins at the selected row and an episode's rows are taken from its first; ``"end"``,
    #: a slice ends at the selected row and an episode's rows are taken from its last,
    #: backwards (a LIFO's newest data first).
    anchor: str = "start"

    def __init__(self, *, max_times_sampled: int | None = MAX_TIMES_SAMPLED.default) -> None:
        if max_times_sampled is not None:
            max_times_sampled = check_count(max_times_sampled, "max_times_sampled")
        #: Applied by the shared layer: an item selected this many times is deleted.
        self.max_times_sampled: int | None = max_times_sampled

    @abstractmethod
    def clear(self, capacity: int) -> None:
        """Hold nothing; slots lie in ``[0, capacity)`` from now on. Called when the shared
        layer is attached to a ring and when the ring is cleared."""

    @abstractmethod
    def insert(self, items: Items, priority: F64) -> None:
        """Hold ``items`` (none held yet), with one priority each."""

    @abstractmethod
    def delete(self, slots: I64) -> None:
        """Hold the items at ``slots`` no more (evicted, or retired)."""

    @abstractmethod
    def update(self, slots: I64, priority: F64) -> None:
        """Held items at ``slots`` take new priorities."""

    @abstractmethod
    def select(self, n: int, rng: np.random.Generator) -> Selection:
        """``n`` distinct held items, best first (``1 <= n <=`` items held)."""

    def state_dict(self) -> dict[str, Any]:
        """msgpack-able state beyond the items (none unless the selector keeps some)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take :meth:`state_dict` back; the items are held again already."""
        if state:
            raise ValueError(f"the {self.name} selector keeps no state, got {sorted(state)}")

    def stats(self) -> dict[str, Any]:
        """A few figures of its own for ``status`` (the shared layer adds the item counts)."""
        return {}

    def settings(self) -> dict[str, Any]:
        """The constructor options it was made with, one per declared option."""
        return {option.name: getattr(self, option.name) for option in self.options}
