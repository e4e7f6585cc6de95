"""The episode registry's storage: live episodes in id-ordered slot arrays, and the read-only
queries over them (positions, uniform draws).

:class:`SlotTable` is the half of :class:`~shmbuffer.registry.intervals.EpisodeRegistry` that knows
slots, running totals and spans but nothing of how episodes come and go; the registry adds the
overlap index and the mutations (see its module docstring for the whole design).

* Live episodes sit in growable numpy arrays (``ids``, ``starts``, ``ends``) in id order between
  a ``head`` and a ``tail`` slot, with an ``alive`` bool array for tombstones, compacted (pure
  numpy) once tombstones exceed 25 % of the live count. Ids strictly increase along the slots,
  so id -> slot is a binary search.
* Slot-aligned running totals of episode lengths (and, per requested slice length, of slice
  weights) answer position queries and slice draws with ``np.searchsorted``; row draws map
  through the *spans*, the maximal runs of adjacent live rows.

Thread safety: not thread-safe; the owner (container or daemon loop) serialises calls.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from shmbuffer.errors import EmptyBufferError
from shmbuffer.registry.spans import LiveSpans

__all__ = ["Episode", "SlotTable"]

I64 = npt.NDArray[np.int64]

_INITIAL_SLOTS = 64
_MAX_SLICE_CACHES = 8
#: Up to this many spans of adjacent live rows, row draws map positions through the spans;
#: beyond (a ring full of holes), through the running totals over episodes.
_MAX_SPANS = 64
#: Above this many live episodes, positions are sorted before their binary searches over the
#: running totals (cache and branch friendly there); at or below, the totals sit in the cache
#: and the sort costs more than it saves (figures in ``docs/architecture.md``).
_SORT_ABOVE = 1 << 16


class Episode(NamedTuple):
    """One live interval ``[start, end)`` of the ring and the id it was registered under.
    A NamedTuple: every reservation makes several (its evictions, its commit), and a frozen
    dataclass took twice as long to construct."""

    id: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


class SlotTable:
    """Slot arrays, running totals and spans of the live episodes; see the module docstring."""

    def __init__(self, capacity: int) -> None:
        capacity = operator.index(capacity)
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity: int = capacity
        self._next_id = 0
        self._reset_storage(_INITIAL_SLOTS)

    # ------------------------------------------------------------------ storage

    def _reset_arrays(self, slots: int) -> None:
        self._ids: I64 = np.zeros(slots, dtype=np.int64)
        self._starts: I64 = np.zeros(slots, dtype=np.int64)
        self._ends: I64 = np.zeros(slots, dtype=np.int64)
        self._alive: npt.NDArray[np.bool_] = np.zeros(slots, dtype=np.bool_)
        # Slot-aligned running totals (see _cum_valid): cum[s] - cum[s-1] == length of slot s.
        self._cum: I64 = np.zeros(slots, dtype=np.int64)

    def _reset_storage(self, slots: int) -> None:
        self._reset_arrays(slots)
        # slice length -> slot-aligned running total of max(length_s - slice_length + 1, 0)
        self._slice_cum: dict[int, I64] = {}
        self._head = 0
        self._tail = 0
        self._n_live = 0
        self._num_rows = 0
        # Sorted live starts, and start -> (end, id), for overlap queries.
        self._sorted_starts: list[int] = []
        self._by_start: dict[int, tuple[int, int]] = {}
        self._spans = LiveSpans()

    @property
    def _tombstones(self) -> int:
        return self._tail - self._head - self._n_live

    def _compact(self, slots: int | None = None) -> None:
        """Move live entries to slots ``0..n_live-1``, optionally into arrays of ``slots``."""
        h, t, n = self._head, self._tail, self._n_live
        mask = self._alive[h:t]
        ids = self._ids[h:t][mask]
        starts = self._starts[h:t][mask]
        ends = self._ends[h:t][mask]
        if slots is not None and slots != len(self._ids):
            self._reset_arrays(slots)
        else:
            self._alive[:t] = False
        self._ids[:n] = ids
        self._starts[:n] = starts
        self._ends[:n] = ends
        self._finish_rebuild(n)

    def _finish_rebuild(self, n: int) -> None:
        """Slots ``0..n-1`` hold the live entries in id order: mark them, redo the totals."""
        self._alive[:n] = True
        np.cumsum(self._ends[:n] - self._starts[:n], out=self._cum[:n])
        self._slice_cum = {}  # rebuilt lazily
        self._head = 0
        self._tail = n

    def _compact_if_needed(self) -> None:
        if self._tombstones:
            self._compact()

    def _ensure_room(self, k: int = 1) -> None:
        """Free slots for ``k`` more entries after the tail: compact, growing if half full."""
        size = len(self._ids)
        if self._tail + k <= size:
            return
        need = (self._n_live + k) * 2
        if need <= size:
            self._compact()
        else:
            self._compact(max(size * 2, need))

    def _slot_of(self, episode_id: int) -> int | None:
        if self._n_live == 0:
            return None
        h, t = self._head, self._tail
        # The oldest (FIFO eviction, trims) and newest entries are what writes touch: an
        # element compare each, far cheaper than the binary search with its call.
        ids = self._ids
        if ids[h] == episode_id:  # the head and the tail slot are always live
            return h
        if ids[t - 1] == episode_id:
            return t - 1
        slot = h + int(ids[h:t].searchsorted(episode_id))
        if slot < t and self._ids[slot] == episode_id and self._alive[slot]:
            return slot
        return None

    def _episode_at_slot(self, slot: int) -> Episode:
        return Episode(int(self._ids[slot]), int(self._starts[slot]), int(self._ends[slot]))

    @property
    def spans(self) -> LiveSpans:
        """The maximal runs of adjacent live rows (read them; the registry changes them)."""
        return self._spans

    # ------------------------------------------------------------------ positions

    def _row_base(self) -> int:
        """Compact if needed; return the running total of rows before the head slot.

        Without tombstones, the running totals of slots ``[head, tail)`` differ by exactly the
        episode lengths, so logical row ``r`` has the absolute total ``r + base``. Adds append
        to the totals and head removals just move ``head``: neither needs a rebuild.
        """
        self._compact_if_needed()
        h = self._head
        return int(self._cum[h] - (self._ends[h] - self._starts[h]))

    def at(self, position: int) -> Episode:
        """The live episode at chronological ``position`` (negative counts from the newest)."""
        position = operator.index(position)
        n = self._n_live
        if not -n <= position < n:
            raise IndexError(f"episode position {position} out of range for {n} live episodes")
        self._compact_if_needed()
        return self._episode_at_slot(self._head + position % n)

    @staticmethod
    def _positions(positions: npt.ArrayLike, size: int, what: str) -> I64:
        pos = np.asarray(positions)
        if pos.dtype.kind not in "iu" and pos.size:
            raise TypeError(f"{what} positions must be integers, got dtype {pos.dtype}")
        pos = pos.astype(np.int64, copy=False)
        pos = np.where(pos < 0, pos + size, pos)
        bad = (pos < 0) | (pos >= size)
        if bad.any():
            first = int(np.asarray(positions).reshape(-1)[int(np.argmax(bad.reshape(-1)))])
            raise IndexError(f"{what} position {first} out of range for {size} live {what}s")
        return pos

    def at_many(self, positions: npt.ArrayLike) -> tuple[I64, I64, I64]:
        """``(ids, starts, ends)`` of the episodes at chronological ``positions``."""
        pos = self._positions(positions, self._n_live, "episode")
        self._compact_if_needed()
        slots = pos + self._head
        return self._ids[slots], self._starts[slots], self._ends[slots]

    @staticmethod
    def _search(cum: I64, r: I64) -> I64:
        """``np.searchsorted(cum, r, side="right")``, the keys sorted first for a long ``cum``
        (:data:`_SORT_ABOVE`)."""
        if len(cum) <= _SORT_ABOVE:
            found: I64 = cum.searchsorted(r, side="right")
            return found
        order = np.argsort(r)
        idx = np.empty_like(order)
        idx[order] = cum.searchsorted(r[order], side="right")
        return idx

    def _rows_from_absolute(self, r: I64) -> I64:
        """Physical rows of absolute running-total positions ``r`` (no tombstones)."""
        h, t = self._head, self._tail
        idx = self._search(self._cum[h:t], r) + h
        out: I64 = self._ends[idx] - (self._cum[idx] - r)
        return out

    def rows_at(self, positions: npt.ArrayLike, checked: bool = False) -> I64:
        """Physical rows of logical row ``positions`` (live episodes concatenated, oldest first).
        ``checked``: the caller already made them int64 in ``[0, num_rows)`` (a Buffer's
        ``normalize_index``), so they are not checked twice."""
        pos = positions if checked else self._positions(positions, self._num_rows, "row")
        assert isinstance(pos, np.ndarray)
        if pos.size == 0:
            return pos
        return self._rows_from_absolute(pos + self._row_base())

    # ------------------------------------------------------------------ sampling

    @staticmethod
    def _check_n(n: int) -> int:
        n = operator.index(n)
        if n <= 0:
            raise ValueError(f"sample size must be >= 1, got {n}")
        return n

    def _empty(self, what: str) -> EmptyBufferError:
        return EmptyBufferError(
            f"cannot sample {what}: {self._n_live} live episodes, {self._num_rows} rows"
        )

    def sample_episodes(self, n: int, rng: np.random.Generator) -> tuple[I64, I64, I64]:
        """``n`` episodes drawn uniformly with replacement: ``(ids, starts, ends)``."""
        n = self._check_n(n)
        if self._n_live == 0:
            raise self._empty("episodes")
        slots = rng.integers(self._head, self._tail, size=n)
        if self._tombstones:
            dead = np.flatnonzero(~self._alive[slots])
            while dead.size:
                slots[dead] = rng.integers(self._head, self._tail, size=dead.size)
                dead = dead[~self._alive[slots[dead]]]
        return self._ids[slots], self._starts[slots], self._ends[slots]

    def sample_rows(self, n: int, rng: np.random.Generator) -> I64:
        """``n`` physical rows drawn uniformly (with replacement) from all live rows.

        A draw is a position among the live rows in ring order, mapped through the spans
        (:meth:`LiveSpans.draw`: one addition while the live rows are one contiguous run, one
        search over the spans while they are a few: a wrapped ring, rows in flight), or
        through the running totals over episodes beyond :data:`_MAX_SPANS` spans.
        """
        n = self._check_n(n)
        if self._num_rows == 0:
            raise self._empty("rows")
        spans = self._spans
        if spans.count > _MAX_SPANS:
            base = self._row_base()
            return self._rows_from_absolute(rng.integers(base, base + self._num_rows, size=n))
        return spans.draw(rng, self._num_rows, n)

    def sample_slices(self, n: int, length: int, rng: np.random.Generator) -> I64:
        """Physical start rows of ``n`` slices of ``length`` rows, each inside one episode.

        Uniform over all valid slice starts: an episode of ``L >= length`` rows has weight
        ``L - length + 1``; shorter episodes are never chosen.
        """
        n = self._check_n(n)
        length = operator.index(length)
        if length < 1:
            raise ValueError(f"slice length must be >= 1, got {length}")
        if self._n_live == 0:
            raise self._empty(f"slices of {length} rows")
        self._compact_if_needed()
        h, t = self._head, self._tail
        cum = self._slice_cum.get(length)
        if cum is None:
            if len(self._slice_cum) >= _MAX_SLICE_CACHES:
                self._slice_cum.clear()
            cum = np.zeros(len(self._ids), dtype=np.int64)
            np.cumsum(
                np.maximum(self._ends[h:t] - self._starts[h:t] - (length - 1), 0), out=cum[h:t]
            )
            self._slice_cum[length] = cum
        lead = int(max(self._ends[h] - self._starts[h] - (length - 1), 0))
        base = int(cum[h]) - lead
        total = int(cum[t - 1]) - base
        if total <= 0:
            raise self._empty(f"slices of {length} rows (no episode is long enough)")
        r = rng.integers(base, base + total, size=n)
        idx = self._search(cum[h:t], r) + h
        weights = np.maximum(self._ends[idx] - self._starts[idx] - (length - 1), 0)
        out: I64 = self._starts[idx] + (r - (cum[idx] - weights))
        return out
