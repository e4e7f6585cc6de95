"""The shared layer: a narrow :class:`~shmbuffer.samplers.selector.Selector` served as a wide
:class:`~shmbuffer.samplers.base.Sampler`. Items go in; rows, episodes and slices come out.

:class:`SelectorSampler` is what the container holds for a selector (``make_sampler`` wraps
one). It follows the ring through the wide contract's events: a commit inserts the new items,
an eviction deletes the evicted ones (in transition unit the front rows of a trimmed chunk
too), an abort's restore inserts them again with the commit order (``seq``), priority and
count they had, a clear clears. Items are rows in transition unit (slot = row) and episodes in
episode unit (slot = the episode's first row, which never moves there).

**Draw shapes.** Every call hands out distinct items and never the same row twice; the
selector's ``anchor`` says where a selected item sits in what is drawn for it (``"start"``:
the heaps, whose slices start at the selected row as the prioritized sampler's do, so a
slice's priority is its first row's; ``"end"``: LIFO, so that the newest slices hold the
newest rows). ``probability`` is the selection probability of the item each piece was drawn
for (1 for the deterministic selectors); weights are ones.

* Transition unit. ``sample_rows(n)``: the ``n`` rows selected. ``sample_episodes(n)``: the
  chunks holding the rows the selector ranks first, each once, in the order of their first
  row to come (LIFO: the ``n`` newest chunks; a heap: the ``n`` chunks whose best row ranks
  highest). ``sample_slices(n, length)``: ``n`` disjoint slices, each inside one chunk, one at
  each row the selector ranks first that can anchor one: a row whose slice would leave its
  chunk or overlap a slice already taken in the call is passed over. ``strict=False`` also
  admits each chunk shorter than ``length``, whole, at its first row (start) or its last
  (end).
* Episode unit. ``sample_episodes(n)``: the ``n`` episodes selected. ``sample_rows(n)``: the
  rows of the episodes the selector ranks first, in that order, each episode's from its
  first row on (start) or from its last row back (end: LIFO's ``n`` newest rows, newest
  first); the last one may give part of its rows. ``sample_slices(n, length)``: one slice per
  episode the selector ranks first, its first ``length`` rows (start) or its last (end);
  ``strict=True`` passes over episodes shorter than ``length``, ``strict=False`` hands them
  out whole.

Shapes that need more items than they return ask the selector again for four times as many
until they are served or every held item was ranked, so a call costs what the selector's
``select`` costs for about the items it visits (a slice walk visits about ``n * length`` rows
for LIFO), plus a Python step per candidate slice or chunk.

**Priorities** (selectors declaring ``has_priorities``) are taken as the prioritized sampler
takes them: on commit a scalar, one per item, or None for the largest priority seen so far
(initially 1; it never decays); ``update_priorities`` sets the items holding the given rows
(in episode unit their episodes), a repeated row taking its last value, rows holding no data
and retired items skipped; the same checks (:func:`~shmbuffer.samplers.base.check_priority`).
They are kept here per slot, beside the selector's own copy: an eviction leaves them in
place, so an abort's restore finds them, and ``state_dict`` saves them.

**max_times_sampled=K**, for every selector: an item handed out K times is retired (deleted
from the selector) until its rows are overwritten; in transition unit every row of a slice
counts, in episode unit every episode a call takes rows from. A call that cannot be served
changes nothing. It counts rows in transition unit, so ``sample_episodes`` is refused there,
as the prioritized sampler refuses it.

Costs: a commit or eviction of k rows is O(k) numpy work here plus the selector's ``insert``
or ``delete``; memory 8 B per row for the commit order and 16 B for the episode index, plus 8
for priorities (``has_priorities``) and 8 for counts (K), on top of the selector's.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from shmbuffer.errors import EmptyBufferError
from shmbuffer.registry.intervals import Episode, EpisodeRegistry
from shmbuffer.samplers.base import (
    Draw,
    EpisodeDraw,
    Priority,
    Sampler,
    SliceDraw,
    check_count,
    check_update,
    from_bytes,
    to_bytes,
)
from shmbuffer.samplers.index import rows_of
from shmbuffer.samplers.prioritized import last_writes
from shmbuffer.samplers.selector import ANCHORS, Items, Selection, Selector

__all__ = ["SelectorSampler"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

#: How much more a shape asks the selector for, each time the items ranked did not serve it.
_GROWTH = 4


def _runs(first: I64, take: I64, step: int) -> I64:
    """For each ``i``, ``take[i]`` rows from ``first[i]`` by ``step`` (+1 or -1), concatenated."""
    within = np.arange(int(take.sum()), dtype=np.int64) - np.repeat(np.cumsum(take) - take, take)
    out: I64 = np.repeat(first, take) + step * within
    return out


class SelectorSampler(Sampler):
    """A :class:`~shmbuffer.samplers.selector.Selector` served as a Sampler; see the module
    docstring. Its name, options and capabilities are its selector's."""

    def __init__(self, selector: Selector) -> None:
        if not isinstance(selector, Selector):
            raise TypeError(f"SelectorSampler serves a Selector, got {type(selector).__name__}")
        if selector.anchor not in ANCHORS:
            raise ValueError(f"selector anchor {selector.anchor!r}: expected one of {ANCHORS}")
        self.selector = selector
        self.name = selector.name
        self.options = selector.options
        self.has_priorities = selector.has_priorities
        self.consumes = selector.consumes
        self.waits_for_data = selector.waits_for_data
        self.uses_rng = selector.uses_rng
        self._max_priority = 1.0
        self._retired_total = 0
        super().__init__(max_times_sampled=selector.max_times_sampled)
        self._reset()

    def settings(self) -> dict[str, Any]:
        return self.selector.settings()

    @property
    def draws_change_state(self) -> bool:
        return self.max_times_sampled is not None or self.selector.draws_change_state

    def _reset(self) -> None:
        size = max(self.capacity, 1)
        #: Each slot's commit order (kept after an eviction, for an abort's restore).
        self._seq = np.zeros(size, dtype=np.int64)
        self._next_seq = 0
        self._priority = np.zeros(size if self.has_priorities else 0)
        self._times = np.zeros(size if self.max_times_sampled else 0, dtype=np.int64)
        self._held = 0  # items the selector holds: live and not retired
        self.selector.clear(self.capacity)

    # -- items -------------------------------------------------------------------------------

    def _slots(self, starts: Sequence[int], ends: Sequence[int]) -> I64:
        if self.unit == "episode":
            return np.asarray(starts, dtype=np.int64)
        return rows_of(starts, ends)

    def _unretired(self, slots: I64) -> I64:
        if not self.max_times_sampled:
            return slots
        out: I64 = slots[self._times[slots] < self.max_times_sampled]
        return out

    def _hold(self, slots: I64, priority: F64 | None = None) -> None:
        """The selector holds ``slots`` (live, unretired) again or for the first time."""
        if slots.size == 0:
            return
        if priority is None:
            priority = self._priority[slots] if self.has_priorities else np.zeros(slots.size)
        self.selector.insert(Items(slots, self._seq[slots]), priority)
        self._held += slots.size

    def _release(self, slots: I64) -> None:
        if slots.size:
            self.selector.delete(slots)
            self._held -= slots.size

    def _count(self, slots: I64) -> None:
        """One more hand-out of each of ``slots`` (distinct); retire those at K."""
        limit = self.max_times_sampled
        if not limit:
            return
        self._times[slots] += 1
        done = slots[self._times[slots] >= limit]
        self._release(done)
        self._retired_total += done.size

    # -- container events --------------------------------------------------------------------

    def on_commit(self, episodes: Sequence[Episode], priority: Priority = None) -> None:
        given = self.check_commit_priority(episodes, priority)
        slots = self._slots([ep.start for ep in episodes], [ep.end for ep in episodes])
        self.index.add(episodes)
        self._seq[slots] = np.arange(self._next_seq, self._next_seq + slots.size)
        self._next_seq += slots.size
        if self.max_times_sampled:
            self._times[slots] = 0
        if not self.has_priorities:
            self._hold(slots)
            return
        if given is None:
            given = np.full(slots.size, self._max_priority)
        elif given.size:
            self._max_priority = max(self._max_priority, float(given.max()))
        self._priority[slots] = given
        self._hold(slots, given)

    def on_evict(self, start: int, stop: int) -> None:
        removals = self.index.removals(start, stop, self.registry)
        if not removals:
            return
        # In episode unit an eviction drops whole episodes (the container's rule), so an
        # item's slot, its episode's first row, never moves.
        gone = self._slots([rm.start for rm in removals], [rm.stop for rm in removals])
        self._release(self._unretired(gone))
        self.index.apply(removals)

    def on_restore(self, episodes: Sequence[Episode], registry: EpisodeRegistry) -> None:
        self._registry = registry
        before = self.index.restore(episodes)
        starts, stops = [], []
        for ep, now in zip(episodes, before, strict=True):
            if now is None or self.unit == "transition":  # (whole episodes: see on_evict)
                starts.append(ep.start)
                stops.append(ep.end if now is None else now)
        # Evictions left their commit order, priority and count in place: they come back.
        self._hold(self._unretired(self._slots(starts, stops)))

    def on_clear(self) -> None:
        self.index.clear()
        self._reset()

    # -- drawing -----------------------------------------------------------------------------

    def _live(self) -> str:
        return f"{self._held} live{' and unretired' if self.max_times_sampled else ''}"

    def _select(self, n: int, rng: np.random.Generator) -> Selection:
        if n > self._held:
            items = "rows" if self.unit == "transition" else "episodes"
            raise EmptyBufferError(
                f"the {self.name} sampler cannot hand out {n} distinct {items}: {self._live()}"
            )
        return self.selector.select(n, rng)

    def _ranked(self, first: int, rng: np.random.Generator) -> Iterator[Selection]:
        """The selector's best ``first`` items, then ``_GROWTH`` times as many each time the
        caller asks again, up to every held item."""
        if self._held == 0:
            raise EmptyBufferError(f"the {self.name} sampler holds nothing: {self._live()}")
        m = min(max(first, 1), self._held)
        while True:
            yield self.selector.select(m, rng)
            if m == self._held:
                return
            m = min(m * _GROWTH, self._held)

    def sample_rows(self, n: int, rng: np.random.Generator) -> Draw:
        n = check_count(n, "n")
        if self.unit == "transition":
            picked = self._select(n, rng)
            self._count(picked.slots)
            return Draw(picked.slots, picked.probability)
        index = self.index
        mean = max(1, index.num_rows // max(index.num_episodes, 1))
        step = -1 if self.selector.anchor == "end" else 1
        total = 0
        for picked in self._ranked(-(-n // mean), rng):
            starts = picked.slots
            sizes = index.end_of_row[starts].astype(np.int64) - starts
            running = np.cumsum(sizes)
            total = int(running[-1])
            if total >= n:
                k = int(np.searchsorted(running, n)) + 1  # the first k episodes hold n rows
                take = sizes[:k].copy()
                take[-1] -= int(running[k - 1]) - n
                first = starts[:k] if step == 1 else starts[:k] + sizes[:k] - 1
                self._count(starts[:k])
                return Draw(_runs(first, take, step), np.repeat(picked.probability[:k], take))
        raise EmptyBufferError(
            f"the {self.name} sampler cannot hand out {n} distinct rows: {total} live, in "
            f"{self._live()} episodes"
        )

    def sample_episodes(self, n: int, rng: np.random.Generator) -> EpisodeDraw:
        n = check_count(n, "n")
        if self.unit == "episode":
            picked = self._select(n, rng)
            ids, starts, ends = self.index.lookup(picked.slots)
            self._count(picked.slots)
            return EpisodeDraw(ids, starts, ends, picked.probability)
        if self.max_times_sampled:
            raise ValueError(
                "max_times_sampled counts rows in transition unit; sample_episodes would hand "
                "out whole chunks past their count (use episode unit)"
            )
        if n > self.index.num_episodes:
            raise EmptyBufferError(
                f"the {self.name} sampler cannot hand out {n} distinct chunks: "
                f"{self.index.num_episodes} are live"
            )
        for picked in self._ranked(n, rng):
            ends = self.index.end_of_row[picked.slots]
            _, first = np.unique(ends, return_index=True)  # each chunk's best row
            if first.size >= n:
                order = np.sort(first)[:n]
                ids, starts, stops = self.index.lookup(picked.slots[order])
                return EpisodeDraw(ids, starts, stops, picked.probability[order])
        raise RuntimeError("every live row was ranked, yet fewer chunks were found than are live")

    def sample_slices(
        self, n: int, length: int, rng: np.random.Generator, strict: bool = True
    ) -> SliceDraw:
        n, length = check_count(n, "n"), check_count(length, "length")
        if self.unit == "episode":
            return self._episode_slices(n, length, rng, strict)
        index, end_anchor = self.index, self.selector.anchor == "end"
        found = 0
        # Disjoint slices of rows ranked in runs (LIFO's, equal priorities) take about
        # ``length`` rows each: ask for that many at once rather than grow towards it.
        for picked in self._ranked((n + 1) * length, rng):
            rows = picked.slots
            ends = index.end_of_row[rows].astype(np.int64)
            firsts = index.start_by_end[ends].astype(np.int64)
            lo, hi = (rows + 1 - length, rows + 1) if end_anchor else (rows, rows + length)
            fits = lo >= firsts if end_anchor else hi <= ends
            if not strict:  # a short chunk, whole, at its first (start) or last (end) row
                short = (ends - firsts < length) & (rows == (ends - 1 if end_anchor else firsts))
                lo, hi = np.where(short, firsts, lo), np.where(short, ends, hi)
                fits |= short
            taken = self._disjoint(np.flatnonzero(fits), lo, hi, n)
            found = taken.size
            if found == n:
                first, stop = lo[taken], hi[taken]
                self._count(rows_of(first, stop))  # every row of a slice is handed out
                return SliceDraw(first, stop - first, picked.probability[taken])
        raise EmptyBufferError(
            f"the {self.name} sampler cannot hand out {n} disjoint slices of {length} rows: "
            f"{found} fit its rows ({self._live()})"
        )

    def _disjoint(self, candidates: I64, lo: I64, hi: I64, n: int) -> I64:
        """The first ``n`` of ``candidates`` (in rank order) whose rows ``[lo, hi)`` overlap no
        earlier one taken (and, with K, hold no retired row)."""
        limit = self.max_times_sampled
        firsts: list[int] = []  # the slices taken, sorted by first row (they are disjoint)
        stops: list[int] = []
        out: list[int] = []
        starts, stops_at = lo[candidates].tolist(), hi[candidates].tolist()
        pieces = zip(candidates.tolist(), starts, stops_at, strict=True)
        for i, a, b in pieces:
            j = bisect.bisect_right(firsts, a)
            if (j and stops[j - 1] > a) or (j < len(firsts) and firsts[j] < b):
                continue
            if limit and bool((self._times[a:b] >= limit).any()):
                continue
            firsts.insert(j, a)
            stops.insert(j, b)
            out.append(i)
            if len(out) == n:
                break
        return np.asarray(out, dtype=np.int64)

    def _episode_slices(
        self, n: int, length: int, rng: np.random.Generator, strict: bool
    ) -> SliceDraw:
        found = 0
        for picked in self._ranked(n, rng):
            starts = picked.slots
            sizes = self.index.end_of_row[starts].astype(np.int64) - starts
            fits = np.flatnonzero(sizes >= length) if strict else np.arange(starts.size)
            found = fits.size
            if found >= n:
                take = fits[:n]
                lengths = np.minimum(sizes[take], length)
                first = starts[take]
                if self.selector.anchor == "end":
                    first = first + sizes[take] - lengths
                self._count(starts[take])
                return SliceDraw(first, lengths, picked.probability[take])
        raise EmptyBufferError(
            f"the {self.name} sampler cannot hand out {n} slices of {length} rows: {found} of "
            f"its episodes ({self._live()}) are that long"
        )

    # -- priorities --------------------------------------------------------------------------

    def update_priorities(self, rows: npt.ArrayLike, priority: npt.ArrayLike) -> int:
        if not self.has_priorities:
            return super().update_priorities(rows, priority)  # its refusal, naming the sampler
        idx, given = check_update(rows, priority, self.capacity, self.priority_limit)
        return self.set_priorities(idx, given)

    def set_priorities(self, rows: I64, priority: F64) -> int:
        if not self.has_priorities:
            return super().update_priorities(rows, priority)
        ends = self.index.end_of_row.take(rows)
        live = ends > 0
        keys, given = rows[live], priority[live]
        if self.unit == "episode":
            keys = self.index.start_by_end[ends[live]].astype(np.int64)
        if self.max_times_sampled:
            unretired = self._times[keys] < self.max_times_sampled
            keys, given = keys[unretired], given[unretired]
        if keys.size == 0:
            return 0
        slots, last = last_writes(keys, self.capacity)
        self._priority[slots] = given[last]
        self.selector.update(slots, given[last])
        self._max_priority = max(self._max_priority, float(given.max()))
        return int(keys.size)

    # -- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            **self._header(),
            "max_priority": self._max_priority,
            "retired_total": self._retired_total,
            "priorities": to_bytes(self._priority) if self.has_priorities else None,
            "times": to_bytes(self._times) if self.max_times_sampled else None,
            "selector": self.selector.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_state(state)
        max_priority = float(state["max_priority"])
        if not 0 <= max_priority < np.inf:
            raise ValueError(f"sampler state 'max_priority' = {max_priority} is not finite >= 0")
        priority = self._priority
        if self.has_priorities:
            if state.get("priorities") is None:
                raise ValueError("sampler state has no 'priorities'")
            priority = from_bytes(state["priorities"], np.float64, self.capacity, "priorities")
            if not np.all(np.isfinite(priority) & (priority >= 0)):
                raise ValueError("sampler state 'priorities' holds negative or non-finite values")
        times = self._times
        if self.max_times_sampled:
            times = np.zeros(self.capacity, dtype=np.int64)
            if state.get("times") is not None:
                times = from_bytes(state["times"], np.int64, self.capacity, "times")
        self._priority, self._times = priority, times
        self._max_priority = max_priority
        self._retired_total = int(state.get("retired_total", 0))
        # The selector holds every live item again, with the saved priorities and counts.
        self.selector.clear(self.capacity)
        self._held = 0
        index = self.index
        self._hold(
            self._unretired(index.live_rows() if self.unit == "transition" else index.live_starts())
        )
        self.selector.load_state_dict(dict(state.get("selector") or {}))

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "sampler": self.name,
            "unit": self.unit,
            "items": self._held,
            "retired": self._retired_total,
            "max_times_sampled": self.max_times_sampled,
        }
        if self.has_priorities:
            out["priority_max"] = self._max_priority
        return {**out, **self.selector.stats()}
