"""Where the next rows go: the ring pointer, modes, units, reservations and use counters.

The container is metadata only. It never touches row data, so the same object serves the
in-process :class:`~shmbuffer.Buffer` (which copies right after reserving) and the daemon
(whose writers copy in their own processes between ``reserve`` and ``commit``).

Writing is two-phase, which is what keeps readers from ever seeing a torn episode:

1. ``reserve(n)`` picks the rows, evicts every committed episode they overlap (samplers stop
   returning them at once) and hands out the physical row ranges;
2. the caller copies the data into those rows;
3. ``commit(reservation)`` publishes the episodes in the registry; only then can they be read.

A reservation whose copy fails is aborted: what it evicted is published again wherever the
copy left the rows untouched and no later reservation has reached them (:meth:`Container.abort`),
so a failed write loses nothing that was stored (in-process it leaves the container exactly as
before ``reserve``).

Units: in ``"transition"`` unit ``len()`` counts rows and a chunk may wrap around the end of
the ring (split in two ranges); in ``"episode"`` unit ``len()`` counts episodes and an episode
never wraps: when it does not fit before the end, the writer wraps early to row 0 and the rows
it skipped are evicted too, so eviction stays FIFO over whole episodes.

Not thread-safe: the owner (buffer or daemon loop) serialises calls.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from shmbuffer.errors import CapacityError, NotFoundError
from shmbuffer.names import MODES, UNITS, check_choice
from shmbuffer.registry import Episode, EpisodeRegistry

_ONE = torch.ones((), dtype=torch.int32)

Range = tuple[int, int]


@dataclass
class Reservation:
    """Rows handed to one writer: physical ``ranges`` filled in order, episodes to publish."""

    id: int
    ranges: list[Range]
    #: ``(start, end)`` physical bounds of each (sub-)episode, registered at commit.
    episodes: list[Range]
    owner: object = None
    evicted: list[Episode] = field(default_factory=list)
    #: When an owner that never commits loses the rows (monotonic seconds; daemon only).
    deadline: float = math.inf
    #: Chunks whose front this reservation trimmed (transition unit), with their old bounds.
    trimmed: list[Episode] = field(default_factory=list)
    #: ``(pointer, rows_written, travelled)`` before it, and ``travelled`` after it: what an
    #: abort needs to tell whether later reservations reached the rows it evicted.
    before: tuple[int, int, int] = (0, 0, 0)
    travelled: int = 0

    @property
    def num_rows(self) -> int:
        return sum(stop - start for start, stop in self.ranges)


class Container:
    def __init__(self, capacity: int, *, mode: str = "circular", unit: str = "transition") -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self.capacity = capacity
        self.mode = check_choice("mode", mode, MODES)
        self.unit = check_choice("unit", unit, UNITS)
        self.registry = EpisodeRegistry(capacity)
        self.pointer = 0  # next physical row to write
        self.rows_written = 0  # rows ever reserved, for stats and the fixed-mode limit
        #: Rows the pointer has moved, early-wrap skips included (not journaled: after a
        #: restart no reservation is open to compare it with).
        self.travelled = 0
        #: Reads per row since it was committed; -1 for rows that hold no committed data.
        self.use_counts = np.full(capacity, -1, dtype=np.int32)
        self._use_counts_t = torch.from_numpy(self.use_counts)  # same memory
        self.reservations: dict[int, Reservation] = {}
        self._next_reservation = 1

    # -- sizes ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.registry.num_rows if self.unit == "transition" else len(self.registry)

    @property
    def num_rows(self) -> int:
        return self.registry.num_rows

    @property
    def num_episodes(self) -> int:
        return len(self.registry)

    @property
    def reserved_rows(self) -> int:
        return sum(r.num_rows for r in self.reservations.values())

    # -- writing ----------------------------------------------------------------------------

    def plan(
        self, num_rows: int, episodes: int | Sequence[int] = 1
    ) -> tuple[list[Range], list[Range]]:
        """The physical ranges a reservation of ``num_rows`` would get, and the ranges it would
        evict, without changing anything (the daemon checks leases against them first)."""
        episode_lengths(num_rows, episodes)  # validates the split
        if num_rows > self.capacity:
            raise CapacityError(f"{num_rows} rows do not fit a buffer of capacity {self.capacity}")
        start, end = self.pointer, self.pointer + num_rows
        if end <= self.capacity:
            return [(start, end)], [(start, end)]
        if self.mode == "fixed":
            raise CapacityError(
                f"fixed-mode buffer is full: {num_rows} rows do not fit in the "
                f"{self.capacity - self.pointer} left of capacity {self.capacity}"
            )
        if self.unit == "episode":  # early wrap: skip the tail, evict it with the new rows
            return [(0, num_rows)], [(start, self.capacity), (0, num_rows)]
        wrapped = [(start, self.capacity), (0, end - self.capacity)]
        return wrapped, wrapped

    def reserve(
        self, num_rows: int, episodes: int | Sequence[int] = 1, owner: object = None
    ) -> Reservation:
        """Rows for ``episodes``: a count of equal sub-episodes, or their lengths (a writer
        that batches several small episodes into one round trip)."""
        ranges, evict = self.plan(num_rows, episodes)
        busy = self.conflicts(evict)
        if busy:
            raise CapacityError(
                f"rows {evict} are still reserved by an uncommitted writer (reservation "
                f"{busy[0].id}); the ring is smaller than the data in flight"
            )
        before = (self.pointer, self.rows_written, self.travelled)
        trimmed: list[Episode] = []
        evicted = [ep for s, e in evict for ep in self._evict(s, e, trimmed)]
        # A full fixed-mode ring keeps pointer == capacity, so nothing fits any more.
        end = ranges[-1][1]
        self.pointer = end if self.mode == "fixed" else end % self.capacity
        self.rows_written += num_rows
        self.travelled += sum(e - s for s, e in evict)  # the evicted span is where it moved
        reservation = Reservation(
            id=self._next_reservation,
            ranges=ranges,
            episodes=_episode_bounds(ranges, episode_lengths(num_rows, episodes)),
            owner=owner,
            evicted=evicted,
            trimmed=trimmed,
            before=before,
            travelled=self.travelled,
        )
        self._next_reservation += 1
        self.reservations[reservation.id] = reservation
        return reservation

    def _evict(self, start: int, stop: int, trimmed: list[Episode] | None = None) -> list[Episode]:
        """Unpublish rows ``start:stop``. Episode unit drops every episode they touch; transition
        unit keeps the surviving tail of a chunk the ring only partly overwrites (its old
        bounds are appended to ``trimmed``)."""
        self.use_counts[start:stop] = -1
        if self.unit == "episode":
            evicted = self.registry.evict(start, stop)
            for ep in evicted:
                self.use_counts[ep.start : ep.end] = -1
            return evicted
        evicted = []
        for ep in self.registry.overlapping(start, stop):
            if start <= ep.start and ep.end > stop:
                self.registry.trim_front(ep.id, stop)
                if trimmed is not None:
                    trimmed.append(ep)
            else:
                evicted.append(self.registry.remove(ep.id))
                self.use_counts[ep.start : ep.end] = -1
        return evicted

    def conflicts(self, ranges: list[Range]) -> list[Reservation]:
        """Open reservations holding any row of ``ranges`` (a writer still copying there)."""
        return [
            other
            for other in self.reservations.values()
            if any(s < stop and start < e for s, e in other.ranges for start, stop in ranges)
        ]

    def commit(self, reservation_id: int) -> list[int]:
        """Publish a reservation's episodes; return their ids in order."""
        reservation = self._pop(reservation_id)
        for start, stop in reservation.ranges:
            self.use_counts[start:stop] = 0
        return [self.registry.add(s, e) for s, e in reservation.episodes]

    def abort(self, reservation_id: int, written: int | None = None) -> list[Episode]:
        """Give rows back unpublished (a writer that died or failed mid-copy).

        ``written``: how many of the reservation's rows (in fill order) the copy may have
        touched, when the caller knows (None: nothing comes back, as for a writer that died).
        Every episode the reservation evicted (or trimmed) is published again under its old id
        when none of its rows were touched or reached by a later reservation; if nothing was
        touched and no reservation came after it, the ring pointer goes back too, as if
        ``reserve`` had never run. Returns the episodes published again (restored bounds).
        """
        reservation = self._pop(reservation_id)
        if written is None:
            return []
        later = self.travelled - reservation.travelled
        touched = max(0, written)
        if later == 0 and touched == 0:
            self.pointer, self.rows_written, self.travelled = reservation.before
        if later >= self.capacity:
            return []
        blocked = _split(reservation.ranges, touched) + _ring(
            reservation.ranges[-1][1] % self.capacity, later, self.capacity
        )
        back = [
            ep
            for ep in (*reservation.evicted, *reservation.trimmed)
            if not any(ep.start < e and s < ep.end for s, e in blocked)
        ]
        self.restore(back)
        return back

    def restore(self, episodes: Sequence[Episode]) -> None:
        """Publish ``episodes`` again under their old ids; a live id (a trimmed chunk) gets the
        given bounds back. O(live episodes): only aborts and their journal replay call it.
        Use counters of the restored rows restart at 0."""
        if not episodes:
            return
        live = {ep.id: ep for ep in self.registry}
        for ep in episodes:
            clash = [o for o in self.registry.overlapping(ep.start, ep.end) if o.id != ep.id]
            if clash or ep.id >= self.registry.next_id:
                raise ValueError(f"cannot restore {ep}: it overlaps {clash} or was never added")
            live[ep.id] = ep
        self.registry = EpisodeRegistry.from_state(
            {
                "capacity": self.capacity,
                "next_id": self.registry.next_id,
                "episodes": [[ep.id, ep.start, ep.end] for ep in sorted(live.values(), key=_id)],
            }
        )
        for ep in episodes:
            self.use_counts[ep.start : ep.end] = 0

    def _pop(self, reservation_id: int) -> Reservation:
        try:
            return self.reservations.pop(reservation_id)
        except KeyError:
            raise NotFoundError(f"no open reservation {reservation_id}") from None

    def clear(self) -> None:
        """Forget every committed row; open reservations stay valid (but an abort no longer
        brings back what they evicted: it was cleared)."""
        for reservation in self.reservations.values():
            reservation.evicted, reservation.trimmed = [], []
        self.registry.clear()
        self.use_counts[:] = -1
        if not self.reservations:
            self.pointer = 0

    # -- reading ----------------------------------------------------------------------------

    def count_use(self, rows: np.ndarray) -> None:
        """Count one read of each row, duplicates included (an accumulating scatter, not
        ``+=``, which counts a repeated index once; 10x faster than ``np.add.at``)."""
        index = torch.from_numpy(np.require(rows, dtype=np.int64, requirements=["W"]))
        self._use_counts_t.index_put_((index,), _ONE, accumulate=True)


def episode_lengths(num_rows: int, episodes: int | Sequence[int]) -> list[int]:
    """The length of each episode of a reservation; ValueError unless they add up."""
    if num_rows < 1:
        raise ValueError(f"a reservation needs at least one row, got {num_rows}")
    if isinstance(episodes, int):
        if episodes < 1 or num_rows % episodes:
            raise ValueError(f"{num_rows} rows cannot be split into {episodes} equal episodes")
        return [num_rows // episodes] * episodes
    lengths = [int(n) for n in episodes]
    if not lengths or min(lengths) < 1 or sum(lengths) != num_rows:
        raise ValueError(f"episode lengths must be positive and add up to {num_rows} rows")
    return lengths


def _id(episode: Episode) -> int:
    return episode.id


def _split(ranges: Sequence[Range], n: int) -> list[Range]:
    """The parts of ``ranges`` (filled in order) holding their first ``n`` rows."""
    out: list[Range] = []
    for start, stop in ranges:
        if n <= 0:
            break
        out.append((start, min(stop, start + n)))
        n -= stop - start
    return out


def _ring(start: int, length: int, capacity: int) -> list[Range]:
    """Physical ranges of ``length`` ring rows from ``start`` on (``length < capacity``)."""
    if length <= 0:
        return []
    if start + length <= capacity:
        return [(start, start + length)]
    return [(start, capacity), (0, start + length - capacity)]


def _episode_bounds(ranges: list[Range], lengths: list[int]) -> list[Range]:
    """Physical bounds of episodes of ``lengths`` rows laid over ``ranges`` in order; an
    episode that straddles the wrap of a transition chunk becomes two entries."""
    bounds: list[Range] = []
    ends = np.cumsum(lengths).tolist()
    logical = list(zip([0, *ends[:-1]], ends, strict=True))
    offset = 0
    for start, stop in ranges:
        span = (offset, offset + stop - start)
        for first, last in logical:
            lo, hi = max(first, span[0]), min(last, span[1])
            if lo < hi:
                bounds.append((start + lo - offset, start + hi - offset))
        offset = span[1]
    return bounds
