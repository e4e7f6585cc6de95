"""The episode registry: which row intervals of the ring hold committed episodes.

Every committed episode (or committed chunk of transitions) is a half-open row interval
``[start, end)`` inside a ring of ``capacity`` rows, with a stable id handed out at :meth:`add`
(``0, 1, 2, ...``; ids are never reused, not even after :meth:`EpisodeRegistry.clear`). Live
intervals never overlap. Episodes are kept in chronological (= insertion = id) order.

Design, for the sampling hot path of the daemon:

* Live episodes sit in growable numpy arrays (``ids``, ``starts``, ``ends``) in id order between
  a ``head`` and a ``tail`` slot, with an ``alive`` bool array for tombstones. Removing at the
  head (the common FIFO eviction) just advances ``head`` past dead slots, amortised O(1).
  Removing in the middle (writers committing out of order) leaves a tombstone; the arrays are
  compacted (live entries moved to the front, pure numpy) only once tombstones exceed 25 % of
  the live count, so removal stays amortised O(1).
* Because ids are strictly increasing along the slots, id → slot is a ``np.searchsorted`` over
  ``ids[head:tail]`` (O(log n)). A dict would be O(1) but would have to be rebuilt in Python on
  every compaction; the binary search keeps compaction a handful of vectorised copies.
* :meth:`EpisodeRegistry.sample_episodes` draws slots uniformly in ``[head, tail)`` and redraws
  the dead ones (vectorised rejection; with at most ~25 % dead it converges in a few rounds).
* Position based queries (:meth:`~EpisodeRegistry.at`, :meth:`~EpisodeRegistry.at_many`,
  :meth:`~EpisodeRegistry.rows_at`, :meth:`~EpisodeRegistry.sample_slices`) use slot-aligned
  running totals of episode lengths (and, per requested slice length, of slice weights) and
  ``np.searchsorted``. The totals are extended in O(1) by :meth:`~EpisodeRegistry.add` and
  need no change when the head moves, so the FIFO add/evict/sample loop never rebuilds
  anything; they are recomputed (``np.cumsum``) only when tombstones force a compaction,
  which position queries do lazily first.
* :meth:`~EpisodeRegistry.sample_rows` maps its draws through the *spans*, the maximal runs of
  adjacent live rows (kept by every add, eviction and trim, O(log S + S) for S spans): one
  span is one addition per draw, a few (a wrapped ring, reservations in flight) one search
  over them. Only a ring with more than :data:`~shmbuffer.registry.slots._MAX_SPANS` holes
  falls back to the running totals over episodes. Draws are exact uniform integers from raw
  generator words (:func:`uniform_integers`), cheaper than ``Generator.integers``'s argument
  handling.
* A commit's episodes go in as one run (:meth:`~EpisodeRegistry.add_run`: one overlap query
  per run of adjacent episodes, one vectorised append) and an eviction's come out as one
  (:meth:`~EpisodeRegistry.evict`: consecutive slots cleared together, and in transition unit
  the chunk the range ends inside trimmed in the same call), where one call per episode was
  half the daemon's work with small-row writers.
* Overlap queries (:meth:`~EpisodeRegistry.add`, :meth:`~EpisodeRegistry.evict`,
  :meth:`~EpisodeRegistry.overlapping`) bisect over a sorted Python list of live starts. Live
  intervals are disjoint, so their ends are sorted too and the overlapping ones are one
  contiguous run of that list: O(log n + k) plus one ``memmove`` of the list on insert/delete.
  Measured several times faster than ``intervaltree.IntervalTree`` for add/evict at the same
  simplicity.

Thread safety: not thread-safe; the owner (container or daemon loop) serialises calls.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from shmbuffer.errors import NotFoundError
from shmbuffer.registry.slots import _INITIAL_SLOTS, I64, Episode, SlotTable
from shmbuffer.registry.spans import uniform_integers

__all__ = ["Episode", "EpisodeRegistry", "uniform_integers"]


class EpisodeRegistry(SlotTable):
    """Live episodes of a ring of ``capacity`` rows; see the module docstring for the design."""

    # ------------------------------------------------------------------ mutation (slots)

    def _kill_slot(self, slot: int, ep: Episode) -> None:
        """Tombstone live slot ``slot``, which holds ``ep``; the caller updates the overlap
        index."""
        self._alive[slot] = False
        self._n_live -= 1
        self._num_rows -= ep.length
        self._spans.remove(ep.start, ep.end)
        self._settle_ends()

    def _settle_ends(self) -> None:
        """After slots were tombstoned: head and tail on live slots again (none left: reset)."""
        if self._n_live == 0:
            self._alive[self._head : self._tail] = False
            self._head = self._tail = 0
        else:
            while not self._alive[self._head]:
                self._head += 1
            while not self._alive[self._tail - 1]:
                self._tail -= 1

    def _after_removals(self) -> None:
        if self._tombstones * 4 > self._n_live:
            self._compact()

    def _insert(self, episode_id: int, start: int, end: int) -> None:
        """Append a validated, non-overlapping episode whose id is above every live id."""
        self._ensure_room()
        t = self._tail
        self._ids[t] = episode_id
        self._starts[t] = start
        self._ends[t] = end
        self._alive[t] = True
        length = end - start
        self._cum[t] = (self._cum[t - 1] if t else 0) + length
        for size, cum in self._slice_cum.items():
            cum[t] = (cum[t - 1] if t else 0) + max(length - size + 1, 0)
        self._tail = t + 1
        self._n_live += 1
        self._num_rows += length
        bisect.insort(self._sorted_starts, start)
        self._by_start[start] = (end, episode_id)
        self._spans.add(start, end)

    # ------------------------------------------------------------------ overlap index

    def _overlap_range(self, start: int, end: int) -> tuple[int, int]:
        """Index range into ``_sorted_starts`` of the live episodes overlapping [start, end)."""
        starts = self._sorted_starts
        if start >= end:
            return 0, 0  # an empty range overlaps nothing
        lo = bisect.bisect_right(starts, start) - 1
        if lo < 0 or self._by_start[starts[lo]][0] <= start:
            lo += 1
        hi = bisect.bisect_left(starts, end, lo)
        return lo, max(lo, hi)

    def _check_query(self, start: int, end: int) -> tuple[int, int]:
        start, end = operator.index(start), operator.index(end)
        if start > end:
            raise ValueError(f"invalid row range [{start}, {end}): start > end")
        return start, end

    # ------------------------------------------------------------------ mutation

    def add(self, start: int, end: int) -> int:
        """Register ``[start, end)`` and return its new id."""
        start, end = operator.index(start), operator.index(end)
        if start >= end:
            raise ValueError(f"empty or reversed episode [{start}, {end}): need start < end")
        if start < 0 or end > self.capacity:
            raise ValueError(f"episode [{start}, {end}) is outside the ring [0, {self.capacity})")
        lo, hi = self._overlap_range(start, end)
        if lo < hi:
            s = self._sorted_starts[lo]
            e, other = self._by_start[s]
            raise ValueError(f"episode [{start}, {end}) overlaps live episode {other} [{s}, {e})")
        episode_id = self._next_id
        self._insert(episode_id, start, end)
        self._next_id = episode_id + 1
        return episode_id

    def add_run(self, bounds: Sequence[tuple[int, int]], first: int | None = None) -> int:
        """Register several episodes at once (a reservation's, in its order) and return the
        first new id; ``bounds[i]`` gets ``first + i``. Every check of :meth:`add`, and that
        they do not overlap each other, passes before anything changes (ValueError if not).
        ``first``: the ids to give, from it on (a table's registry of the episodes it holds
        takes the ring's ids; ValueError below :attr:`next_id`); None: the next ones.

        One overlap query per run of adjacent episodes and one vectorised append to the slot
        arrays, instead of :meth:`add` per episode (per-episode calls were much of a commit of many
        chunks into a full ring)."""
        k = len(bounds)
        if first is not None:
            if first < self._next_id:
                raise ValueError(f"episode id {first} is below the next id {self._next_id}")
            if not k:
                return first
            self._next_id = operator.index(first)
        if k <= 1:
            return self.add(*bounds[0]) if k else self._next_id
        runs = self._runs(bounds)
        cols = np.array(bounds, dtype=np.int64).reshape(k, 2)
        starts, ends = cols[:, 0], cols[:, 1]
        lengths = ends - starts
        first = self._next_id
        self._ensure_room(k)
        t = self._tail
        self._ids[t : t + k] = np.arange(first, first + k)
        self._starts[t : t + k] = starts
        self._ends[t : t + k] = ends
        self._alive[t : t + k] = True
        self._cum[t : t + k] = np.cumsum(lengths) + (self._cum[t - 1] if t else 0)
        for size, cum in self._slice_cum.items():
            weights = np.maximum(lengths - (size - 1), 0)
            cum[t : t + k] = np.cumsum(weights) + (cum[t - 1] if t else 0)
        self._tail = t + k
        self._n_live += k
        self._num_rows += int(lengths.sum())
        self._next_id = first + k
        starts_list = starts.tolist()
        self._by_start.update(
            zip(starts_list, zip(ends.tolist(), range(first, first + k), strict=True), strict=True)
        )
        ordered = self._sorted_starts
        for lo, hi, a, b in runs:  # a run's starts go in together: nothing live lies between
            i = bisect.bisect_left(ordered, lo)
            ordered[i:i] = starts_list[a:b]
            self._spans.add(lo, hi)
        return first

    def _runs(self, bounds: Sequence[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
        """``bounds`` as maximal runs of adjacent episodes, ``(start, end, first index, end
        index)``, after :meth:`add`'s checks on each episode and each run."""
        runs: list[tuple[int, int, int, int]] = []
        run_start, prev_end, first = -1, -1, 0
        for i, (given_start, given_end) in enumerate(bounds):
            start, end = operator.index(given_start), operator.index(given_end)
            if not 0 <= start < end <= self.capacity:
                raise ValueError(
                    f"episode [{start}, {end}) is empty, reversed or outside the ring "
                    f"[0, {self.capacity})"
                )
            if start != prev_end:
                if i:
                    runs.append((run_start, prev_end, first, i))
                run_start, first = start, i
            prev_end = end
        if bounds:
            runs.append((run_start, prev_end, first, len(bounds)))
        in_order = sorted(runs)
        for (s, e, _, _), after in itertools.pairwise(in_order):
            if e > after[0]:
                raise ValueError(f"episodes [{s}, {e}) and [{after[0]}, {after[1]}) overlap")
        for s, e, _, _ in runs:
            lo, hi = self._overlap_range(s, e)
            if lo < hi:
                other_start = self._sorted_starts[lo]
                other_end, other = self._by_start[other_start]
                raise ValueError(
                    f"episodes [{s}, {e}) overlap live episode {other} [{other_start}, {other_end})"
                )
        return runs

    def evict(self, start: int, end: int, trimmed: list[Episode] | None = None) -> list[Episode]:
        """Remove every live episode overlapping ``[start, end)``; return them oldest first.

        ``trimmed`` (transition unit, where a chunk is overwritten row by row): the episode
        that starts inside the range and reaches past ``end`` keeps its tail instead, trimmed
        to start at ``end``; its old bounds are appended to ``trimmed``."""
        start, end = self._check_query(start, end)
        lo, hi = self._overlap_range(start, end)
        kept = None
        if trimmed is not None and hi > lo:
            last = self._sorted_starts[hi - 1]
            last_end, last_id = self._by_start[last]
            if last >= start and last_end > end:
                kept, hi = Episode(last_id, last, last_end), hi - 1
        by_start = self._by_start
        if hi - lo == 1:  # a ring's steady eviction: one chunk, nothing to order
            first_start = self._sorted_starts[lo]
            first_end, first_id = by_start[first_start]
            out = [Episode(first_id, first_start, first_end)]
        else:
            found = sorted((by_start[s][1], s, by_start[s][0]) for s in self._sorted_starts[lo:hi])
            out = [Episode(i, s, e) for i, s, e in found]
        if out:
            self._evict_found(lo, hi, out)
        if kept is not None and trimmed is not None:
            # After the removals it is the oldest left, so its trim is O(1).
            self.trim_front(kept.id, end)
            trimmed.append(kept)
        return out

    def _evict_found(self, lo: int, hi: int, found: list[Episode]) -> None:
        """Remove ``found``, the episodes at ``_sorted_starts[lo:hi]`` in id order: a run of
        consecutive slots (a ring's eviction, nearly always) in a few vectorised steps."""
        k = len(found)
        first = self._slot_of(found[0].id)
        assert first is not None
        run = slice(first, first + k)
        if (
            k > 1
            and first + k <= self._tail
            and self._alive[run].all()
            and self._ids[run].tolist() == [ep.id for ep in found]
        ):
            self._remove_slot_run(first, k)
            return
        for ep in found:  # the overlap index's bounds are the slots' (kept in step)
            slot = first if ep is found[0] else self._slot_of(ep.id)
            assert slot is not None
            self._kill_slot(slot, ep)
        for s in self._sorted_starts[lo:hi]:
            del self._by_start[s]
        del self._sorted_starts[lo:hi]
        self._after_removals()

    def trim_front(self, episode_id: int, new_start: int) -> Episode:
        """Drop the rows before ``new_start`` from a live episode, keeping its id and place.

        Used in transition unit, where the ring overwrites the oldest chunk row by row rather
        than evicting it whole. Trimming the oldest entry is O(1); any other entry compacts.
        """
        slot = self._slot_of(episode_id) if self._is_id(episode_id) else None
        if slot is None:
            raise NotFoundError(f"episode {episode_id!r} is not live")
        old = self._episode_at_slot(slot)
        if not old.start < new_start < old.end:
            raise ValueError(f"cannot trim episode {old} to start at {new_start}")
        i = bisect.bisect_left(self._sorted_starts, old.start)
        self._sorted_starts[i] = new_start  # still sorted: no other start lies in between
        del self._by_start[old.start]
        self._by_start[new_start] = (old.end, episode_id)
        self._starts[slot] = new_start
        self._num_rows -= new_start - old.start
        self._spans.remove(old.start, new_start)
        self._slice_cum = {}  # slice weights of this entry changed; rebuilt lazily
        if slot != self._head:  # running totals after this slot are now off: rebuild them
            self._compact()
        return Episode(episode_id, new_start, old.end)

    def remove(self, episode_id: int) -> Episode:
        """Remove one live episode by id."""
        slot = self._slot_of(episode_id) if self._is_id(episode_id) else None
        if slot is None:
            raise NotFoundError(f"episode {episode_id!r} is not live")
        ep = self._episode_at_slot(slot)
        self._kill_slot(slot, ep)
        i = bisect.bisect_left(self._sorted_starts, ep.start)
        del self._sorted_starts[i]
        del self._by_start[ep.start]
        self._after_removals()
        return ep

    def remove_many(self, episode_ids: Sequence[int]) -> None:
        """Remove several live episodes by id (NotFoundError, nothing removed, if one is not
        live). Ids that sit in consecutive slots (one commit's episodes, in order: what a
        ring's eviction removes) go in a few vectorised steps; any others one by one."""
        k = len(episode_ids)
        if k <= 1:
            if k:
                self.remove(episode_ids[0])
            return
        first = self._slot_of(episode_ids[0]) if self._is_id(episode_ids[0]) else None
        if first is not None and first + k <= self._tail:
            run = self._ids[first : first + k]
            if run.tolist() == list(episode_ids) and self._alive[first : first + k].all():
                self._remove_slot_run(first, k)
                return
        missing = [i for i in episode_ids if not self._is_id(i) or self._slot_of(i) is None]
        if missing or len(set(episode_ids)) < k:
            raise NotFoundError(f"episode {(missing or episode_ids)[0]!r} is not live")
        for episode_id in episode_ids:
            self.remove(episode_id)

    def _remove_slot_run(self, first: int, k: int) -> None:
        """Remove the ``k`` live slots from ``first`` on."""
        starts = self._starts[first : first + k].tolist()
        ends = self._ends[first : first + k].tolist()
        self._alive[first : first + k] = False
        self._n_live -= k
        self._num_rows -= sum(ends) - sum(starts)
        by_start, ordered = self._by_start, self._sorted_starts
        for start in starts:
            del by_start[start]
        pairs = sorted(zip(starts, ends, strict=True))
        i = bisect.bisect_left(ordered, pairs[0][0])
        if ordered[i : i + k] == [start for start, _ in pairs]:
            del ordered[i : i + k]
        else:  # other live episodes lie between them
            for start, _ in pairs:
                del ordered[bisect.bisect_left(ordered, start)]
        run_start, run_end = pairs[0]
        for start, end in pairs[1:]:  # each run of adjacent rows lies inside one span
            if start != run_end:
                self._spans.remove(run_start, run_end)
                run_start = start
            run_end = end
        self._spans.remove(run_start, run_end)
        self._settle_ends()
        self._after_removals()

    def restore(self, episodes: Iterable[Episode]) -> None:
        """Publish removed episodes again under their old ids (what an aborted reservation
        evicted); a live id gets back the front rows :meth:`trim_front` took from it.

        ValueError, changing nothing, if one was never added, overlaps a live episode or
        another restored one, or does not extend a live one at its front. O(k log n) for k
        episodes when they are older than every live one (the oldest, evicted from the head:
        the usual case); otherwise one vectorised O(n) rebuild of the slot arrays besides.
        """
        fronts: list[tuple[int, int, Episode]] = []  # (slot, current start, restored bounds)
        fresh: list[Episode] = []
        added: list[tuple[int, int, Episode]] = []  # the row runs that become live again
        for ep in episodes:
            if not (0 <= ep.id < self._next_id and 0 <= ep.start < ep.end <= self.capacity):
                raise ValueError(f"cannot restore {ep}: never added, or outside the ring")
            slot = self._slot_of(ep.id)
            if slot is None:
                fresh.append(ep)
                added.append((ep.start, ep.end, ep))
                continue
            start = int(self._starts[slot])
            if ep.end != int(self._ends[slot]) or ep.start >= start:
                live = self._episode_at_slot(slot)
                raise ValueError(
                    f"cannot restore {ep}: it overlaps its live self {live}, not a front"
                )
            fronts.append((slot, start, ep))
            added.append((ep.start, start, ep))
        added.sort(key=lambda run: run[0])
        for (s, e, ep), after in zip(added, [*added[1:], None], strict=True):
            lo, hi = self._overlap_range(s, e)
            if lo < hi:
                other = self._by_start[self._sorted_starts[lo]][1]
                raise ValueError(f"cannot restore {ep}: it overlaps live episode {other}")
            if after is not None and e > after[0]:
                raise ValueError(f"cannot restore {ep}: it overlaps {after[2]}, also restored")
        for slot, start, ep in fronts:
            i = bisect.bisect_left(self._sorted_starts, start)
            self._sorted_starts[i] = ep.start  # still sorted: [ep.start, start) held nothing
            self._by_start[ep.start] = self._by_start.pop(start)
            self._starts[slot] = ep.start
        for ep in fresh:
            bisect.insort(self._sorted_starts, ep.start)
            self._by_start[ep.start] = (ep.end, ep.id)
        for s, e, _ in added:
            self._spans.add(s, e)
            self._num_rows += e - s
        if not fresh:  # only fronts came back: the slots stay, their totals change
            self._compact()
            return
        fresh.sort(key=_episode_id)
        h, k = self._head, len(fresh)
        head_first = fresh[-1].id < self._ids[h] and not (fronts or self._tombstones)
        if self._n_live and k <= h and head_first:
            # The usual give-back: the oldest episodes, evicted from the head, go back into
            # the dead slots before it, each total one length below the next (O(k)); a
            # front that came back changed the totals after it, so that case rebuilds.
            for slot, ep in enumerate(fresh, h - k):
                self._ids[slot], self._starts[slot], self._ends[slot] = ep.id, ep.start, ep.end
            self._alive[h - k : h] = True
            for slot in range(h - 1, h - k - 1, -1):
                self._cum[slot] = self._cum[slot + 1] - (
                    self._ends[slot + 1] - self._starts[slot + 1]
                )
            self._head, self._n_live, self._slice_cum = h - k, self._n_live + k, {}
            return
        h, t = self._head, self._tail
        mask = self._alive[h:t]
        back = np.array([(ep.id, ep.start, ep.end) for ep in fresh], dtype=np.int64)
        cols = [np.concatenate([a[h:t][mask], back[:, j]]) for j, a in enumerate(self._columns)]
        order = np.argsort(cols[0], kind="stable")  # old ids go back between the live ones
        n = self._n_live = len(order)
        if n > len(self._ids):
            self._reset_arrays(max(2 * len(self._ids), n))
        else:
            self._alive[:t] = False
        for array, col in zip(self._columns, cols, strict=True):
            array[:n] = col[order]
        self._finish_rebuild(n)

    @property
    def _columns(self) -> tuple[I64, I64, I64]:
        return self._ids, self._starts, self._ends

    def clear(self) -> None:
        """Remove every episode; ids keep increasing (they are never reused)."""
        self._reset_storage(_INITIAL_SLOTS)

    # ------------------------------------------------------------------ lookup

    @staticmethod
    def _is_id(value: object) -> bool:
        return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))

    def overlapping(self, start: int, end: int) -> list[Episode]:
        """The live episodes overlapping ``[start, end)``, oldest first (nothing is removed)."""
        start, end = self._check_query(start, end)
        lo, hi = self._overlap_range(start, end)
        by_start = self._by_start
        # The overlap index holds each live episode's bounds and id, the same as its slot's:
        # no id -> slot search per episode (this runs on every transition-unit eviction).
        found = [Episode(by_start[s][1], s, by_start[s][0]) for s in self._sorted_starts[lo:hi]]
        if len(found) > 1:
            found.sort(key=_episode_id)
        return found

    def starting_at(self, row: int) -> Episode | None:
        """The live episode whose first row is ``row``, if any, in O(1) (the overlap index
        holds each one's bounds and id by its first row)."""
        found = self._by_start.get(row)
        return None if found is None else Episode(found[1], row, found[0])

    def get(self, episode_id: int) -> Episode:
        slot = self._slot_of(episode_id) if self._is_id(episode_id) else None
        if slot is None:
            raise NotFoundError(f"episode {episode_id!r} is not live")
        return self._episode_at_slot(slot)

    def holds(self, ids: I64) -> npt.NDArray[np.bool_]:
        """Whether each of ``ids`` (an int64 array) is live, vectorised: one search over the
        live slots, O(k log n)."""
        h, t = self._head, self._tail
        if not len(ids) or t == h:
            return np.zeros(len(ids), dtype=bool)
        slots = np.minimum(self._ids[h:t].searchsorted(ids) + h, t - 1)
        found: npt.NDArray[np.bool_] = (self._ids[slots] == ids) & self._alive[slots]
        return found

    def only(self, keep: Callable[[int], bool]) -> EpisodeRegistry:
        """A new registry of the live episodes whose id ``keep`` admits, with the same
        capacity and next id: O(live episodes)."""
        out = EpisodeRegistry(self.capacity)
        for ep in self:
            if keep(ep.id):
                out._insert(ep.id, ep.start, ep.end)
        out._next_id = self._next_id
        return out

    def __contains__(self, episode_id: object) -> bool:
        if not isinstance(episode_id, (int, np.integer)) or isinstance(episode_id, bool):
            return False
        return self._slot_of(int(episode_id)) is not None

    def __len__(self) -> int:
        return self._n_live

    def __iter__(self) -> Iterator[Episode]:
        # A snapshot: mutating the registry while iterating is safe.
        h, t = self._head, self._tail
        mask = self._alive[h:t]
        rows = zip(
            self._ids[h:t][mask].tolist(),
            self._starts[h:t][mask].tolist(),
            self._ends[h:t][mask].tolist(),
            strict=True,
        )
        return iter([Episode(i, s, e) for i, s, e in rows])

    def __repr__(self) -> str:
        return (
            f"EpisodeRegistry(capacity={self.capacity}, episodes={self._n_live}, "
            f"rows={self._num_rows}, next_id={self._next_id})"
        )

    @property
    def num_rows(self) -> int:
        """Sum of the lengths of the live episodes."""
        return self._num_rows

    @property
    def oldest_id(self) -> int:
        """The oldest live id (:attr:`next_id` when none is live), O(1): the head slot is
        always live."""
        return int(self._ids[self._head]) if self._n_live else self._next_id

    @property
    def next_id(self) -> int:
        """The id the next :meth:`add` will return."""
        return self._next_id

    # ------------------------------------------------------------------ state

    def to_state(self) -> dict[str, Any]:
        """A msgpack/JSON-able snapshot (plain ints and lists)."""
        h, t = self._head, self._tail
        mask = self._alive[h:t]
        cols = [self._ids[h:t][mask], self._starts[h:t][mask], self._ends[h:t][mask]]
        return {
            "capacity": self.capacity,
            "next_id": self._next_id,
            "episodes": np.stack(cols, axis=1).tolist(),
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> EpisodeRegistry:
        """Rebuild a registry from :meth:`to_state`; ValueError if the state is inconsistent."""
        reg = cls(int(state["capacity"]))
        last = -1
        for item in state["episodes"]:
            episode_id, start, end = (operator.index(v) for v in item)
            if episode_id <= last:
                raise ValueError(f"episode ids not strictly increasing at id {episode_id}")
            if start >= end or start < 0 or end > reg.capacity:
                raise ValueError(f"invalid episode {episode_id} [{start}, {end})")
            lo, hi = reg._overlap_range(start, end)
            if lo < hi:
                raise ValueError(f"episode {episode_id} [{start}, {end}) overlaps another")
            reg._insert(episode_id, start, end)
            last = episode_id
        next_id = operator.index(state["next_id"])
        if next_id <= last:
            raise ValueError(f"next_id {next_id} is not above the largest id {last}")
        reg._next_id = next_id
        return reg


def _episode_id(episode: Episode) -> int:
    return episode.id
