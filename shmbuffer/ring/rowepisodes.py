"""Which registry entry holds each row of a ring, kept from the ring's notifications: where a
read that reaches past a drawn row (an n-step return, ``shmbuffer/api/nstep.py``; a frame
stack) finds the ends of its episode."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from shmbuffer.registry.intervals import Episode
from shmbuffer.ring.listeners import F64, Range, RingListener
from shmbuffer.ring.members import Members
from shmbuffer.ring.ring import Ring
from shmbuffer.samplers.index import EpisodeIndex

__all__ = ["RowEpisodes"]

I64 = npt.NDArray[np.int64]


class RowEpisodes(RingListener):
    """Which registry entry holds each row of ``ring``: an :class:`EpisodeIndex` kept up to
    date from the ring's notifications (registered by the constructor)."""

    def __init__(self, ring: Ring) -> None:
        self.ring = ring
        self.index = EpisodeIndex(ring.capacity)
        self.index.add(ring.registry)
        ring.listen(self)

    def on_commit(
        self,
        episodes: Sequence[Episode],
        ranges: Sequence[Range],
        priority: F64 | None,
        members: Members = None,
    ) -> None:
        self.index.add(episodes)

    def on_evict(self, start: int, stop: int, evicted: Sequence[Episode], rows: int) -> None:
        self.index.apply(self.index.removals(start, stop, self.ring.registry))

    def on_restore(self, episodes: Sequence[Episode], rows: int) -> None:
        self.index.restore(episodes)

    def on_clear(self, rows: int) -> None:
        self.index.clear()

    def on_load(self) -> None:
        self.index.clear()
        self.index.add(self.ring.registry)

    def rows_left(self, rows: I64) -> I64:
        """For each live row, the rows of its episode from it on (itself included), through
        the ring's end into row 0 where the ring says the entry there goes on."""
        index, capacity = self.index, self.ring.capacity
        ends = index.end_of_row[rows].astype(np.int64)
        left: I64 = ends - rows
        split = self.ring.wrap_split
        if split >= 0 and int(index.id_by_end[capacity]) == split and index.end_of_row[0] > 0:
            after = int(index.end_of_row[0])  # the entry at row 0: the split's second part?
            if int(index.start_by_end[after]) == 0 and int(index.id_by_end[after]) == split + 1:
                left = np.where(ends == capacity, left + after, left)
        return left

    def rows_before(self, rows: I64) -> I64:
        """For each live row, the rows of its episode before it, back through row 0 to the
        ring's end where the ring says the entry at row 0 goes on from there."""
        index, capacity = self.index, self.ring.capacity
        ends = index.end_of_row[rows].astype(np.int64)
        starts = index.start_by_end[ends].astype(np.int64)
        before: I64 = rows - starts
        split = self.ring.wrap_split
        first = int(index.end_of_row[0])  # the entry at row 0, if any
        if (
            split >= 0
            and first > 0
            and int(index.id_by_end[first]) == split + 1
            and int(index.id_by_end[capacity]) == split
            and int(index.end_of_row[capacity - 1]) == capacity
        ):
            tail = capacity - int(index.start_by_end[capacity])
            before = np.where(ends == first, before + tail, before)
        return before

    def live(self, rows: I64) -> npt.NDArray[np.bool_]:
        """Which of ``rows`` lie in a registry entry (committed, not evicted)."""
        return np.asarray(self.index.end_of_row[rows] > 0)

    def ids(self, rows: I64) -> I64:
        """The registry id of each live row's entry."""
        return self.index.id_by_end[self.index.end_of_row[rows]]

    def episode_spans(self, rows: I64, tail: int = 0) -> list[tuple[int, int]]:
        """The ``[start, stop)`` row ranges of the episodes the live ``rows`` lie in
        (following one the ring's end split into two entries), their ``tail`` rows too, each
        once; a range that would pass the ring's end is cut there in two."""
        if not rows.size:
            return []
        firsts = rows - self.rows_before(rows)
        lasts = rows + self.rows_left(rows) + tail  # one past
        capacity = self.ring.capacity
        starts, first = np.unique(firsts % capacity, return_index=True)  # one per episode
        out = []
        for start, length in zip(starts.tolist(), (lasts - firsts)[first].tolist(), strict=True):
            stop = start + length
            out.append((start, min(stop, capacity)))
            if stop > capacity:
                out.append((0, stop - capacity))
        return out
