"""First in, first out: the oldest data first, in commit (id) order, and consume-once queues.

Without ``max_times_sampled`` nothing is consumed: every call walks from the oldest live data
(Reverb's FIFO selector, which keeps returning the oldest item). With ``max_times_sampled=K``
an item (row in transition unit, episode in episode unit) is *consumed* once it has been handed
out K times; calls walk from the oldest unconsumed data, and :meth:`FifoSampler.blocks_overwrite`
reports rows not consumed yet, so the owner makes writers wait instead of dropping on-policy
data. With nothing (or too little) to hand out a call raises EmptyBufferError and changes
nothing; the daemon turns that into a wait.

The walk, per call, visits pending items oldest first and never goes back, so one call never
returns the same rows twice and callers (serialised) get distinct data:

* ``sample_episodes(n)``: the next n items whole (in transition unit, a chunk's unconsumed
  remainder), one pass each.
* ``sample_slices(n, length)``: n consecutive slices, each inside one episode. In transition
  unit rows are counted one by one and the walk resumes at the oldest unconsumed row. In
  episode unit the walk keeps an offset inside the episode; the episode counts one pass when
  its last slice is handed out. With ``strict=True`` a remainder shorter than ``length`` can
  never be served: it is dropped (counted in ``stats()["dropped_rows"]``) and, with K set,
  counted as consumed so it does not hold writers back forever (a drop is kept even by a
  call that then finds too little and raises); with ``strict=False`` it is handed out as a
  shorter slice.
* ``sample_rows(n)``: the walk row by row (in runs), as slices of one row would go.

Invariant (K set): ``_items`` holds exactly the live items not yet consumed, ``_pending`` their
ids in commit order (plus ids since removed, skipped lazily). Counts survive eviction (a commit
resets them), so an aborted reservation's ``on_restore`` brings rows back consumed or not, as
they were. Costs: O(n + items visited) per
call, O(k) per k rows committed or evicted. ``probability`` is 1 (the order is deterministic).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from shmbuffer.errors import EmptyBufferError
from shmbuffer.registry.intervals import Episode, EpisodeRegistry
from shmbuffer.samplers.base import (
    MAX_TIMES_SAMPLED,
    Draw,
    EpisodeDraw,
    Priority,
    Sampler,
    SliceDraw,
    check_count,
    from_bytes,
    to_bytes,
)

__all__ = ["FifoSampler"]

I64 = npt.NDArray[np.int64]
#: One handed-out piece: (episode id, first row, rows).
Piece = tuple[int, int, int]
Ranges = list[tuple[int, int]]


@dataclass
class _Plan:
    """What a call would hand out, and what that changes; applied only if nothing is missing."""

    pieces: list[Piece] = field(default_factory=list)
    #: (id, cursor after the call) of each item visited; the cursor is its first row when a
    #: pass over it ended.
    passes: list[tuple[int, int]] = field(default_factory=list)
    #: Row ranges dropped unsampled: remainders shorter than a strict slice.
    dropped: Ranges = field(default_factory=list)
    #: Passes of items whose visit was only a drop (applied even when the call fails).
    drop_only: list[tuple[int, int]] = field(default_factory=list)
    drop_only_rows: Ranges = field(default_factory=list)
    missing: int = 0


class FifoSampler(Sampler):
    """Oldest first; consume-once with ``max_times_sampled``; see the module docstring."""

    name = "fifo"
    consumes = True
    waits_for_data = True
    uses_rng = False  # the order is deterministic

    def __init__(self, *, max_times_sampled: int | None = MAX_TIMES_SAMPLED.default) -> None:
        super().__init__(max_times_sampled=max_times_sampled)
        self._reset()

    def _reset(self) -> None:
        #: id -> [first live row, end, cursor]; the cursor is the oldest unconsumed row
        #: (transition unit) or the next row of the current pass (episode unit).
        self._items: dict[int, list[int]] = {}
        self._pending: deque[int] = deque()
        self._times = np.zeros(max(self.capacity, 1) if self.max_times_sampled else 0, np.int64)
        self._consumed = 0
        self._dropped_rows = 0
        #: Records of items evicted whole (the newest), for an abort that restores them.
        self._removed: OrderedDict[int, list[int]] = OrderedDict()

    @property
    def _limit(self) -> int:
        return self.max_times_sampled or 0

    # -- container events --------------------------------------------------------------------

    def on_commit(self, episodes: Sequence[Episode], priority: Priority = None) -> None:
        self.check_commit_priority(episodes, priority)
        self.index.add(episodes)
        for ep in episodes:
            self._items[ep.id] = [ep.start, ep.end, ep.start]
            self._pending.append(ep.id)
            if self._limit:
                self._times[ep.start : ep.end] = 0

    def on_evict(self, start: int, stop: int) -> None:
        # Counts stay in _times (a commit resets them): an abort may bring the rows back.
        removals = self.index.removals(start, stop, self.registry)
        for rm in removals:
            item = self._items.get(rm.id)
            if item is None:
                continue
            if rm.survivor is None:
                self._removed[rm.id] = self._items.pop(rm.id)
                if len(self._removed) > max(self.capacity, 1):
                    self._removed.popitem(last=False)
            else:
                item[0], item[2] = rm.survivor, max(item[2], rm.survivor)
        self.index.apply(removals)
        while self._pending and self._pending[0] not in self._items:
            self._pending.popleft()

    def on_restore(self, episodes: Sequence[Episode], registry: EpisodeRegistry) -> None:
        self._registry = registry
        self.index.restore(episodes)
        limit = self._limit
        for ep in episodes:
            item = self._items.get(ep.id) or self._removed.pop(ep.id, None)
            cursor = ep.start if item is None or self.unit == "transition" else item[2]
            if limit and self.unit == "transition":
                cursor = self._unconsumed(ep.start, ep.end)
                pending = cursor < ep.end
            else:
                pending = not limit or self._times[ep.start] < limit
            self._items.pop(ep.id, None)
            if pending:
                self._items[ep.id] = [ep.start, ep.end, cursor]
        self._pending = deque(sorted(self._items))

    def on_clear(self) -> None:
        self.index.clear()
        self._reset()

    # -- the walk ----------------------------------------------------------------------------

    def _walk_items(self) -> Iterator[tuple[int, list[int]]]:
        for episode_id in self._pending:
            item = self._items.get(episode_id)
            if item is not None:
                yield episode_id, item

    def _unconsumed(self, row: int, end: int) -> int:
        """First row in ``[row, end)`` handed out fewer than K times (``end`` if none); rows
        are counted one by one in transition unit only."""
        if self.unit == "episode" or not self._limit or row >= end:
            return row
        if self._times[row] < self._limit:
            return row
        free = np.flatnonzero(self._times[row:end] < self._limit)
        return row + int(free[0]) if free.size else end

    def _plan(self, n: int, length: int, strict: bool, whole: bool) -> _Plan:
        """The next ``n`` pieces (``n`` rows, in runs, when ``length == 0``); changes nothing."""
        plan = _Plan()
        consuming = bool(self._limit)
        need = n
        for episode_id, (first, end, cursor) in self._walk_items():
            if need == 0:
                break
            row = cursor if consuming else first
            if whole:
                row = self._unconsumed(first if self.unit == "episode" else row, end)
                if row < end:
                    plan.pieces.append((episode_id, row, end - row))
                    need -= 1
                plan.passes.append((episode_id, first))
                continue
            if self.unit == "transition":
                row = self._unconsumed(row, end)
            taken = len(plan.pieces)
            while need and row < end:
                room = end - row
                if length == 0:  # rows: one run of unconsumed rows
                    stop = min(end, row + need)
                    if consuming and self.unit == "transition":
                        used = np.flatnonzero(self._times[row:stop] >= self._limit)
                        stop = row + int(used[0]) if used.size else stop
                    size, need = stop - row, need - (stop - row)
                elif room < length and strict:
                    plan.dropped.append((row, end))
                    if len(plan.pieces) == taken:  # the visit was nothing but this drop
                        plan.drop_only.append((episode_id, first))
                        plan.drop_only_rows.append((row, end))
                    row = end
                    break
                else:
                    size, need = min(room, length), need - 1
                plan.pieces.append((episode_id, row, size))
                row += size
                if self.unit == "transition":
                    row = self._unconsumed(row, end)
            plan.passes.append((episode_id, first if row >= end else row))
        plan.missing = need
        return plan

    def _hand_out(
        self, passes: list[tuple[int, int]], pieces: list[Piece], dropped: Ranges
    ) -> None:
        limit = self._limit
        if not limit:
            return
        self._dropped_rows += sum(end - row for row, end in dropped)
        if self.unit == "episode":
            for episode_id, cursor in passes:
                item = self._items[episode_id]
                item[2] = cursor
                if cursor == item[0]:  # a pass over the episode ended
                    self._times[item[0]] += 1
                    if self._times[item[0]] >= limit:
                        del self._items[episode_id]
                        self._consumed += 1
        else:
            for _, row, size in pieces:
                self._times[row : row + size] += 1
            for row, end in dropped:
                self._times[row:end] = limit
            for episode_id, _ in passes:
                item = self._items[episode_id]
                item[2] = self._unconsumed(item[2], item[1])
                if item[2] >= item[1]:
                    del self._items[episode_id]
                    self._consumed += 1
        while self._pending and self._pending[0] not in self._items:
            self._pending.popleft()

    def _take(self, n: int, length: int, strict: bool, whole: bool = False) -> list[Piece]:
        plan = self._plan(n, length, strict, whole)
        if plan.missing:
            # Remainders too short for a strict slice can never be served; dropping them is
            # kept even though this call waits, or they would hold writers back for ever.
            drops = plan.dropped if self.unit == "transition" else plan.drop_only_rows
            if self._limit and drops:
                self.changed_on_refusal = True  # journaled by the owner: a resume keeps them
            self._hand_out(plan.drop_only, [], drops)
            raise EmptyBufferError(
                f"fifo cannot hand out {n} {'rows' if length == 0 else 'pieces'} now, "
                f"{plan.missing} short ({len(self._items)} episodes pending)"
            )
        self._hand_out(plan.passes, plan.pieces, plan.dropped)
        return plan.pieces

    # -- sampling ----------------------------------------------------------------------------

    def sample_rows(self, n: int, rng: np.random.Generator) -> Draw:
        n = check_count(n, "n")
        pieces = self._take(n, 0, True)
        rows = np.concatenate([np.arange(row, row + size) for _, row, size in pieces])
        return Draw(rows.astype(np.int64), np.ones(n))

    def sample_episodes(self, n: int, rng: np.random.Generator) -> EpisodeDraw:
        n = check_count(n, "n")
        pieces = self._take(n, 0, False, whole=True)
        ids, starts, sizes = (np.asarray(col, dtype=np.int64) for col in zip(*pieces, strict=True))
        return EpisodeDraw(ids, starts, starts + sizes, np.ones(n))

    def sample_slices(
        self, n: int, length: int, rng: np.random.Generator, strict: bool = True
    ) -> SliceDraw:
        n, length = check_count(n, "n"), check_count(length, "length")
        pieces = self._take(n, length, strict)
        _, starts, sizes = (np.asarray(col, dtype=np.int64) for col in zip(*pieces, strict=True))
        return SliceDraw(starts, sizes, np.ones(n))

    # -- flow control ------------------------------------------------------------------------

    def blocks_overwrite(self, start: int, stop: int) -> bool:
        """True while ``[start, stop)`` holds rows (or, in episode unit, touches episodes) that
        were not consumed yet; always False without ``max_times_sampled``."""
        if not self._limit:
            return False
        start, stop = max(int(start), 0), min(int(stop), self.capacity)
        if start >= stop:
            return False
        ends = self.index.end_of_row[start:stop]
        if self.unit == "transition":
            return bool(np.any((ends > 0) & (self._times[start:stop] < self._limit)))
        live = np.unique(ends[ends > 0])
        firsts = self.index.start_by_end[live]
        return bool(np.any(self._times[firsts] < self._limit))

    # -- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            **self._header(),
            "items": [[i, *item] for i, item in self._walk_items()],
            "times": to_bytes(self._times) if self._limit else None,
            "consumed": self._consumed,
            "dropped_rows": self._dropped_rows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_state(state)
        items: dict[int, list[int]] = {}
        if not self._limit:  # nothing consumed: every live episode is an item
            items = {ep.id: [ep.start, ep.end, ep.start] for ep in self.registry}
        for episode_id, first, end, cursor in state["items"] if self._limit else ():
            if episode_id not in self.registry:
                continue  # gone since the state was saved
            now = self.registry.get(episode_id)
            if now.end != end or not first <= cursor <= end:
                raise ValueError(f"sampler state item {episode_id} does not match the registry")
            items[int(episode_id)] = [now.start, end, max(int(cursor), now.start)]
        times = np.zeros(0, dtype=np.int64)
        if self._limit:
            times = np.zeros(self.capacity, dtype=np.int64)
            if state.get("times") is not None:
                times = from_bytes(state["times"], np.int64, self.capacity, "times")
        self._items = items
        self._pending = deque(sorted(items))
        self._times = times
        self._consumed = int(state["consumed"])
        self._dropped_rows = int(state["dropped_rows"])

    def stats(self) -> dict[str, Any]:
        pending = self._items if self._limit else {}
        return {
            "sampler": self.name,
            "unit": self.unit,
            "max_times_sampled": self.max_times_sampled,
            "unconsumed_episodes": len(pending),
            "consumed_episodes": self._consumed,
            "dropped_rows": self._dropped_rows,
        }
