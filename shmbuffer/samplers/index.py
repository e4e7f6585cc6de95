"""The samplers' per-row mirror of the live episodes, and per-slice-length masses.

The registry answers "which episodes" in O(log n); a sampler that has just drawn a row by
priority needs the opposite, "which episode holds row r", for hundreds of rows at once.
:class:`EpisodeIndex` answers it with three arrays, vectorised:

* ``end_of_row[r]``: end of the live episode holding row ``r``; 0 for rows without committed
  data (an end is always >= 1, so 0 is free);
* ``start_by_end[e]`` and ``id_by_end[e]``: start and id of the live episode ending at ``e``
  (live episodes are disjoint, so ends are unique). A trim moves a start and keeps the end,
  which is why the mirror is keyed by ends: trimming is O(1) instead of rewriting every row.

Invariant: after every ``add``/``apply`` the mirror holds exactly the registry's episodes.
``removals`` reconciles against the registry after it changed, so the owner only says which
rows went; whole-episode drops and trimmed tails are read from the registry. Cost: O(k) numpy
work per k rows added or removed (the order of the row copy) and O(log n) per episode touched.

:class:`SliceMass` keeps, for one slice length ``l``, the total weight and count of the
*tail* leaves (rows ``r`` with ``end(r) - r < l``: no full slice starts there) and of the
*short-first* leaves (first rows of episodes shorter than ``l``). Slice samplers use them for
exact normalisers without scanning. Row membership depends only on ``end(r) - r`` and on
being a first row, and a trim keeps ends, so every change is local to the rows it touches.
Float sums drift by rounding, so a mass over real-valued weights is rebuilt exactly (O(C))
once more than C leaf changes have gone through it (amortised O(1)); counts are exact.

Not thread-safe; the owning sampler serialises calls.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from shmbuffer.registry.intervals import Episode, EpisodeRegistry

__all__ = ["EpisodeIndex", "Graveyard", "Removal", "SliceMass", "SliceMasses", "rows_of"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
Rows = npt.NDArray[np.signedinteger[Any]]

_BLOCK = 1 << 20  # rows per step of a full rebuild: bounds its temporaries


@dataclass(frozen=True, slots=True)
class Removal:
    """An episode the registry no longer holds whole: rows ``[start, stop)`` went away."""

    id: int
    start: int
    end: int
    #: New first row of the tail that survived a trim, or None when the episode went whole.
    survivor: int | None

    @property
    def stop(self) -> int:
        return self.end if self.survivor is None else self.survivor


def rows_of(starts: Iterable[int], stops: Iterable[int]) -> I64:
    """The rows of the ranges ``[starts[i], stops[i])``, concatenated."""
    parts = [np.arange(s, e, dtype=np.int64) for s, e in zip(starts, stops, strict=True)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class EpisodeIndex:
    """Row -> episode lookups for the samplers; see the module docstring."""

    def __init__(self, capacity: int) -> None:
        dtype = np.int32 if capacity < np.iinfo(np.int32).max else np.int64
        self.capacity = capacity
        self.end_of_row: Rows = np.zeros(capacity, dtype=dtype)
        self.start_by_end: Rows = np.zeros(capacity + 1, dtype=dtype)
        self.id_by_end: I64 = np.zeros(capacity + 1, dtype=np.int64)
        self.num_rows = 0
        self.num_episodes = 0

    def add(self, episodes: Iterable[Episode]) -> None:
        """Mirror just-committed episodes; ValueError (nothing added) if one is not free."""
        episodes = list(episodes)
        for ep in episodes:
            if not 0 <= ep.start < ep.end <= self.capacity:
                raise ValueError(f"episode {ep} is outside the ring [0, {self.capacity})")
            if self.end_of_row[ep.start : ep.end].any():
                raise ValueError(f"episode {ep} overlaps rows the sampler holds as live")
        for ep in episodes:
            self.end_of_row[ep.start : ep.end] = ep.end
            self.start_by_end[ep.end] = ep.start
            self.id_by_end[ep.end] = ep.id
            self.num_rows += ep.length
            self.num_episodes += 1

    def removals(self, start: int, stop: int, registry: EpisodeRegistry) -> list[Removal]:
        """What evicting rows ``[start, stop)`` removed, read from the registry; no change."""
        start, stop = max(int(start), 0), min(int(stop), self.capacity)
        if start >= stop:
            return []
        ends = np.unique(self.end_of_row[start:stop])
        out = []
        for e in ends[ends > 0].tolist():
            s, episode_id = int(self.start_by_end[e]), int(self.id_by_end[e])
            survivor = None
            if episode_id in registry:
                now = registry.get(episode_id)
                if now.start == s and now.end == e:
                    continue  # untouched: nothing of it went away
                if now.end == e and s < now.start < e:
                    survivor = now.start
            out.append(Removal(episode_id, s, e, survivor))
        return out

    def apply(self, removals: Iterable[Removal]) -> None:
        for rm in removals:
            self.end_of_row[rm.start : rm.stop] = 0
            self.num_rows -= rm.stop - rm.start
            if rm.survivor is None:
                self.start_by_end[rm.end] = 0
                self.num_episodes -= 1
            else:
                self.start_by_end[rm.end] = rm.survivor

    def restore(self, episodes: Iterable[Episode]) -> list[int | None]:
        """Mirror episodes published again under their old ids; for each, the first row its
        live remnant had (a trimmed chunk getting its front back), or None if it was gone."""
        episodes = list(episodes)
        before: list[int | None] = []
        for ep in episodes:
            e = ep.end
            live = self.end_of_row[e - 1] == e and self.id_by_end[e] == ep.id
            first = int(self.start_by_end[e]) if live else ep.end
            if not 0 <= ep.start <= first <= ep.end <= self.capacity:
                raise ValueError(f"cannot restore {ep}: its live part starts at {first}")
            if self.end_of_row[ep.start : first].any():
                raise ValueError(f"cannot restore {ep}: its rows hold other live data")
            before.append(first if live else None)
        for ep, now in zip(episodes, before, strict=True):
            stop = ep.end if now is None else now
            self.end_of_row[ep.start : stop] = ep.end
            self.start_by_end[ep.end] = ep.start
            self.id_by_end[ep.end] = ep.id
            self.num_rows += stop - ep.start
            self.num_episodes += now is None
        return before

    def clear(self) -> None:
        self.end_of_row[:] = 0
        self.start_by_end[:] = 0
        self.num_rows = self.num_episodes = 0

    def is_live(self, rows: I64) -> npt.NDArray[np.bool_]:
        out: npt.NDArray[np.bool_] = self.end_of_row[rows] > 0
        return out

    def lookup(self, rows: I64) -> tuple[I64, I64, I64]:
        """``(ids, starts, ends)`` of the episodes holding live ``rows``."""
        ends = self.end_of_row[rows].astype(np.int64)
        return self.id_by_end[ends], self.start_by_end[ends].astype(np.int64), ends

    def is_first(self, rows: I64) -> npt.NDArray[np.bool_]:
        """Whether each live row is the first row of its episode."""
        out: npt.NDArray[np.bool_] = self.start_by_end[self.end_of_row[rows]] == rows
        return out

    def live_rows(self) -> I64:
        return np.flatnonzero(self.end_of_row)

    def live_starts(self) -> I64:
        """First rows of the live episodes, ascending by row (O(C))."""
        rows = np.flatnonzero(self.end_of_row)
        out: I64 = rows[self.start_by_end[self.end_of_row[rows]] == rows]
        return out


class SliceMass:
    """Tail and short-first weight for one slice length; see the module docstring."""

    def __init__(self, length: int, exact: bool) -> None:
        self.length = length
        #: Unit weights only (exact sums): never needs a rebuild.
        self.exact = exact
        self.tail_mass = 0.0
        self.tail_count = 0
        self.first_mass = 0.0
        self.first_count = 0
        self._changes = 0

    def stale(self, capacity: int) -> bool:
        return not self.exact and self._changes > capacity

    def change(self, index: EpisodeIndex, rows: I64, old: F64, new: F64) -> None:
        """Leaves ``rows`` (live in ``index`` now) go from weight ``old`` to ``new``."""
        if rows.size == 0:
            return
        ends = index.end_of_row[rows].astype(np.int64)
        tail = ends - rows < self.length
        if not tail.any():
            return
        self._changes += rows.size
        rows, ends, old, new = rows[tail], ends[tail], old[tail], new[tail]
        delta = new - old
        counted = (new > 0).astype(np.int64) - (old > 0)
        self.tail_mass += float(delta.sum())
        self.tail_count += int(counted.sum())
        first = index.start_by_end[ends] == rows
        if first.any():
            self.first_mass += float(delta[first].sum())
            self.first_count += int(counted[first].sum())

    def gain_first(self, index: EpisodeIndex, rows: I64, weights: F64) -> None:
        """``rows`` just became first rows (the tails that survived a trim)."""
        short = index.end_of_row[rows].astype(np.int64) - rows < self.length
        self.first_mass += float(weights[short].sum())
        self.first_count += int((weights[short] > 0).sum())

    def rebuild(self, index: EpisodeIndex, leaves: F64 | None) -> None:
        """Recompute from scratch; ``leaves=None`` means weight 1 on every live row."""
        self.tail_mass = self.first_mass = 0.0
        self.tail_count = self.first_count = 0
        for lo in range(0, index.capacity, _BLOCK):
            hi = min(lo + _BLOCK, index.capacity)
            ends = index.end_of_row[lo:hi].astype(np.int64)
            rows = np.arange(lo, hi, dtype=np.int64)
            w = (ends > 0).astype(np.float64) if leaves is None else leaves[lo:hi]
            tail = (ends > 0) & (ends - rows < self.length) & (w > 0)
            first = tail & (index.start_by_end[ends] == rows)
            self.tail_mass += float(w[tail].sum())
            self.tail_count += int(tail.sum())
            self.first_mass += float(w[first].sum())
            self.first_count += int(first.sum())
        self._changes = 0


class SliceMasses:
    """The :class:`SliceMass` of each recently used slice length (at most a few)."""

    MAX_LENGTHS = 8

    def __init__(self, exact: bool) -> None:
        self.exact = exact
        self._by_length: dict[int, SliceMass] = {}

    def has_lengths(self) -> bool:
        return bool(self._by_length)

    def get(self, length: int, index: EpisodeIndex, leaves: F64 | None) -> SliceMass:
        mass = self._by_length.get(length)
        if mass is None:
            if len(self._by_length) >= self.MAX_LENGTHS:
                del self._by_length[next(iter(self._by_length))]
            mass = self._by_length[length] = SliceMass(length, self.exact)
            mass.rebuild(index, leaves)
        elif mass.stale(index.capacity):
            mass.rebuild(index, leaves)
        return mass

    def change(self, index: EpisodeIndex, rows: I64, old: F64, new: F64) -> None:
        for mass in self._by_length.values():
            mass.change(index, rows, old, new)

    def gain_first(self, index: EpisodeIndex, rows: I64, weights: F64) -> None:
        for mass in self._by_length.values():
            mass.gain_first(index, rows, weights)

    def clear(self) -> None:
        self._by_length.clear()


class Graveyard:
    """Per-row sampler state of recently evicted rows, for an abort that publishes them again.

    ``bury(id, start, stop, *columns)`` keeps the columns (one value per row of
    ``[start, stop)``) under the episode's id; the oldest entries go once more than ``budget``
    rows are kept, so memory stays bounded (a restore only ever concerns the evictions of
    reservations still open, the newest ones).
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._by_id: OrderedDict[int, list[tuple[int, int, tuple[npt.NDArray[Any], ...]]]]
        self._by_id = OrderedDict()
        self._rows = 0

    def bury(self, episode_id: int, start: int, stop: int, *columns: npt.NDArray[Any]) -> None:
        self._by_id.setdefault(episode_id, []).append((start, stop, columns))
        self._by_id.move_to_end(episode_id)
        self._rows += stop - start
        while self._rows > self.budget and self._by_id:
            _, parts = self._by_id.popitem(last=False)
            self._rows -= sum(e - s for s, e, _ in parts)

    def exhume(
        self, episode_id: int, start: int, stop: int, defaults: tuple[npt.NDArray[Any], ...]
    ) -> tuple[npt.NDArray[Any], ...]:
        """The buried values for rows ``[start, stop)`` of ``episode_id``, ``defaults`` (arrays
        of ``stop - start`` values, filled in place) where nothing is kept; forgets the id."""
        for s, e, columns in self._by_id.pop(episode_id, []):
            self._rows -= e - s
            lo, hi = max(s, start), min(e, stop)
            if lo < hi:
                for out, col in zip(defaults, columns, strict=True):
                    out[lo - start : hi - start] = col[lo - s : hi - s]
        return defaults

    def clear(self) -> None:
        self._by_id.clear()
        self._rows = 0
