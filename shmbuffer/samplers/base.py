"""The sampler contract: told about commits and evictions, asked for rows, episodes or slices.

One :class:`Sampler` belongs to one container. Locking rule: every method is called by the
container's owner with calls serialised — the daemon loop, or the caller of an in-process
``Buffer`` — so a sampler takes no locks, never blocks and never sleeps. When it cannot serve a
request now it raises :class:`~shmbuffer.errors.EmptyBufferError` and changes nothing; the daemon
turns that into a wait (and, for writers, asks :meth:`Sampler.blocks_overwrite` first).

Positions are physical rows of the ring. An *item* is what priorities, epochs and
``max_times_sampled`` count: a row in transition unit, an episode in episode unit.

Costs (n draws, k rows changed, C capacity, E live episodes): ``on_commit`` and ``on_evict``
O(k) numpy work plus O(log E) per episode touched (the same order as the row copy itself);
``sample_*`` O(n log C); ``update_priorities`` O(k log C). Samplers count a sample when they
return it, so the owner validates a request (sizes, limits) *before* calling ``sample_*``.

Replay: the daemon's journal redoes a sample by drawing again, with the generator set to the
state it had (``daemon/journal.py``). So a sampler whose draws change its state
(:attr:`Sampler.draws_change_state`) must draw as a function of its own state, the live
episodes and the generator only, never of how the registry lays them out internally (a
resumed registry is rebuilt compact), and must change nothing on a refused call unless it
sets :attr:`Sampler.changed_on_refusal`.

Bad input raises ``ValueError`` naming the argument (``priority``, ``max_times_sampled``, ...)
or ``IndexError`` naming ``index``, and changes nothing.
"""

from __future__ import annotations

import math
import operator
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from shmbuffer.names import UNITS, check_choice
from shmbuffer.registry.intervals import Episode, EpisodeRegistry
from shmbuffer.samplers.declare import Declared, Option, declared
from shmbuffer.samplers.index import EpisodeIndex

__all__ = ["MAX_TIMES_SAMPLED", "Draw", "EpisodeDraw", "Sampler", "SliceDraw", "check_priority"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
Priority = float | npt.ArrayLike | None


# NamedTuples, not frozen dataclasses: built on every draw, where a frozen dataclass's
# ``__init__`` (one ``object.__setattr__`` per field) was a visible share of a uniform sample.
class Draw(NamedTuple):
    """``n`` physical rows and the probability with which each was drawn."""

    rows: I64
    probability: F64


class EpisodeDraw(NamedTuple):
    """``n`` episodes: ids, physical bounds ``[starts, ends)`` and their probabilities."""

    ids: I64
    starts: I64
    ends: I64
    probability: F64


class SliceDraw(NamedTuple):
    """``n`` slices: physical first rows and real lengths (``< length`` only when not strict)."""

    starts: I64
    lengths: I64
    probability: F64


_INF_BITS = int(np.array(np.inf).view(np.uint64))


def check_priority(
    priority: npt.ArrayLike, count: int, what: str = "priority", most: float = math.inf
) -> F64:
    """``priority`` as ``count`` float64 values (a scalar is repeated); ValueError unless every
    value is finite, >= 0 and <= ``most`` (a sampler's :attr:`Sampler.priority_limit`) and an
    array has exactly ``count`` entries."""
    arr = np.asarray(priority, dtype=np.float64)
    if arr.ndim == 0:
        arr = np.full(count, float(arr))
    elif arr.ndim != 1 or arr.size != count:
        raise ValueError(f"{what} needs {count} values (one per item), got shape {arr.shape}")
    # One reduction: the bits of a float >= 0 (sign clear), read as unsigned, order as the
    # values do, and +inf's lie above every finite one's; NaN and negatives (-0.0 too,
    # accepted below) lie above those of any bound.
    if arr.size and int(np.maximum.reduce(arr.view(np.uint64))) <= _bits_below(most):
        return arr
    bad = ~np.isfinite(arr) | (arr < 0) | (arr > most)
    if bad.any():
        i = int(np.argmax(bad))
        rule = "finite and >= 0"
        if most < math.inf:
            rule = (
                f"finite, >= 0 and at most {most:.6g} (the sampler's sum of weights "
                "(priority + eps) ** alpha over every item must stay a finite float64)"
            )
        raise ValueError(f"{what}[{i}] = {float(arr[i])}: priorities must be {rule}")
    return arr


def _bits_below(most: float) -> int:
    """The largest float64 bit pattern (read as unsigned) of a value in ``[0, most]``, and
    finite: below +inf's own."""
    if most >= math.inf:
        return _INF_BITS - 1
    return int(np.array(max(most, 0.0), dtype=np.float64).view(np.uint64))


def check_update(
    rows: npt.ArrayLike, priority: npt.ArrayLike, capacity: int, most: float = math.inf
) -> tuple[I64, F64]:
    """Validated ``(rows, priority)`` of an ``update_priorities`` call (``most``: as for
    :func:`check_priority`)."""
    idx = np.asarray(rows)
    if idx.ndim != 1 or (idx.dtype.kind not in "iu" and idx.size):
        raise ValueError(f"index must be a 1-D integer array, got {idx.dtype} {idx.shape}")
    idx = idx.astype(np.int64, copy=False)
    # One reduction: a negative index read as unsigned is >= 2**63, beyond any capacity.
    if idx.size and int(np.maximum.reduce(idx.view(np.uint64))) >= capacity:
        bad = int(idx[(idx < 0) | (idx >= capacity)][0])
        raise IndexError(f"index {bad} out of range for a buffer of capacity {capacity}")
    return idx, check_priority(priority, idx.size, most=most)


def check_generation(generation: npt.ArrayLike, rows: I64) -> I64:
    """The generation stamps an ``update_priorities`` call gives for ``rows`` (checked by
    :func:`check_update`): one integer per row, else ValueError naming what came."""
    stamps = np.asarray(generation)
    if stamps.shape != rows.shape or (stamps.dtype.kind not in "iu" and stamps.size):
        raise ValueError(
            f"generation needs {rows.size} integer stamps (one per index), "
            f"got {stamps.dtype} {list(stamps.shape)}"
        )
    return stamps.astype(np.int64, copy=False)


def check_count(value: int, what: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got {value!r}")
    value = operator.index(value)
    if value < 1:
        raise ValueError(f"{what} must be >= 1, got {value}")
    return value


#: Every sampler's option: an item (row, or episode in episode unit) retires after this many
#: samples, which makes any sampler's samples consume what they hand out.
MAX_TIMES_SAMPLED: Option[int | None] = Option(
    "max_times_sampled",
    int,
    None,
    "retire an item after K samples; with fifo writers wait for unconsumed rows",
)


class Sampler(Declared, ABC):
    """Which committed rows, episodes or slices a read gets; see the module docstring.

    A sampler declares itself (:class:`~shmbuffer.samplers.declare.Declared`): its ``name``
    (``--sampler``), its constructor ``options`` and its capabilities (``has_priorities``,
    ``consumes``, ``waits_for_data``), read by whatever configures or serves it. A new
    sampler is best written against the narrow item contract instead
    (:class:`~shmbuffer.samplers.selector.Selector`), which the shared layer
    (:class:`~shmbuffer.samplers.shapes.SelectorSampler`) serves through this one.
    """

    options: tuple[Option[Any], ...] = (MAX_TIMES_SAMPLED,)
    #: The largest priority it can keep (``check_priority``'s ``most``): what its sums stay
    #: finite with; set once attached to a capacity.
    priority_limit: float = math.inf
    #: Whether draws take numbers from the generator (the journal then keeps its state where
    #: a refused call may have moved it; see ``daemon/journal.py``).
    uses_rng: bool = True

    def __init__(self, *, max_times_sampled: int | None = None) -> None:
        if max_times_sampled is not None:
            max_times_sampled = check_count(max_times_sampled, "max_times_sampled")
        self.max_times_sampled: int | None = max_times_sampled
        #: Set by a call that raised EmptyBufferError yet changed state (a FIFO keeps the
        #: drops it made); the owner journals such a call and clears the flag.
        self.changed_on_refusal = False
        self.unit = "transition"
        self.capacity = 0
        self._registry: EpisodeRegistry | None = None
        self.index = EpisodeIndex(1)

    # -- lifecycle (called by the container) ----------------------------------------------

    def attach(self, registry: EpisodeRegistry, unit: str, capacity: int) -> None:
        """Bind to the container's registry; existing episodes count as just committed.

        Called once by the container, and again whenever it rebuilds its registry from a
        checkpoint or a journal (``load_state_dict`` comes after it). An abort's
        ``Container.restore`` calls :meth:`on_restore` instead, which keeps sampler state.
        """
        self.unit = check_choice("unit", unit, UNITS)
        if capacity != registry.capacity:
            raise ValueError(f"capacity {capacity} != registry capacity {registry.capacity}")
        self._registry = registry
        self.capacity = capacity
        self.index = EpisodeIndex(capacity)
        self._reset()
        existing = list(registry)
        if existing:
            self.on_commit(existing)

    @property
    def registry(self) -> EpisodeRegistry:
        if self._registry is None:
            raise RuntimeError(f"the {self.name} sampler is not attached to a container")
        return self._registry

    @abstractmethod
    def _reset(self) -> None:
        """Empty state for the current unit and capacity (``index`` is already empty)."""

    @abstractmethod
    def on_commit(self, episodes: Sequence[Episode], priority: Priority = None) -> None:
        """``episodes`` were just published (physical bounds, ids increasing).

        ``priority``: None (new data gets the largest priority seen so far), a scalar, or one
        value per row (transition unit, rows of all ``episodes`` in order) or per episode
        (episode unit). Validate it first with :meth:`check_commit_priority`.
        """

    @abstractmethod
    def on_evict(self, start: int, stop: int) -> None:
        """Rows ``[start, stop)`` no longer hold committed data; the registry already changed.

        Called for every evicted or trimmed range. Episodes the registry dropped whole
        (including rows outside the range) and trimmed tails are found through the registry,
        so calling it once per range the container passed to its eviction is enough.
        """

    @abstractmethod
    def on_restore(self, episodes: Sequence[Episode], registry: EpisodeRegistry) -> None:
        """``episodes`` are published again under their old ids (an aborted reservation gave
        back what it evicted or trimmed; a trimmed chunk gets its front rows back).

        ``registry`` is the container's registry now (``Container.restore`` rebuilds it). The
        rows come back with the state they had when evicted (priorities, counts, consumed
        marks, epoch membership) as long as the sampler still remembers it — the last
        ``capacity`` rows evicted — else as new data. O(rows restored), plus an O(C) slice
        normaliser rebuild on the next ``sample_slices``.
        """

    @abstractmethod
    def on_clear(self) -> None:
        """Every committed row is gone (the registry was cleared)."""

    # -- sampling ----------------------------------------------------------------------------

    @abstractmethod
    def sample_rows(self, n: int, rng: np.random.Generator) -> Draw: ...

    @abstractmethod
    def sample_episodes(self, n: int, rng: np.random.Generator) -> EpisodeDraw: ...

    @abstractmethod
    def sample_slices(
        self, n: int, length: int, rng: np.random.Generator, strict: bool = True
    ) -> SliceDraw:
        """``n`` slices of ``length`` rows, each inside one episode.

        With ``strict=False`` an episode shorter than ``length`` is admitted too: its slice
        starts at its first row and ``lengths[i]`` is its length (the caller pads).
        """

    # -- priorities and weights --------------------------------------------------------------

    def check_commit_priority(self, episodes: Sequence[Episode], priority: Priority) -> F64 | None:
        """The per-item priorities ``on_commit`` would store; ValueError for a bad ``priority``.

        The owner may call it before publishing, so a bad value is refused with nothing done.
        """
        if priority is None:
            return None
        if not self.has_priorities:
            raise ValueError(f"priority given, but the {self.name} sampler keeps no priorities")
        count = len(episodes) if self.unit == "episode" else sum(ep.length for ep in episodes)
        return check_priority(priority, count, most=self.priority_limit)

    def update_priorities(self, rows: npt.ArrayLike, priority: npt.ArrayLike) -> int:
        """Set the priority of the items holding physical ``rows``; return how many were set.

        Rows holding no committed data are skipped. Only samplers that declare
        ``has_priorities`` keep priorities.
        """
        keeping = ", ".join(name for name, kind in declared().items() if kind.has_priorities)
        raise ValueError(
            f"update_priorities needs a sampler that keeps priorities ({keeping}); this "
            f"buffer's sampler is {self.name!r}"
        )

    def set_priorities(self, rows: I64, priority: F64) -> int:
        """:meth:`update_priorities` for arrays already validated by :func:`check_update`
        (int64 rows in range, float64 priorities finite and >= 0): the owner's path, which
        validated them once before it journals them."""
        return self.update_priorities(rows, priority)

    def weights(self, probability: npt.ArrayLike, beta: float | None = None) -> F64:
        """Importance weights for draws of ``probability`` (``beta`` None: the sampler's
        default exponent); ones unless the sampler keeps priorities."""
        if beta is not None:
            check_beta(beta)
        return np.ones(np.shape(probability), dtype=np.float64)

    def blocks_overwrite(self, start: int, stop: int) -> bool:
        """True while rows ``[start, stop)`` hold data a reader has not consumed yet."""
        return False

    @property
    def consuming(self) -> bool:
        """Whether this sampler's samples consume what they hand out (see :attr:`consumes`)."""
        return self.consumes or self.max_times_sampled is not None

    @property
    def waits_when_empty(self) -> bool:
        """Whether a sample with nothing to hand out waits (see :attr:`waits_for_data`)."""
        return self.waits_for_data or self.max_times_sampled is not None

    @property
    def rows_uniform_over_spans(self) -> bool:
        """Whether ``sample_rows`` draws every live row equally likely through the registry's
        runs of live rows alone (``EpisodeRegistry.sample_rows``) and changes nothing: then a
        reader may draw its rows itself over the runs the daemon publishes
        (``registry/shared_spans.py``) and get what this sampler would give it. None does
        unless it says so."""
        return False

    @property
    def draws_change_state(self) -> bool:
        """Whether a draw changes this sampler's state (counts, consumption, epochs): what a
        journal replay must then redo exactly. Only ``max_times_sampled`` does, here."""
        return self.max_times_sampled is not None

    # -- state -------------------------------------------------------------------------------

    def settings(self) -> dict[str, Any]:
        """The constructor options this sampler was made with (``make_sampler(name, **it)``
        builds an equal one: how a resumed buffer rebuilds the saved sampler): one value
        per declared option, kept under the option's name."""
        return {option.name: getattr(self, option.name) for option in self.options}

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """msgpack-able state (ints, floats, str, lists, bytes); the index is rebuilt on attach."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` after :meth:`attach` to the same data."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """A small dict for ``status``."""

    def _check_state(self, state: dict[str, Any]) -> None:
        for key, want in (("sampler", self.name), ("unit", self.unit), ("capacity", self.capacity)):
            if state.get(key) != want:
                raise ValueError(f"sampler state has {key}={state.get(key)!r}, expected {want!r}")

    def _header(self) -> dict[str, Any]:
        return {"sampler": self.name, "unit": self.unit, "capacity": self.capacity}


def check_beta(beta: float) -> float:
    beta = float(beta)
    if not math.isfinite(beta) or beta < 0:
        raise ValueError(f"importance exponent beta must be finite and >= 0, got {beta!r}")
    return beta


def to_bytes(array: npt.NDArray[Any]) -> bytes:
    return np.ascontiguousarray(array).tobytes()


def from_bytes(data: bytes, dtype: type[np.generic], size: int, what: str) -> npt.NDArray[Any]:
    arr = np.frombuffer(data, dtype=dtype)
    if arr.size != size:
        raise ValueError(f"sampler state {what!r} has {arr.size} entries, expected {size}")
    return arr.copy()
