"""Where the next rows go: the ring pointer, two-phase reservations, eviction and restore.

Writing is two-phase, which is what keeps readers from ever seeing a torn episode:

1. ``reserve(n)`` picks the rows, evicts every committed episode they overlap (samplers stop
   returning them at once) and hands out the physical row ranges;
2. the caller copies the data into those rows;
3. ``commit(reservation)`` publishes the episodes in the registry; only then can they be read.

A reservation whose copy fails is aborted: what it evicted is published again wherever the
copy left the rows untouched and no later reservation has reached them
(:meth:`ReservationOps.abort`), so a failed write loses nothing that was stored (in-process it
leaves the container exactly as before ``reserve``).

Units: in ``"transition"`` unit ``len()`` counts rows and a chunk may wrap around the end of
the ring (split in two ranges); in ``"episode"`` unit ``len()`` counts episodes and an episode
never wraps: when it does not fit before the end, the writer wraps early to row 0 and the rows
it skipped are evicted too, so eviction stays FIFO over whole episodes.

Every change to the registry here tells the sampler (each eviction after the registry changed,
once per evicted range; each commit after the registry add; a restore, which replaces the
registry object; a clear) and the rate limiter (rows inserted, deleted, given back), through
:meth:`ReservationOps._evict_ranges`, :meth:`ReservationOps._published`,
:meth:`ReservationOps.restore` and :meth:`ReservationOps.clear` only: journal replay
(:mod:`shmbuffer.persistence`) goes through the same four.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from shmbuffer.errors import CapacityError, NotFoundError, WaitTimeoutError
from shmbuffer.registry import Episode
from shmbuffer.ringstate import (
    F64,
    Plan,
    PriorityUpdate,
    Range,
    Reservation,
    RingState,
    as_invalid_argument,
)
from shmbuffer.samplers.base import Priority
from shmbuffer.samplers.index import rows_of


class ReservationOps(RingState):
    """The write side of the container: plan, reserve, commit, abort, restore, clear."""

    def plan(self, num_rows: int, episodes: int | Sequence[int] = 1) -> Plan:
        """Decide a reservation of ``num_rows`` for ``episodes`` (a count of equal
        sub-episodes, or their lengths: a writer that batches several small episodes into one
        round trip) without changing anything: its rows, its evictions, the writers it would
        lap and whether flow control holds it back. An owner checks its own rules against it
        (the daemon: leases on the evicted rows) and then hands it to :meth:`reserve`.
        CapacityError/ValueError for a request that can never fit."""
        lengths = episode_lengths(num_rows, episodes)
        ranges, evict = self._plan(num_rows)
        busy = self.conflicts(evict) if self.reservations else []
        return Plan(
            num_rows,
            lengths,
            ranges,
            evict,
            busy,
            self._insert_blocker(num_rows, evict),
            (self.pointer, self.rows_written),
        )

    def _plan(self, num_rows: int) -> tuple[list[Range], list[Range]]:
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

    def reserve(self, plan: Plan, owner: object = None) -> Reservation:
        """Carry out ``plan`` (made by :meth:`plan` since the ring last moved): evict, move the
        ring, open the reservation. CapacityError if it would lap a writer still copying,
        WaitTimeoutError if flow control holds it back (an owner that waits asked the plan
        first), ValueError for a plan the ring has moved past."""
        if plan.at != (self.pointer, self.rows_written):
            raise ValueError(f"a plan made at {plan.at}: the ring has moved since")
        if plan.busy:
            raise CapacityError(
                f"rows {plan.evict} are still reserved by an uncommitted writer (reservation "
                f"{plan.busy[0].id}); the ring is smaller than the data in flight"
            )
        if plan.blocked is not None:
            raise WaitTimeoutError(f"cannot reserve {plan.num_rows} rows now: {plan.blocked}")
        before = (self.pointer, self.rows_written, self.travelled)
        trimmed: list[Episode] = []
        evicted = self._evict_ranges(plan.evict, trimmed)
        ranges = plan.ranges
        # A full fixed-mode ring keeps pointer == capacity, so nothing fits any more.
        end = ranges[-1][1]
        self.pointer = end if self.mode == "fixed" else end % self.capacity
        self.rows_written += plan.num_rows
        for start, stop in plan.evict:  # the evicted span is where the pointer moved
            self.travelled += stop - start
        reservation = Reservation(
            self._next_reservation,
            ranges,
            _episode_bounds(ranges, plan.lengths),
            owner,
            evicted,
            trimmed=trimmed,
            before=before,
            travelled=self.travelled,
            num_episodes=plan.episodes,
        )
        self._next_reservation += 1
        self.reservations[reservation.id] = reservation
        return reservation

    def reserve_rows(
        self, num_rows: int, episodes: int | Sequence[int] = 1, owner: object = None
    ) -> Reservation:
        """:meth:`plan` and :meth:`reserve` in one, for an owner with nothing to check in
        between (the in-process Buffer)."""
        return self.reserve(self.plan(num_rows, episodes), owner)

    def hold(
        self, reservation_id: int, ranges: Sequence[Range], episodes: int | Sequence[int]
    ) -> Reservation:
        """Open again reservation ``reservation_id`` of ``ranges`` split into ``episodes`` (as
        :meth:`reserve` takes them) that a dead owner had, its rows already evicted by the
        replay of its reserve: no new reservation is granted over its rows until it is
        committed or aborted (a writer that outlived its daemon may still copy there).
        ValueError if its id is taken or still to come, or the split does not fit."""
        if reservation_id in self.reservations or reservation_id >= self._next_reservation:
            raise ValueError(f"reservation {reservation_id} cannot be held again")
        held = [(int(s), int(e)) for s, e in ranges]
        lengths = episode_lengths(sum(e - s for s, e in held), episodes)
        reservation = Reservation(
            reservation_id,
            held,
            _episode_bounds(held, lengths),
            before=(self.pointer, self.rows_written, self.travelled),
            travelled=self.travelled,
        )
        self.reservations[reservation_id] = reservation
        return reservation

    def _insert_blocker(self, num_rows: int, evict: list[Range]) -> str | None:
        # Rows reserved and not yet committed count as inserted already: the limiter counts
        # inserts at commit, and a writer may hold several reservations (a batch reserved
        # ahead), each admitted against a count that did not include the others. Summed only
        # for a limiter that bounds inserts: the default one never looks.
        limiter = self.rate_limiter
        pending = self.reserved_rows if limiter.bounds_inserts else 0
        if not limiter.can_insert(num_rows + pending):
            return limiter.blocked_reason()
        for start, stop in evict:
            if self.sampler.blocks_overwrite(start, stop):
                return (
                    f"rows [{start}, {stop}) hold data the {self.sampler.name} sampler has not "
                    f"handed out max_times_sampled={self.sampler.max_times_sampled} times yet; "
                    "writers wait for readers to consume it instead of overwriting it"
                )
        return None

    def _evict_ranges(self, evict: Sequence[Range], trimmed: list[Episode]) -> list[Episode]:
        """Evict each range, telling the sampler after each (the registry already changed)
        and the limiter how many rows stopped holding data."""
        rows_before = self.registry.num_rows
        evicted: list[Episode] = []
        for start, stop in evict:
            count = len(evicted) + len(trimmed)
            evicted += self._evict(start, stop, trimmed)
            if len(evicted) + len(trimmed) > count:  # nothing was live there: nothing to tell
                self.sampler.on_evict(start, stop)
        deleted = rows_before - self.registry.num_rows
        if deleted:
            self.rate_limiter.on_delete(deleted)
        return evicted

    def _evict(self, start: int, stop: int, trimmed: list[Episode] | None = None) -> list[Episode]:
        """Unpublish rows ``start:stop``. Episode unit drops every episode they touch; transition
        unit keeps the surviving tail of a chunk the ring only partly overwrites (its old
        bounds are appended to ``trimmed``)."""
        use_counts, registry = self.use_counts, self.registry
        use_counts[start:stop] = -1
        # An episode's rows inside [start, stop) were just marked; only one reaching outside
        # the range needs a second fill (an early wrap's or a misaligned chunk's).
        if self.unit == "episode":
            evicted = registry.evict(start, stop)
            for ep in evicted:
                if ep.start < start or ep.end > stop:
                    use_counts[ep.start : ep.end] = -1
            return evicted
        evicted, kept = [], []
        for ep in registry.overlapping(start, stop):
            if start <= ep.start and ep.end > stop:
                kept.append(ep)  # at most one: the chunk holding row ``stop``
            else:
                evicted.append(ep)
                if ep.start < start:
                    use_counts[ep.start : ep.end] = -1
        registry.remove_many([ep.id for ep in evicted])
        for ep in kept:  # after the removals: the oldest left, so its trim is O(1)
            registry.trim_front(ep.id, stop)
            if trimmed is not None:
                trimmed.append(ep)
        return evicted

    def conflicts(self, ranges: list[Range]) -> list[Reservation]:
        """Open reservations holding any row of ``ranges`` (a writer still copying there)."""
        return [
            other
            for other in self.reservations.values()
            if any(s < stop and start < e for s, e in other.ranges for start, stop in ranges)
        ]

    def check_priority(
        self, num_rows: int, episodes: int | Sequence[int], priority: Priority
    ) -> F64 | None:
        """The per-item priorities a commit of ``num_rows`` rows in ``episodes`` would store
        (None: the sampler's default for new data); InvalidArgumentError for a priority that is
        negative, NaN, of the wrong length, or given to a sampler that keeps none. Lets an owner
        refuse a bad priority before it reserves (and so evicts) anything."""
        if priority is None:
            return None
        with as_invalid_argument:
            lengths = episode_lengths(num_rows, episodes)
            return self.sampler.check_commit_priority([Episode(0, 0, n) for n in lengths], priority)

    def commit_priorities(self, reservation_id: int, priority: Priority) -> PriorityUpdate | None:
        """What ``commit(reservation_id, priority)`` would store, as a priority update of the
        rows carrying the priorities (every row in transition unit, each episode's first row in
        episode unit): what the daemon journals to replay it. None for ``priority=None``;
        InvalidArgumentError for a bad one; nothing changes."""
        reservation = self.reservations.get(reservation_id)
        if reservation is None:
            raise NotFoundError(f"no open reservation {reservation_id}")
        given = self._commit_priority(reservation, priority)
        if given is None:
            return None
        starts = [s for s, _ in reservation.episodes]
        if self.unit == "episode":
            return PriorityUpdate(np.array(starts, dtype=np.int64), given, 0)
        return PriorityUpdate(rows_of(starts, [e for _, e in reservation.episodes]), given, 0)

    def _commit_priority(self, reservation: Reservation, priority: Priority) -> F64 | None:
        if priority is None:
            return None
        bounds = [Episode(0, s, e) for s, e in reservation.episodes]
        with as_invalid_argument:
            return self.sampler.check_commit_priority(bounds, priority)

    def commit(self, reservation_id: int, priority: Priority = None) -> list[int]:
        """Publish a reservation's episodes; return their ids in order.

        ``priority``: None (the sampler's default: the largest seen so far), a scalar, or one
        value per row (transition unit) or per episode (episode unit), validated before
        anything is published (InvalidArgumentError leaves the reservation open)."""
        reservation = self.reservations.get(reservation_id)
        if reservation is None:
            raise NotFoundError(f"no open reservation {reservation_id}")
        given = None if priority is None else self._commit_priority(reservation, priority)
        del self.reservations[reservation_id]
        num_rows = 0
        for start, stop in reservation.ranges:
            self.use_counts[start:stop] = 0
            num_rows += stop - start
        first = self.registry.add_run(reservation.episodes)
        episodes = [Episode(first + i, s, e) for i, (s, e) in enumerate(reservation.episodes)]
        self._published(episodes, given, num_rows)
        return [ep.id for ep in episodes]

    def _published(self, episodes: list[Episode], priority: F64 | None, num_rows: int) -> None:
        self.sampler.on_commit(episodes, priority)
        self.rate_limiter.on_insert(num_rows)

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
        given bounds back (aborts and their journal replay). O(live episodes) vectorised, plus
        the sampler's O(rows restored).
        Use counters of the restored rows restart at 0."""
        if not episodes:
            return
        rows_before = self.registry.num_rows
        self.registry.restore(episodes)  # ValueError before it changes anything
        for ep in episodes:
            self.use_counts[ep.start : ep.end] = 0
        self.sampler.on_restore(episodes, self.registry)
        back = self.registry.num_rows - rows_before
        if back > 0:
            self.rate_limiter.on_restore(back)

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
        rows = self.registry.num_rows
        self.registry.clear()
        self.sampler.on_clear()
        if rows:
            self.rate_limiter.on_delete(rows)
        self.use_counts[:] = -1
        if not self.reservations:
            self.pointer = 0


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
    episode that straddles the wrap of a transition chunk becomes two entries. O(E + R)."""
    if len(lengths) == 1:  # one episode (a chunk of transitions): one entry per range
        return list(ranges)
    if len(ranges) == 1:  # no wrap (the usual case): the running ends, shifted
        return list(itertools.pairwise(itertools.accumulate(lengths, initial=ranges[0][0])))
    bounds: list[Range] = []
    parts = iter(ranges)
    row, stop = next(parts)
    for length in lengths:
        left = length
        while left:
            if row == stop:
                row, stop = next(parts)
            take = min(left, stop - row)
            bounds.append((row, row + take))
            row += take
            left -= take
    return bounds
