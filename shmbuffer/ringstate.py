"""What every job of the container shares: the ring's fields, and the types the jobs pass on.

:class:`RingState` holds the ring (capacity, mode, unit, pointer, rows written, distance
travelled), the episode registry, the sampler, the rate limiter, the random generator, the
per-row use counters and the open reservations. The jobs are grouped on top of it, as the
daemon's ops are on its ``DaemonState``: :class:`~shmbuffer.reservations.ReservationOps`
(reserve, commit, abort, eviction, restore, clear), :class:`~shmbuffer.sampling.SamplingOps`
(draws, priority updates, the rate limiter's questions) and
:class:`~shmbuffer.persistence.PersistenceOps` (state, from_state, journal replay, built on
both because replay runs their code), which :class:`~shmbuffer.container.Container` is.

The jobs' methods are plain inherited methods and the fields plain attributes: a call costs
what it cost in one class (CPython caches method lookups per type), so the hot reserve,
commit and sample paths gained no hop by the split.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import NamedTuple, NoReturn, Protocol

import numpy as np
import numpy.typing as npt

from shmbuffer.errors import InvalidArgumentError, ShmBufferError
from shmbuffer.names import MODES, UNITS, check_choice
from shmbuffer.registry import Episode, EpisodeRegistry
from shmbuffer.samplers import NoLimit, RateLimiter, Sampler, UniformSampler

Range = tuple[int, int]
I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]
Mask = npt.NDArray[np.bool_]


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


@dataclass(slots=True)
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
    #: The (sub-)episodes it publishes: what ``episodes_committed`` counts. ``episodes`` can
    #: hold one more entry, for the one the ring's end splits in two.
    num_episodes: int = 1

    @property
    def num_rows(self) -> int:
        return sum(stop - start for start, stop in self.ranges)


@dataclass(frozen=True, slots=True)
class Plan:
    """What a reservation of ``num_rows`` would do, decided once against the ring as it
    stands (``Container.plan``) and consumed by ``Container.reserve``: its rows, what it
    evicts, and why it must wait if it must. Valid only while the ring has not moved."""

    num_rows: int
    #: Each episode's length, validated (a count of equal ones, or the lengths given).
    lengths: list[int]
    ranges: list[Range]
    evict: list[Range]
    #: Open reservations holding rows it would evict: writers still copying there.
    busy: list[Reservation]
    #: Why flow control holds it back (the rate limiter, unconsumed FIFO rows), or None.
    blocked: str | None
    #: ``(pointer, rows_written)`` it was made at.
    at: tuple[int, int]

    @property
    def episodes(self) -> int:
        return len(self.lengths)


@dataclass(frozen=True, slots=True)
class PriorityUpdate:
    """A validated priority update: the rows to set (stale ones left out), their priorities,
    and how many stale rows were left out (a commit's priorities travel as one too)."""

    rows: I64
    priority: F64
    stale: int


class SampleRecord(NamedTuple):
    """A draw that changed state, as a log records it and a replay redoes it: ``call`` (ROWS,
    EPISODES or SLICES of :mod:`shmbuffer.sampling`) of ``n`` items (slices of ``length``
    rows, ``strict``) handed out ``handed`` rows (the limiter's count), or was ``refused`` yet
    changed the sampler (a FIFO's drops). ``rng``: the generator's state before the draw as
    :func:`~shmbuffer.sampling.rng_words`, when a refused draw may have moved it since the
    last record (None: where the previous record's draw left it)."""

    call: int
    n: int
    length: int
    strict: bool
    handed: int
    refused: bool
    rng: Sequence[int] | None


class SampleLog(Protocol):
    """Who hears of every sample the container hands out (the daemon's journal, so that a
    resumed daemon redoes them; see ``daemon/journal.py``). Called with the owner's calls
    serialised, like everything else here."""

    def room_for_sample(self, n: int) -> None:
        """Before a draw of ``n`` items changes anything: make room for what it will record
        (OutOfSpaceError refuses the sample with nothing changed)."""

    def sampled(self, draw: SampleRecord) -> None:
        """``draw`` changed state; called before its rows are handed out."""


class RingState:
    """The container's fields; see the module docstring and
    :class:`~shmbuffer.container.Container` for the arguments."""

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
        try:
            self.rate_limiter.bind(capacity)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
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
        #: Reads per row since it was committed; -1 for rows that hold no committed data. An
        #: owner may keep it elsewhere (:meth:`keep_state_in`): only ever written in place.
        self.use_counts = np.full(capacity, -1, dtype=np.int32)
        #: Told every sample (None: nobody, as in-process); see :class:`SampleLog`.
        self.sample_log: SampleLog | None = None
        #: A refused draw may have moved the generator since the last sample logged.
        self.rng_unlogged = False
        self.reservations: dict[int, Reservation] = {}
        self._next_reservation = 1

    def keep_state_in(self, use_counts: npt.NDArray[np.int32], sample_log: SampleLog) -> None:
        """Keep the use counters in ``use_counts`` (an array of this ring's size holding the
        same values, say file-backed) and tell ``sample_log`` every draw from now on: how the
        daemon's journal keeps what reads change across a crash (``daemon/journal.py``).
        ValueError for an array of another shape or dtype."""
        if use_counts.shape != self.use_counts.shape or use_counts.dtype != np.int32:
            raise ValueError(
                f"use counts of {use_counts.dtype} {use_counts.shape}, the ring keeps int32 "
                f"{self.use_counts.shape}"
            )
        self.use_counts = use_counts
        self.sample_log = sample_log

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


def _attached(sampler: Sampler) -> bool:
    try:
        sampler.registry  # noqa: B018 (the property raises when not attached)
    except RuntimeError:
        return False
    return True
