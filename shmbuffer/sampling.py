"""Reading the container: draws by the sampler, priority updates, the rate limiter's say.

The container owns the :class:`~shmbuffer.samplers.Sampler`, the
:class:`~shmbuffer.samplers.RateLimiter` and the random generator; the in-process
:class:`~shmbuffer.Buffer` and the daemon call the same ``sample_*`` methods here, so both run
the same code. Every draw is counted in the per-row use counters and told to the limiter. A
request the limiter (or a FIFO sampler holding unconsumed rows) refuses raises
:class:`~shmbuffer.errors.WaitTimeoutError`; the daemon asks :meth:`SamplingOps.sample_blocker`
(and, for writes, the ``blocked`` of a ``plan``) first and parks the request instead. Bad
arguments (a negative or NaN priority, an index out of range, a call the sampler does not serve
in this unit) raise :class:`~shmbuffer.errors.InvalidArgumentError` with nothing changed; a
sample over the protocol's limits (``MAX_SAMPLE`` items, ``MAX_SAMPLE_ROWS`` rows:
``protocol.py``, their one home) raises :class:`~shmbuffer.errors.LimitExceededError` before
anything is drawn, in process as in a daemon. The counts, a slice's length and strictness and
a rank are checked by :mod:`shmbuffer.reads`, as the daemon's Reader checks them.

With a :class:`~shmbuffer.ringstate.SampleLog` (the daemon's journal) every draw is told to it
before the caller hands the rows out: the call, its size and the rows counted by the limiter
(a resumed daemon draws again,
:meth:`~shmbuffer.persistence.PersistenceOps.replay_sample`), plus the generator's
state when a refused draw may have moved it since. Nothing more is logged per sample, so the
cost is one small record (``bench/sample_journal.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from shmbuffer.errors import WaitTimeoutError
from shmbuffer.reads import (
    check_episode_args,
    check_rank,
    check_sample_args,
    check_slice_args,
    check_update_args,
    expand_slices,
)
from shmbuffer.ringstate import (
    F64,
    I64,
    Mask,
    PriorityUpdate,
    RingState,
    SampleLog,
    SampleRecord,
    as_invalid_argument,
    raise_invalid,
)
from shmbuffer.rows import episode_rows
from shmbuffer.spans import loaded_draws

_ONE_USE = np.int32(1)  # count_use's increment, of use_counts' dtype (numpy's fast add.at)
#: The kinds of draw a :class:`~shmbuffer.ringstate.SampleLog` is told (journaled as numbers).
ROWS, EPISODES, SLICES = 0, 1, 2
_U64 = (1 << 64) - 1


def rng_words(rng: np.random.Generator) -> list[int] | None:
    """The generator's state as six int64 words (PCG64's state and increment, 128 bits each,
    and its buffered 32-bit half); None for another bit generator. Not cheap next to a
    draw: taken only when a refused draw may have moved it."""
    state = rng.bit_generator.state
    if state.get("bit_generator") != "PCG64":
        return None
    words = [state["state"]["state"], state["state"]["inc"]]
    split = [part for w in words for part in (w & _U64, w >> 64)]
    return [v - (1 << 64) if v >= 1 << 63 else v for v in split] + [
        int(state["has_uint32"]),
        int(state["uinteger"]),
    ]


def set_rng_words(rng: np.random.Generator, words: Sequence[int]) -> None:
    """Undo :func:`rng_words` into ``rng`` (a PCG64 generator); ValueError if they do not fit."""
    if len(words) != 6 or rng.bit_generator.state.get("bit_generator") != "PCG64":
        raise ValueError(f"generator state of {len(words)} words does not fit this generator")
    u = [int(w) & _U64 for w in words[:4]]
    rng.bit_generator.state = {
        "bit_generator": "PCG64",
        "state": {"state": u[0] | u[1] << 64, "inc": u[2] | u[3] << 64},
        "has_uint32": int(words[4]),
        "uinteger": int(words[5]) & 0xFFFFFFFF,
    }


class RowSample(NamedTuple):
    """Rows a read gets: physical ``rows``, each one's draw ``probability`` and importance
    ``weight`` (ones unless the sampler keeps priorities). The arrays may be read-only and
    shared between calls: copy before changing them. A NamedTuple, as the samplers' draws:
    half the cost of a frozen dataclass to build, on the hot path of every sample."""

    rows: I64
    probability: F64
    weight: F64


class EpisodeSample(NamedTuple):
    """Whole episodes: ids, physical bounds ``[starts, ends)``, probability and weight per
    episode, and ``rows``, their physical rows concatenated."""

    ids: I64
    starts: I64
    ends: I64
    probability: F64
    weight: F64
    rows: I64


class SliceSample(NamedTuple):
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


class SamplingOps(RingState):
    """The read side of the container: samples, use counts, priorities, every-row shares."""

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

    def _weights(self, probability: F64, beta: float | None) -> F64:
        if self.sampler.has_priorities:
            return self.sampler.weights(probability, beta)
        # What every other sampler returns: ones, kept read-only and reused (a fresh array
        # per call was a visible share of a uniform Buffer.sample(256)).
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
        # zero-cost exceptions), where the ``with`` was a visible share of a sample.
        log = self.sample_log
        limiter = self.rate_limiter
        try:
            n = check_sample_args(n, beta, "n")
            if not limiter.can_sample(n):
                raise self._refused(f"{n} rows")
            rng = None if log is None else self._before_draw(log, n)
            try:
                draw = self.sampler.sample_rows(n, self.rng)
            except BaseException:
                self._draw_refused(ROWS, n, 0, True, rng)
                raise
            weight = self._weights(draw.probability, beta)
        except (ValueError, IndexError) as exc:
            raise_invalid(exc)
        limiter.on_sample(n)
        self.count_use(draw.rows)
        if log is not None:
            log.sampled(SampleRecord(ROWS, n, 0, True, n, False, rng))
        return RowSample(draw.rows, draw.probability, weight)

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

    def sample_episodes(self, n: int, *, beta: float | None = None) -> EpisodeSample:
        """``n`` whole episodes by the sampler. The limiter is asked about ``n`` times the mean
        stored episode length (the lengths are known only after the draw, which the sampler
        counts) and told the rows actually handed out."""
        episodes = len(self.registry)
        mean = max(1, round(self.registry.num_rows / episodes)) if episodes else 1
        n = check_episode_args(n, mean, beta)  # by the mean length: the lengths come with the draw
        expected = n * mean
        log = self.sample_log
        with as_invalid_argument:
            self._admit(expected, f"{n} episodes")
            rng = None if log is None else self._before_draw(log, n)
            try:
                draw = self.sampler.sample_episodes(n, self.rng)
            except BaseException:
                self._draw_refused(EPISODES, n, 0, True, rng)
                raise
            weight = self._weights(draw.probability, beta)
        lengths = draw.ends - draw.starts
        physical = episode_rows(draw.starts, lengths)
        self.rate_limiter.on_sample(physical.size)
        self.count_use(physical)
        if log is not None:
            log.sampled(SampleRecord(EPISODES, n, 0, True, physical.size, False, rng))
        return EpisodeSample(draw.ids, draw.starts, draw.ends, draw.probability, weight, physical)

    def sample_slices(
        self, n: int, length: int, *, strict: bool = True, beta: float | None = None
    ) -> SliceSample:
        """``n`` slices of ``length`` consecutive rows, each inside one episode (see
        :meth:`Sampler.sample_slices`; ``strict=False`` admits shorter episodes, padded). The
        limiter counts ``n * length`` rows; use counts only the real ones."""
        n, length = check_slice_args(n, length, strict, beta)
        log = self.sample_log
        with as_invalid_argument:
            self._admit(n * length, f"{n} slices of {length} rows")
            rng = None if log is None else self._before_draw(log, n)
            try:
                draw = self.sampler.sample_slices(n, length, self.rng, strict)
            except BaseException:
                self._draw_refused(SLICES, n, length, strict, rng)
                raise
            weight = self._weights(draw.probability, beta)
        # a padding position repeats its slice's first row: always a live row
        flat, mask = expand_slices(draw.starts, length, None if strict else draw.lengths)
        self.rate_limiter.on_sample(n * length)
        self.count_use(flat if mask is None else flat[mask.reshape(-1)])
        if log is not None:
            log.sampled(SampleRecord(SLICES, n, length, strict, n * length, False, rng))
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
        InvalidArgumentError for an index out of range, a negative, NaN or too large priority
        (one whose weight could overflow the sampler's sums), lengths that differ, or a
        sampler that keeps no priorities."""
        sampler = self.sampler
        index, given, seen = check_update_args(
            rows, priority, generation, self.capacity, sampler.priority_limit
        )
        if not sampler.has_priorities:
            with as_invalid_argument:
                sampler.update_priorities(index, given)  # its refusal, naming it
        if seen is None:
            return PriorityUpdate(index, given, 0)
        if stamps is None:
            raise TypeError("check_priorities: generation given without stamps")
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
        rank, world_size = check_rank(rank, world_size)
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
