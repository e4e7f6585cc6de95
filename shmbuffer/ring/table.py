"""A table over a ring: which rows a read gets, and what reads change.

A :class:`Table` is a :class:`~shmbuffer.samplers.Sampler`, a
:class:`~shmbuffer.samplers.RateLimiter`, a random generator, per-row use counts and priority
counters over one :class:`~shmbuffer.ring.ring.Ring` (Reverb's ``Table``: a sampler, a rate limiter
and extensions as separate objects). It is a :class:`~shmbuffer.ring.listeners.RingListener`: the
ring tells it every commit, eviction, restore, clear and load, and it tells its sampler and
limiter and keeps its use counts; before a reservation the ring asks it whether its limiter or
its sampler's unconsumed rows hold the writes back. Several tables over one ring each draw with
their own sampler, generator, counts and limiter.

The in-process :class:`~shmbuffer.Buffer` and the daemon call the same ``sample_*`` methods
here, so both run the same code. Every draw is counted in the per-row use counters and told to
the limiter. A request the limiter (or a FIFO sampler holding unconsumed rows) refuses raises
:class:`~shmbuffer.errors.WaitTimeoutError`; the daemon asks :meth:`Table.sample_blocker`
(and, for writes, the ``blocked`` of a ``plan``) first and parks the request instead. Bad
arguments (a negative or NaN priority, an index out of range, a call the sampler does not serve
in this unit) raise :class:`~shmbuffer.errors.InvalidArgumentError` with nothing changed; a
sample over the protocol's limits (``MAX_SAMPLE`` items, ``MAX_SAMPLE_ROWS`` rows:
``protocol.py``, their one home) raises :class:`~shmbuffer.errors.LimitExceededError` before
anything is drawn, in process as in a daemon. The counts, a slice's length and strictness and
a rank are checked by :mod:`shmbuffer.api.reads`, as the daemon's Reader checks them.

With a :class:`~shmbuffer.ring.listeners.SampleLog` (:meth:`Table.listen`: the daemon's journal)
every draw is told to it before the caller hands the rows out: the call, its size and the rows
counted by the limiter (a resumed daemon draws again, ``persistence.replay_sample``), plus the
generator's state when a refused draw may have moved it since. Nothing more is logged per
sample, so the cost is one small record (``bench/sample_journal.py``).

Not thread-safe: the ring's owner serialises calls, as the listener contract says.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from shmbuffer.api.reads import (
    as_invalid_argument,
    check_episode_args,
    check_rank,
    check_sample_args,
    check_slice_args,
    expand_slices,
    raise_invalid,
)
from shmbuffer.errors import InvalidArgumentError, WaitTimeoutError
from shmbuffer.registry.intervals import Episode, EpisodeRegistry
from shmbuffer.registry.spans import loaded_draws
from shmbuffer.ring.listeners import (
    EPISODES,
    F64,
    ROWS,
    SLICES,
    Range,
    RingListener,
    SampleLog,
    SampleRecord,
    rng_words,
)
from shmbuffer.ring.members import Members, holds
from shmbuffer.ring.priorities import TablePriorities
from shmbuffer.ring.ring import Ring
from shmbuffer.ring.samples import EpisodeSample, PriorityUpdate, RowSample, SliceSample
from shmbuffer.ring.subset import PrioritySubset, Subset
from shmbuffer.samplers import NoLimit, RateLimiter, Sampler, UniformSampler
from shmbuffer.samplers.prioritized import PrioritizedSampler
from shmbuffer.storage.rows import episode_rows

if TYPE_CHECKING:
    from shmbuffer.ring.bounds import TableBounds

__all__ = ["EpisodeSample", "PriorityUpdate", "RowSample", "SliceSample", "Table"]

I64 = npt.NDArray[np.int64]
_ONE_USE = np.int32(1)  # count_use's increment, of use_counts' dtype (numpy's fast add.at)


class Table(TablePriorities, RingListener):
    """Draws over ``ring``; see the module docstring. Listens to ``ring`` from construction
    on, after the tables made before it.

    ``sampler``: a :class:`~shmbuffer.samplers.Sampler` (None: uniform), ``rate_limiter`` a
    :class:`~shmbuffer.samplers.RateLimiter` (None: no limit); both belong to this table from
    now on (InvalidArgumentError for a sampler another table has). ``seed`` seeds ``rng``,
    the generator every draw uses. Episodes the ring holds already count as just committed.
    """

    def __init__(
        self,
        ring: Ring,
        *,
        sampler: Sampler | None = None,
        rate_limiter: RateLimiter | None = None,
        seed: int | None = None,
        key: str = "default",
    ) -> None:
        if sampler is not None and _attached(sampler):  # two tables under one sampler: garbage
            raise InvalidArgumentError(
                f"this {sampler.name} sampler already belongs to a buffer; make one per buffer"
            )
        self.ring = ring
        #: Its name among several tables over the ring (None: the only one), for messages.
        self.name: str | None = None
        #: What a write's ``members`` name it by (``ring/members.py``).
        self.key = key
        #: The episodes it holds, where it does not hold every live one (None: the ring's
        #: registry holds them): see :attr:`registry`.
        self._own: EpisodeRegistry | None = None
        self.sampler: Sampler = UniformSampler() if sampler is None else sampler
        self.rate_limiter: RateLimiter = NoLimit() if rate_limiter is None else rate_limiter
        try:
            self.rate_limiter.bind(ring.capacity)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        self.rng = np.random.default_rng(seed)
        self.priority_updates = 0  # counted by its priorities' part (``priorities.py``)
        self.priority_updates_stale = 0
        self._ones: F64 = np.ones(0)
        #: Reads per row since it was committed; -1 for rows that hold no committed data. An
        #: owner may keep it elsewhere (:meth:`keep_use_counts_in`): only ever written in place.
        self.use_counts = np.full(ring.capacity, -1, dtype=np.int32)
        #: Told every sample (None: nobody, as in-process); see :meth:`listen`.
        self.sample_log: SampleLog | None = None
        #: A refused draw may have moved the generator since the last sample logged.
        self.rng_unlogged = False
        #: Which live episodes it draws from at all (None: every one): ``ring/bounds.py``.
        self.bounds: TableBounds | None = None
        self._adopt()
        self.sampler.attach(self.registry, ring.unit, ring.capacity)
        if self.registry.num_rows:
            self._count_committed()
            self.rate_limiter.on_insert(self.registry.num_rows)
        ring.listen(self)

    @property
    def registry(self) -> EpisodeRegistry:
        """The live episodes this table holds: the ring's registry while it holds every one,
        else a registry of its own with the ring's ids (made at the first commit that leaves
        it out), which its sampler draws over."""
        own = self._own
        return self.ring.registry if own is None else own

    @property
    def holds_all(self) -> bool:
        """Whether it holds every live episode of the ring."""
        return self._own is None

    def holding(self, ids: I64) -> npt.NDArray[np.bool_]:
        """Whether it holds each of the live episodes ``ids``."""
        own = self._own
        return np.ones(len(ids), dtype=bool) if own is None else own.holds(ids)

    def _adopt(self) -> None:
        """Hold the live episodes the ring's membership gives it (a new table, a load): the
        ring's registry if every one, else a registry of those."""
        ring, key = self.ring, self.key
        if not ring.membership or not ring.membership.any_leaves_out(
            key, (ep.id for ep in ring.registry)
        ):
            self._own = None
            return
        self._own = ring.registry.only(lambda i: holds(ring.members_of(i), key))

    def listen(self, log: SampleLog | None) -> None:
        """Tell ``log`` every draw from now on (None: nobody): how the daemon's journal hears
        what reads change (``daemon/journal.py``). One log at a time: a draw asks it for room
        before anything changes, and two could each refuse alone."""
        self.sample_log = log

    def keep_use_counts_in(self, use_counts: npt.NDArray[np.int32]) -> None:
        """Keep the use counters in ``use_counts`` (an array of the ring's size holding the
        same values, say file-backed: how the journal keeps them across a crash). ValueError
        for an array of another shape or dtype."""
        if use_counts.shape != self.use_counts.shape or use_counts.dtype != np.int32:
            raise ValueError(
                f"use counts of {use_counts.dtype} {use_counts.shape}, the ring keeps int32 "
                f"{self.use_counts.shape}"
            )
        self.use_counts = use_counts

    def _count_committed(self) -> None:
        """Use counts as for a ring just loaded: 0 for every committed row, -1 elsewhere."""
        use_counts = self.use_counts
        use_counts[:] = -1
        for ep in self.registry:
            use_counts[ep.start : ep.end] = 0

    # -- what the ring tells it ---------------------------------------------------------------

    def insert_blocker(
        self, num_rows: int, evict: Sequence[Range], members: Members = None
    ) -> str | None:
        # Rows reserved and not yet committed count as inserted already: the limiter counts
        # inserts at commit, and a writer may hold several reservations (a batch reserved
        # ahead), each admitted against a count that did not include the others. Summed only
        # for a limiter that bounds inserts: the default one never looks. Rows that go into
        # other tables only are no insert of this one's.
        limiter = self.rate_limiter
        if limiter.bounds_inserts and holds(members, self.key):
            key = self.key
            pending = sum(
                r.num_rows for r in self.ring.reservations.values() if holds(r.members, key)
            )
            if not limiter.can_insert(num_rows + pending):
                return limiter.blocked_reason() + (
                    "" if self.name is None else f" (table {self.name!r})"
                )
        sampler = self.sampler
        for start, stop in evict:
            if sampler.blocks_overwrite(start, stop):
                return (
                    f"rows [{start}, {stop}) hold data the {sampler.name} sampler has not "
                    f"handed out max_times_sampled={sampler.max_times_sampled} times yet; "
                    "writers wait for readers to consume it instead of overwriting it"
                    + ("" if self.name is None else f" (table {self.name!r})")
                )
        return None

    def on_commit(
        self,
        episodes: Sequence[Episode],
        ranges: Sequence[Range],
        priority: F64 | None,
        members: Members = None,
    ) -> None:
        own = self._own
        if members is not None and self.key not in members:
            if own is None:  # the first it is left out of: its own registry from now on
                first = episodes[0].id
                self._own = own = self.ring.registry.only(lambda i: i < first)
                self.sampler.on_restore([], own)  # the same episodes, in another registry
            return
        if own is not None:
            own.add_run([(ep.start, ep.end) for ep in episodes], episodes[0].id)
        use_counts = self.use_counts
        num_rows = 0
        for start, stop in ranges:
            use_counts[start:stop] = 0
            num_rows += stop - start
        sampler = self.sampler
        sampler.on_commit(episodes, priority if sampler.has_priorities else None)
        self.rate_limiter.on_insert(num_rows)

    def on_evict(self, start: int, stop: int, evicted: Sequence[Episode], rows: int) -> None:
        own = self._own
        if own is not None:  # what it held of the range goes from its own registry too
            before = own.num_rows
            trimmed: list[Episode] = []
            evicted = own.evict(start, stop, trimmed if self.ring.unit == "transition" else None)
            if not evicted and not trimmed:
                return  # none of its episodes were there
            rows = before - own.num_rows
        use_counts = self.use_counts
        use_counts[start:stop] = -1
        # An episode's rows inside [start, stop) were just marked; only one reaching outside
        # the range needs a second fill (an early wrap's or a misaligned chunk's).
        for ep in evicted:
            if ep.start < start or ep.end > stop:
                use_counts[ep.start : ep.end] = -1
        self.sampler.on_evict(start, stop)
        if rows:
            self.rate_limiter.on_delete(rows)

    def on_restore(self, episodes: Sequence[Episode], rows: int) -> None:
        own = self._own
        if own is not None:  # only those it held come back to it
            ring, key = self.ring, self.key
            episodes = [ep for ep in episodes if holds(ring.members_of(ep.id), key)]
            if not episodes:
                return
            before = own.num_rows
            own.restore(episodes)
            rows = own.num_rows - before
        for ep in episodes:  # their counters restart at 0
            self.use_counts[ep.start : ep.end] = 0
        self.sampler.on_restore(episodes, self.registry)
        if rows > 0:
            self.rate_limiter.on_restore(rows)

    def on_clear(self, rows: int) -> None:
        own = self._own
        self.sampler.on_clear()
        if own is not None:  # both empty now: the ring's registry holds all it holds again
            rows, self._own = own.num_rows, None
            self.sampler.on_restore([], self.ring.registry)
        if rows:
            self.rate_limiter.on_delete(rows)
        self.use_counts[:] = -1

    def on_load(self) -> None:
        """Start over from the ring's new registry: counters at 0 for its rows, the sampler
        attached to it, the limiter counting them inserted and nothing sampled (a saved
        table's own state goes on top: ``persistence.load_state``)."""
        ring = self.ring
        self._adopt()
        self._count_committed()
        self.sampler.attach(self.registry, ring.unit, ring.capacity)
        counts = {"inserted": self.registry.num_rows, "sampled": 0, "deleted": 0}
        self.rate_limiter.load_state_dict({**counts, "limiter": self.rate_limiter.name})

    # -- reads --------------------------------------------------------------------------------

    def count_use(self, rows: np.ndarray) -> None:
        """Count one read of each row, duplicates included (an accumulating scatter, not
        ``+=``, which counts a repeated index once). ``np.add.at`` with an int32 one takes
        numpy's fast path; with a Python ``1`` it is the slow generic one, and torch's
        ``index_add_`` with its tensor wrapping is slower too. The compiled loop, once the draws
        are (``spans.compiled_draws``), is faster still (figures in ``docs/sampling.md``)."""
        kernels = loaded_draws()
        if kernels is None or rows.dtype != np.int64 or not rows.flags.c_contiguous:
            np.add.at(self.use_counts, rows, _ONE_USE)  # (another layout: not compiled for it)
        elif kernels.add_one(self.use_counts, rows) >= 0:
            raise IndexError(f"rows out of range for {self.use_counts.size} rows")

    def count_drawn(self, rows: I64, generations: I64, stamps: I64) -> int:
        """Count ``rows`` a reader drew itself over the published runs of live rows
        (``registry/shared_spans.py``), as :meth:`sample_rows` counts its own: the limiter is
        told of every one; a row's use count goes up only while it still holds what was
        drawn, its stamp still ``generations`` (``stamps`` being the owner's) and committed
        data in it (a clear changes no stamp). Returns the use counts raised."""
        self.rate_limiter.on_sample(rows.size)
        held = rows[stamps.take(rows) == generations]
        held = held[self.use_counts.take(held) >= 0]
        self.count_use(held)
        return int(held.size)

    def sample_blocker(self, rows: int) -> str | None:
        """Why a sample of ``rows`` rows must wait now (the rate limiter's reason), or None."""
        if self.rate_limiter.can_sample(rows):
            return None
        return self.rate_limiter.blocked_reason()

    def _admit(self, rows: int, what: str) -> None:
        """What a draw needs checked before the sampler runs: samplers count a sample when
        they return it (FIFO consumption, epochs, ``max_times_sampled``)."""
        if not self.rate_limiter.can_sample(rows):
            raise self._refused(what)

    def _refused(self, what: str) -> WaitTimeoutError:
        return WaitTimeoutError(f"cannot sample {what} now: {self.rate_limiter.blocked_reason()}")

    def _weights(self, probability: F64, beta: float | None, among: Subset | None = None) -> F64:
        if among is not None:
            return among.weights(probability, beta)
        if self.sampler.has_priorities:
            return self.sampler.weights(probability, beta)
        # What every other sampler returns: ones, kept read-only and reused (a fresh array
        # per call was a visible share of a uniform Buffer.sample(256)).
        ones = self._ones
        if ones.size != probability.size:
            ones = self._ones = np.ones(probability.size)
            ones.setflags(write=False)
        return ones

    def sample_rows(
        self, n: int, *, beta: float | None = None, among: Subset | None = None
    ) -> RowSample:
        """``n`` rows by the sampler, counted as read and told to the limiter. ``beta``: the
        importance exponent of the weights (None: the sampler's default). ``among``: drawn
        from these episodes only (:meth:`filtered`), in place of the sampler; in process only
        for now (a sample log's replay would draw it again without them).

        EmptyBufferError when the sampler has nothing to hand out, WaitTimeoutError when the
        limiter refuses, InvalidArgumentError for bad arguments; nothing is counted then."""
        # try/except, not ``with as_invalid_argument``: free on this hot path (Python 3.11's
        # zero-cost exceptions), where the ``with`` was a visible share of a sample.
        log = self.sample_log
        limiter = self.rate_limiter
        try:
            n = check_sample_args(n, beta, "n")
            if not limiter.can_sample(n):
                raise self._refused(f"{n} rows")
            if among is None and self.bounds is not None:
                among = self.bounds.subset(self)
            rng = None if log is None else self._before_draw(log, n)
            try:
                draw = (self.sampler if among is None else among).sample_rows(n, self.rng)
            except BaseException:
                self._draw_refused(ROWS, n, 0, True, rng)
                raise
            if among is None:
                weight = self._weights(draw.probability, beta)
            else:
                weight = among.weights(draw.probability, beta)
        except (ValueError, IndexError) as exc:
            raise_invalid(exc)
        limiter.on_sample(n)
        self.count_use(draw.rows)
        if log is not None:
            log.sampled(SampleRecord(ROWS, n, 0, True, n, False, rng))
        return RowSample(draw.rows, draw.probability, weight)

    def filtered(
        self, ids: I64, starts: I64, ends: I64, where: str, factor: F64 | None = None
    ) -> Subset:
        """The episodes a filter (or the table's bounds) selected, to draw from (``among``),
        as this table's sampler draws: uniformly, or by priority (``ring/subset.py``);
        ``where`` says what selected them; ``factor``: each one's weight (None: 1).
        InvalidArgumentError for a sampler it cannot stand in for (:meth:`check_filtered`)."""
        self.check_filtered("where=")
        if self.sampler.rows_uniform_over_spans:
            return Subset(ids, starts, ends, where, factor)
        sampler = self.sampler
        assert isinstance(sampler, PrioritizedSampler)  # check_filtered admits no other
        return PrioritySubset(ids, starts, ends, where, sampler, self.ring.unit, factor)

    def check_filtered(self, what: str) -> None:
        """InvalidArgumentError, saying ``what`` asked, unless this table's draws can be made
        over a selection of episodes: a uniform or prioritized sampler that consumes nothing
        (a filtered draw would bypass a FIFO's or ``max_times_sampled``'s consumption, and a
        sampler with an order of its own, LIFO, heaps or epochs, has no meaning over one)."""
        sampler = self.sampler
        prioritized = isinstance(sampler, PrioritizedSampler)
        if sampler.consuming or not (sampler.rows_uniform_over_spans or prioritized):
            named = "" if self.name is None else f" (table {self.name!r})"
            raise InvalidArgumentError(
                f"{what} draws uniformly or by priority among the episodes it selects, so it "
                f"needs a uniform or prioritized table without max_times_sampled; this one's "
                f"sampler is {sampler.name!r}"
                + (" and consumes what it hands out" if sampler.consuming else "")
                + named
            )

    def _before_draw(self, log: SampleLog, n: int) -> list[int] | None:
        """Room in the log first; the generator's state if a refused draw moved it."""
        log.room_for_sample(n)
        if self.rng_unlogged and self.sampler.uses_rng:
            self.rng_unlogged = False
            return rng_words(self.rng)
        return None

    def _draw_refused(
        self, call: int, n: int, length: int, strict: bool, rng: list[int] | None
    ) -> None:
        """A draw raised: it may have moved the generator; one that changed the sampler
        anyway (a FIFO's drops) is logged as refused, so a replay redoes it."""
        sampler = self.sampler
        if sampler.changed_on_refusal:
            sampler.changed_on_refusal = False
            if self.sample_log is not None:
                self.sample_log.sampled(SampleRecord(call, n, length, strict, 0, True, rng))
        if sampler.uses_rng:
            self.rng_unlogged = True

    def sample_episodes(
        self, n: int, *, beta: float | None = None, among: Subset | None = None
    ) -> EpisodeSample:
        """``n`` whole episodes by the sampler. The limiter is asked about ``n`` times the mean
        stored episode length (the lengths are known only after the draw, which the sampler
        counts) and told the rows actually handed out."""
        registry = self.registry
        episodes = len(registry)
        mean = max(1, round(registry.num_rows / episodes)) if episodes else 1
        n = check_episode_args(n, mean, beta)  # by the mean length: the lengths come with the draw
        expected = n * mean
        log = self.sample_log
        with as_invalid_argument:
            self._admit(expected, f"{n} episodes")
            if among is None and self.bounds is not None:
                among = self.bounds.subset(self)
            rng = None if log is None else self._before_draw(log, n)
            try:
                draw = (self.sampler if among is None else among).sample_episodes(n, self.rng)
            except BaseException:
                self._draw_refused(EPISODES, n, 0, True, rng)
                raise
            weight = self._weights(draw.probability, beta, among)
        lengths = draw.ends - draw.starts
        physical = episode_rows(draw.starts, lengths)
        self.rate_limiter.on_sample(physical.size)
        self.count_use(physical)
        if log is not None:
            log.sampled(SampleRecord(EPISODES, n, 0, True, physical.size, False, rng))
        return EpisodeSample(draw.ids, draw.starts, draw.ends, draw.probability, weight, physical)

    def sample_slices(
        self,
        n: int,
        length: int,
        *,
        strict: bool = True,
        beta: float | None = None,
        among: Subset | None = None,
    ) -> SliceSample:
        """``n`` slices of ``length`` consecutive rows, each inside one episode (see
        :meth:`Sampler.sample_slices`; ``strict=False`` admits shorter episodes, padded). The
        limiter counts ``n * length`` rows; use counts only the real ones."""
        n, length = check_slice_args(n, length, strict, beta)
        log = self.sample_log
        with as_invalid_argument:
            self._admit(n * length, f"{n} slices of {length} rows")
            if among is None and self.bounds is not None:
                among = self.bounds.subset(self)
            rng = None if log is None else self._before_draw(log, n)
            try:
                sampler = self.sampler if among is None else among
                draw = sampler.sample_slices(n, length, self.rng, strict)
            except BaseException:
                self._draw_refused(SLICES, n, length, strict, rng)
                raise
            weight = self._weights(draw.probability, beta, among)
        # a padding position repeats its slice's first row: always a live row
        flat, mask = expand_slices(draw.starts, length, None if strict else draw.lengths)
        self.rate_limiter.on_sample(n * length)
        self.count_use(flat if mask is None else flat[mask.reshape(-1)])
        if log is not None:
            log.sampled(SampleRecord(SLICES, n, length, strict, n * length, False, rng))
        return SliceSample(draw.starts, draw.lengths, draw.probability, weight, flat, mask)

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
        rank, world_size = check_rank(rank, world_size)
        registry = self.registry
        total = registry.num_rows
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
        return registry.rows_at(mine) if mine.size else mine.astype(np.int64)

    def stats(self) -> dict[str, Any]:
        out = {
            "sampler": self.sampler.stats(),
            "rate_limiter": self.rate_limiter.stats(),
            "priority_updates": self.priority_updates,
            "priority_updates_stale": self.priority_updates_stale,
        }
        if self.bounds is not None:
            out["bounds"] = self.bounds.stats(self)
        return out


def _attached(sampler: Sampler) -> bool:
    try:
        sampler.registry  # noqa: B018 (the property raises when not attached)
    except RuntimeError:
        return False
    return True
