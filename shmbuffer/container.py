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

Sampling and flow control: the container owns the :class:`~shmbuffer.samplers.Sampler`, the
:class:`~shmbuffer.samplers.RateLimiter` and the random generator, and tells the sampler every
eviction (after the registry changed, once per evicted range), commit (after the registry
add), restore (an abort giving evictions back; ``restore`` replaces the registry object) and
clear, and the limiter every row inserted, deleted, given back and sampled. The in-process
``Buffer`` and the daemon call the same ``sample_*`` methods, so both run the same code. A
request the limiter (or a FIFO sampler holding unconsumed rows) refuses raises
:class:`~shmbuffer.errors.WaitTimeoutError` here; the daemon asks :meth:`Container.insert_blocker`
/ :meth:`Container.sample_blocker` first and parks the request instead. Bad arguments (a
negative or NaN priority, an index out of range, a call the sampler does not serve in this
unit) raise :class:`~shmbuffer.errors.InvalidArgumentError` with nothing changed.

Persistence goes through :meth:`Container.state` / :meth:`Container.from_state` (registry,
ring, sampler state, limiter counts, generator state) and the ``replay_*`` methods the journal
calls, which run the same code as live requests, so whatever a commit or eviction does to the
sampler is redone on ``--resume`` too.

Not thread-safe: the owner (buffer or daemon loop) serialises calls.
"""

from __future__ import annotations

import base64
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, NoReturn

import numpy as np
import numpy.typing as npt

from shmbuffer.errors import (
    CapacityError,
    InvalidArgumentError,
    NotFoundError,
    ShmBufferError,
    WaitTimeoutError,
)
from shmbuffer.names import MODES, UNITS, check_choice
from shmbuffer.registry import Episode, EpisodeRegistry
from shmbuffer.rows import episode_rows, slice_rows
from shmbuffer.samplers import (
    NoLimit,
    RateLimiter,
    Sampler,
    UniformSampler,
    make_rate_limiter,
    make_sampler,
)
from shmbuffer.samplers.base import Priority, check_beta, check_count, check_update
from shmbuffer.samplers.index import rows_of

Range = tuple[int, int]
I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]
Mask = npt.NDArray[np.bool_]
_ONE_USE = np.int32(1)  # count_use's increment, of use_counts' dtype (numpy's fast add.at)


class _Arguments:
    """Turns a sampler's plain ValueError/IndexError into InvalidArgumentError (a class with
    ``__enter__``/``__exit__``: cheaper than ``contextlib.contextmanager`` on the hot path)."""

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # TypeError stays what it is: a wrong type is the caller's bug, not a bad value.
        if isinstance(exc, ValueError | IndexError) and not isinstance(exc, ShmBufferError):
            raise InvalidArgumentError(str(exc)) from exc


#: ``with as_invalid_argument:`` around argument checks (the Buffer uses it too).
as_invalid_argument = _Arguments()


def raise_invalid(exc: ValueError | IndexError) -> NoReturn:
    """Raise ``exc`` as InvalidArgumentError (as it is if it is a ShmBufferError already)."""
    if isinstance(exc, ShmBufferError):
        raise exc
    raise InvalidArgumentError(str(exc)) from exc


@dataclass(frozen=True, slots=True)
class RowSample:
    """Rows a read gets: physical ``rows``, each one's draw ``probability`` and importance
    ``weight`` (ones unless the sampler keeps priorities). The arrays may be read-only and
    shared between calls: copy before changing them."""

    rows: I64
    probability: F64
    weight: F64


@dataclass(frozen=True, slots=True)
class EpisodeSample:
    """Whole episodes: ids, physical bounds ``[starts, ends)``, probability and weight per
    episode, and ``rows``, their physical rows concatenated."""

    ids: I64
    starts: I64
    ends: I64
    probability: F64
    weight: F64
    rows: I64


@dataclass(frozen=True, slots=True)
class PriorityUpdate:
    """A validated priority update: the rows to set (stale ones left out), their priorities,
    and how many stale rows were left out."""

    rows: I64
    priority: F64
    stale: int


@dataclass(frozen=True, slots=True)
class SliceSample:
    """``n`` slices of ``length`` rows: first rows, real lengths (``< length`` only when not
    strict), probability and weight per slice; ``rows`` holds ``n * length`` physical rows
    (a padding position repeats its slice's first row) and ``mask`` ``[n, length]`` is True on
    real rows (a prefix; None for strict slices, which are all real)."""

    starts: I64
    lengths: I64
    probability: F64
    weight: F64
    rows: I64
    mask: Mask | None


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
    """The ring of ``capacity`` rows; see the module docstring.

    ``sampler``: a :class:`~shmbuffer.samplers.Sampler` (None: uniform), ``rate_limiter`` a
    :class:`~shmbuffer.samplers.RateLimiter` (None: no limit); both belong to this container
    from now on. ``seed`` seeds ``rng``, the generator every draw uses.
    """

    def __init__(
        self,
        capacity: int,
        *,
        mode: str = "circular",
        unit: str = "transition",
        sampler: Sampler | None = None,
        rate_limiter: RateLimiter | None = None,
        seed: int | None = None,
    ) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self.capacity = capacity
        self.mode = check_choice("mode", mode, MODES)
        self.unit = check_choice("unit", unit, UNITS)
        self.registry = EpisodeRegistry(capacity)
        if sampler is not None and _attached(sampler):  # two rings under one sampler: garbage
            raise InvalidArgumentError(
                f"this {sampler.name} sampler already belongs to a buffer; make one per buffer"
            )
        self.sampler: Sampler = UniformSampler() if sampler is None else sampler
        self.rate_limiter: RateLimiter = NoLimit() if rate_limiter is None else rate_limiter
        self.rng = np.random.default_rng(seed)
        self.sampler.attach(self.registry, self.unit, capacity)
        #: Priority updates applied, and skipped because the row was overwritten since its
        #: sample (its generation stamp changed; the owner compares the stamps).
        self.priority_updates = 0
        self.priority_updates_stale = 0
        self._ones: F64 = np.ones(0)
        self.pointer = 0  # next physical row to write
        self.rows_written = 0  # rows ever reserved, for stats and the fixed-mode limit
        #: Rows the pointer has moved, early-wrap skips included (not journaled: after a
        #: restart no reservation is open to compare it with).
        self.travelled = 0
        #: Reads per row since it was committed; -1 for rows that hold no committed data.
        self.use_counts = np.full(capacity, -1, dtype=np.int32)
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

    @property
    def next_reservation(self) -> int:
        """The id the next :meth:`reserve` hands out (journaled with every reservation)."""
        return self._next_reservation

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
        blocked = self._insert_blocker(num_rows, evict)
        if blocked is not None:  # the daemon asked insert_blocker first and parked it
            raise WaitTimeoutError(f"cannot reserve {num_rows} rows now: {blocked}")
        before = (self.pointer, self.rows_written, self.travelled)
        trimmed: list[Episode] = []
        evicted = self._evict_ranges(evict, trimmed)
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

    def insert_blocker(self, num_rows: int, episodes: int | Sequence[int] = 1) -> str | None:
        """Why a reservation of ``num_rows`` must wait now, or None if it may go: the rate
        limiter refuses it, or (FIFO with ``max_times_sampled``) rows it would overwrite were
        not consumed yet. CapacityError/ValueError as :meth:`plan` for a request that can
        never fit."""
        _, evict = self.plan(num_rows, episodes)
        return self._insert_blocker(num_rows, evict)

    def _insert_blocker(self, num_rows: int, evict: list[Range]) -> str | None:
        if not self.rate_limiter.can_insert(num_rows):
            return self.rate_limiter.blocked_reason()
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
        given = self._commit_priority(reservation, priority)
        self._pop(reservation_id)
        for start, stop in reservation.ranges:
            self.use_counts[start:stop] = 0
        ids = [self.registry.add(s, e) for s, e in reservation.episodes]
        self._published(
            [Episode(i, s, e) for i, (s, e) in zip(ids, reservation.episodes, strict=True)],
            given,
            reservation.num_rows,
        )
        return ids

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
        given bounds back. O(live episodes): only aborts and their journal replay call it.
        Use counters of the restored rows restart at 0."""
        if not episodes:
            return
        rows_before = self.registry.num_rows
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
        self.sampler.on_restore(episodes, self.registry)  # a new registry object
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

    # -- reading ----------------------------------------------------------------------------

    def count_use(self, rows: np.ndarray) -> None:
        """Count one read of each row, duplicates included (an accumulating scatter, not
        ``+=``, which counts a repeated index once). ``np.add.at`` with an int32 one takes
        numpy's fast path (~3.5 us for 256 rows of 10k); with a Python ``1`` it is the slow
        generic one (~30 us), and torch's ``index_add_`` with its tensor wrapping ~8 us."""
        np.add.at(self.use_counts, rows, _ONE_USE)

    def sample_blocker(self, rows: int) -> str | None:
        """Why a sample of ``rows`` rows must wait now (the rate limiter's reason), or None."""
        if self.rate_limiter.can_sample(rows):
            return None
        return self.rate_limiter.blocked_reason()

    def _admit(self, rows: int, what: str, beta: float | None) -> None:
        """What a draw needs checked before the sampler runs: samplers count a sample when
        they return it (FIFO consumption, epochs, ``max_times_sampled``)."""
        if beta is not None:
            check_beta(beta)
        if not self.rate_limiter.can_sample(rows):
            raise self._refused(what)

    def _refused(self, what: str) -> WaitTimeoutError:
        return WaitTimeoutError(f"cannot sample {what} now: {self.rate_limiter.blocked_reason()}")

    def _weights(self, probability: F64, beta: float | None) -> F64:
        if self.sampler.has_priorities:
            return self.sampler.weights(probability, beta)
        # What every other sampler returns: ones, kept read-only and reused (a fresh array
        # per call measured ~3 us of a ~110 us uniform Buffer.sample(256)).
        ones = self._ones
        if ones.size != probability.size:
            ones = self._ones = np.ones(probability.size)
            ones.setflags(write=False)
        return ones

    def sample_rows(self, n: int, *, beta: float | None = None) -> RowSample:
        """``n`` rows by the sampler, counted as read and told to the limiter. ``beta``: the
        importance exponent of the weights (None: the sampler's default).

        EmptyBufferError when the sampler has nothing to hand out, WaitTimeoutError when the
        limiter refuses, InvalidArgumentError for bad arguments; nothing is counted then."""
        # try/except, not ``with as_invalid_argument``: free on this hot path (Python 3.11's
        # zero-cost exceptions), where the ``with`` measured ~2 us of a ~110 us sample.
        try:
            n = check_count(n, "n")
            if beta is not None:
                check_beta(beta)
            if not self.rate_limiter.can_sample(n):
                raise self._refused(f"{n} rows")
            draw = self.sampler.sample_rows(n, self.rng)
            weight = self._weights(draw.probability, beta)
        except (ValueError, IndexError) as exc:
            raise_invalid(exc)
        self.rate_limiter.on_sample(n)
        self.count_use(draw.rows)
        return RowSample(draw.rows, draw.probability, weight)

    def sample_episodes(self, n: int, *, beta: float | None = None) -> EpisodeSample:
        """``n`` whole episodes by the sampler. The limiter is asked about ``n`` times the mean
        stored episode length (the lengths are known only after the draw, which the sampler
        counts) and told the rows actually handed out."""
        with as_invalid_argument:
            n = check_count(n, "n")
        episodes = len(self.registry)
        expected = n * max(1, round(self.registry.num_rows / episodes)) if episodes else n
        with as_invalid_argument:
            self._admit(expected, f"{n} episodes", beta)
            draw = self.sampler.sample_episodes(n, self.rng)
            weight = self._weights(draw.probability, beta)
        lengths = draw.ends - draw.starts
        physical = episode_rows(draw.starts, lengths)
        self.rate_limiter.on_sample(physical.size)
        self.count_use(physical)
        return EpisodeSample(draw.ids, draw.starts, draw.ends, draw.probability, weight, physical)

    def sample_slices(
        self, n: int, length: int, *, strict: bool = True, beta: float | None = None
    ) -> SliceSample:
        """``n`` slices of ``length`` consecutive rows, each inside one episode (see
        :meth:`Sampler.sample_slices`; ``strict=False`` admits shorter episodes, padded). The
        limiter counts ``n * length`` rows; use counts only the real ones."""
        with as_invalid_argument:
            n, length = check_count(n, "n"), check_count(length, "length")
        with as_invalid_argument:
            self._admit(n * length, f"{n} slices of {length} rows", beta)
            draw = self.sampler.sample_slices(n, length, self.rng, strict)
            weight = self._weights(draw.probability, beta)
        mask = None
        if strict:
            flat = slice_rows(draw.starts, length)
        else:  # a padding position repeats its slice's first row: always a live row
            offsets = np.arange(length, dtype=np.int64)
            mask = offsets < draw.lengths[:, None]
            first = draw.starts[:, None]
            flat = np.where(mask, first + offsets, first).reshape(-1)
        self.rate_limiter.on_sample(n * length)
        self.count_use(flat if mask is None else flat[mask.reshape(-1)])
        return SliceSample(draw.starts, draw.lengths, draw.probability, weight, flat, mask)

    def check_priorities(
        self,
        rows: npt.ArrayLike,
        priority: npt.ArrayLike,
        generation: npt.ArrayLike | None = None,
        stamps: I64 | None = None,
    ) -> PriorityUpdate:
        """Validate a priority update and leave out its stale rows; nothing changes.

        ``priority``: a scalar or one value per row. ``generation``: each row's stamp when it
        was sampled, compared with ``stamps`` (the owner's current per-row generation stamps):
        a row overwritten since is left out (``stale``), never applied to the new data.
        InvalidArgumentError for an index out of range, a negative or NaN priority, lengths
        that differ, or a sampler that keeps no priorities."""
        with as_invalid_argument:
            index, given = check_update(rows, priority, self.capacity)
            if not self.sampler.has_priorities:
                self.sampler.update_priorities(index, given)  # its refusal, naming it
            if generation is None:
                return PriorityUpdate(index, given, 0)
            if stamps is None:
                raise TypeError("check_priorities: generation given without stamps")
            seen = np.asarray(generation)
            if seen.shape != index.shape or (seen.dtype.kind not in "iu" and seen.size):
                raise ValueError(
                    f"generation needs {index.size} integer stamps (one per index), "
                    f"got {seen.dtype} {list(seen.shape)}"
                )
            fresh = stamps[index] == seen
            stale = int(index.size - np.count_nonzero(fresh))
            if stale:
                index, given = index[fresh], given[fresh]
            return PriorityUpdate(index, given, stale)

    def apply_priorities(self, update: PriorityUpdate) -> int:
        """Apply a checked update; return how many rows it set (rows holding no data are
        skipped) and count its stale rows in ``priority_updates_stale``."""
        with as_invalid_argument:  # checked already: not validated twice
            applied = self.sampler.set_priorities(update.rows, update.priority)
        self.priority_updates += applied
        self.priority_updates_stale += update.stale
        return applied

    def update_priorities(
        self,
        rows: npt.ArrayLike,
        priority: npt.ArrayLike,
        generation: npt.ArrayLike | None = None,
        stamps: I64 | None = None,
    ) -> int:
        """:meth:`check_priorities` then :meth:`apply_priorities`: set the priority of the
        items holding physical ``rows``; return how many were applied. The daemon calls the
        two halves apart, to journal exactly what it applies."""
        return self.apply_priorities(self.check_priorities(rows, priority, generation, stamps))

    def rank_rows(
        self,
        rank: int = 0,
        world_size: int = 1,
        *,
        shuffle: bool = True,
        drop_last: bool = False,
        seed: int | Sequence[int] = 0,
    ) -> I64:
        """This rank's share of every stored row, each once (PyTorch ``DistributedSampler``'s
        convention), as physical rows in the order to read them.

        Positions ``0..rows-1`` (oldest first) are permuted by a generator seeded with
        ``seed`` (every rank must pass the same one) unless ``shuffle`` is False; without
        ``drop_last`` the list is padded by wrapping around to a multiple of ``world_size``
        (a few rows then appear twice across ranks), with it the tail is dropped; rank ``r``
        takes every ``world_size``-th position from ``r``. The sampler and the limiter are
        neither asked nor told: this is the read-everything path, not a sample."""
        with as_invalid_argument:
            world_size = check_count(world_size, "world_size")
            rank = operator.index(rank)
            if not 0 <= rank < world_size:
                raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        total = self.registry.num_rows
        if shuffle:
            positions = np.random.default_rng(seed).permutation(total)
        else:
            positions = np.arange(total, dtype=np.int64)
        if drop_last:
            positions = positions[: total // world_size * world_size]
        elif total % world_size and total:
            pad = world_size - total % world_size
            positions = np.concatenate([positions, np.resize(positions, pad)])
        mine = positions[rank::world_size]
        return self.registry.rows_at(mine) if mine.size else mine.astype(np.int64)

    def stats(self) -> dict[str, Any]:
        return {
            "sampler": self.sampler.stats(),
            "rate_limiter": self.rate_limiter.stats(),
            "priority_updates": self.priority_updates,
            "priority_updates_stale": self.priority_updates_stale,
        }

    # -- persistence ------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Everything a restart needs, open reservations aside (their rows are never
        published): ring, registry, sampler (its kind, settings and state), limiter counts and
        the generator's state. Plain values, JSON- and msgpack-able both: bytes travel as
        ``{"b64": ...}`` and integers beyond 64 bits (the generator's) as ``{"int": "..."}``."""
        return {
            "capacity": self.capacity,
            "unit": self.unit,
            "mode": self.mode,
            "pointer": self.pointer,
            "rows_written": self.rows_written,
            "next_reservation": self._next_reservation,
            "registry": self.registry.to_state(),
            "sampler": {
                "name": self.sampler.name,
                "settings": self.sampler.settings(),
                "state": encode_state(self.sampler.state_dict()),
            },
            "rate_limiter": {
                "name": self.rate_limiter.name,
                "settings": self.rate_limiter.settings(),
                "state": encode_state(self.rate_limiter.state_dict()),
            },
            "rng": encode_state(self.rng.bit_generator.state),
            "priority_updates": self.priority_updates,
            "priority_updates_stale": self.priority_updates_stale,
        }

    @classmethod
    def from_state(
        cls,
        state: Mapping[str, Any],
        *,
        sampler: Sampler | None = None,
        rate_limiter: RateLimiter | None = None,
    ) -> Container:
        """A container in ``state``. ``sampler``/``rate_limiter`` None: the saved kinds with
        their saved settings (uniform / no limit for a state saved before samplers existed).
        ValueError (KeyError, TypeError) when the state is inconsistent."""
        saved = state.get("sampler") or {}
        if sampler is None and "name" in saved:
            sampler = make_sampler(saved["name"], **dict(saved.get("settings") or {}))
        limiter = state.get("rate_limiter") or {}
        if rate_limiter is None and "name" in limiter:
            rate_limiter = make_rate_limiter(limiter["name"], **dict(limiter.get("settings") or {}))
        container = cls(
            operator.index(state["capacity"]),
            mode=state["mode"],
            unit=state["unit"],
            sampler=sampler,
            rate_limiter=rate_limiter,
        )
        container.load_state(state)
        return container

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Take over ``state`` (see :meth:`state`); open reservations are dropped and use
        counters restart at 0 for every committed row. ValueError when it does not fit this
        container (capacity, unit, mode, another sampler kind) or is inconsistent; checked
        before anything changes, except a sampler state that fails its own checks (the owner
        discards the container then). A different limiter kind keeps the saved counts."""
        for key in ("capacity", "unit", "mode"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"saved state is capacity={state['capacity']} unit={state['unit']} "
                    f"mode={state['mode']}, the buffer is capacity={self.capacity} "
                    f"unit={self.unit} mode={self.mode}"
                )
        registry = EpisodeRegistry.from_state(state["registry"])
        saved = state.get("sampler") or {}
        if "name" in saved and saved["name"] != self.sampler.name:
            raise ValueError(
                f"saved state is for the {saved['name']!r} sampler, this buffer's is "
                f"{self.sampler.name!r}: resume or restore with the same sampler"
            )
        # A checkpoint written before samplers existed kept the generator under "sampler".
        rng = state.get("rng", saved.get("rng"))
        self.registry = registry
        self.reservations.clear()
        self.pointer = operator.index(state["pointer"])
        self.rows_written = operator.index(state["rows_written"])
        self._next_reservation = operator.index(state["next_reservation"])
        self.travelled = 0
        self.use_counts[:] = -1
        for ep in registry:
            self.use_counts[ep.start : ep.end] = 0
        self.sampler.attach(registry, self.unit, self.capacity)
        if "state" in saved:
            self.sampler.load_state_dict(decode_state(saved["state"]))
        limiter = state.get("rate_limiter") or {}
        counts: dict[str, Any] = {"inserted": registry.num_rows, "sampled": 0, "deleted": 0}
        if "state" in limiter:
            counts = decode_state(limiter["state"])
        self.rate_limiter.load_state_dict({**counts, "limiter": self.rate_limiter.name})
        if rng is not None:
            self.rng.bit_generator.state = decode_state(rng)
        self.priority_updates = int(state.get("priority_updates", 0))
        self.priority_updates_stale = int(state.get("priority_updates_stale", 0))

    # -- journal replay: the same code as the live requests, without their checks ---------

    def replay_reserve(
        self, evicted: Sequence[Range], pointer: int, rows_written: int, next_reservation: int
    ) -> None:
        """Redo a reservation: evict ``evicted`` (telling sampler and limiter) and move the
        ring to where it stood after it. No reservation is opened: its rows were never
        committed, so they are never published."""
        self._evict_ranges(evicted, [])
        self.pointer, self.rows_written = pointer, rows_written
        self._next_reservation = next_reservation

    def replay_commit(self, episodes: Sequence[tuple[int, int, int]]) -> None:
        """Redo a commit of ``(id, start, end)`` episodes (one reservation's); ValueError if
        the registry hands out other ids (the journal does not fit this state). Priorities a
        writer gave are journaled apart and come back through :meth:`replay_priorities`."""
        published: list[Episode] = []
        num_rows = 0
        for episode_id, start, end in episodes:
            got = self.registry.add(start, end)
            if got != episode_id:
                raise ValueError(f"replayed episode got id {got}, journal says {episode_id}")
            self.use_counts[start:end] = 0
            published.append(Episode(got, start, end))
            num_rows += end - start
        self._published(published, None, num_rows)

    def replay_restore(self, episodes: Sequence[Episode], pointer: int, rows_written: int) -> None:
        """Redo an abort that published ``episodes`` again (see :meth:`abort`)."""
        self.restore(episodes)
        self.pointer, self.rows_written = pointer, rows_written

    def replay_clear(self, pointer: int) -> None:
        self.clear()
        self.pointer = pointer

    def replay_priorities(self, rows: npt.ArrayLike, priority: npt.ArrayLike) -> int:
        """Redo a priority update (stale rows were already left out when it was journaled)."""
        return self.update_priorities(rows, priority)


def _attached(sampler: Sampler) -> bool:
    try:
        sampler.registry  # noqa: B018 (the property raises when not attached)
    except RuntimeError:
        return False
    return True


def encode_state(value: Any) -> Any:
    """``value`` with bytes as ``{"b64": str}`` and ints outside int64 as ``{"int": str}``, so
    it fits JSON (the journal's snapshot) and msgpack alike; :func:`decode_state` undoes it."""
    if isinstance(value, bytes | bytearray | memoryview):
        return {"b64": base64.b64encode(value).decode("ascii")}
    if isinstance(value, bool | float | str) or value is None:
        return value
    if isinstance(value, int | np.integer):
        value = int(value)
        return value if -(2**63) <= value < 2**63 else {"int": str(value)}
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, Mapping):
        return {str(k): encode_state(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [encode_state(v) for v in value]
    raise TypeError(f"cannot save a {type(value).__name__} in a container state")


def decode_state(value: Any) -> Any:
    if isinstance(value, Mapping):
        if len(value) == 1 and "b64" in value:
            return base64.b64decode(value["b64"])
        if len(value) == 1 and "int" in value:
            return int(value["int"])
        return {k: decode_state(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_state(v) for v in value]
    return value


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
