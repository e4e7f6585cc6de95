"""Draws over the episodes a filter selected: what the table's sampler draws, over fewer of them.

``sample(n, where=...)`` and its kin draw only from the episodes a metadata filter matches
(:meth:`~shmbuffer.ring.meta.EpisodeMeta.subset`), and a bounded table (``max_episodes``,
``max_staleness``: :mod:`shmbuffer.ring.bounds`) only from the episodes its bounds keep. A table
hands the draw to one of these in place of its sampler's
(:meth:`~shmbuffer.ring.table.Table.sample_rows`'s ``among``) and counts, limits and logs it as
any other.

- :class:`Subset`: what a uniform table draws, over the selected episodes: rows uniform over
  their rows, episodes uniform, slices uniform over every start that fits (``strict=False``:
  each shorter episode one more, its padded slice).
- :class:`PrioritySubset`: what a prioritized table draws (``samplers/prioritized.py``'s
  module docstring), with the selected items' weights alone as the mass: a row (transition
  unit) or an episode (episode unit) in proportion to its weight over the selected weight.

Both take a per-episode ``factor`` (a table's ``staleness_weights``): each episode's mass is
multiplied by it, so an episode of factor 0.5 is drawn half as often as it would be.

Importance weights (:meth:`PrioritySubset.weights`) are the prioritized sampler's, over the
selected items: ``(N * P) ** -beta`` over its largest value in the selection, which is
``(w / w_min) ** -beta`` with ``w`` the drawn item's priority weight and ``w_min`` the smallest
positive one selected. The selection is the population the draw stands for (a filtered draw
without priorities is uniform over it), so its weights correct towards uniform over the
selection, and stay <= 1 as the sampler's do. A ``factor`` is left out of them: it says on
purpose which episodes to learn from less, as the filter says which not to learn from at all,
and a correction would undo it.

Cost: O(selected episodes) to set up a uniform draw and O(n log selected) to draw, flat in the
size of the buffer when the selection is small; a prioritized one reads the selected items'
weights on every draw (they change with every priority update): O(selected rows) in transition
unit, O(selected episodes) in episode unit.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np
import numpy.typing as npt

from shmbuffer.errors import EmptyBufferError
from shmbuffer.samplers.base import Draw, EpisodeDraw, SliceDraw, check_beta
from shmbuffer.storage.indices import episode_rows

__all__ = ["PrioritySubset", "Subset", "Weighted"]

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]


class Weighted(Protocol):
    """What a prioritized subset needs of its sampler: each item's weight now (0 for an item
    that may not be drawn) and the default importance exponent."""

    importance_exponent: float

    def item_weights(self, keys: I64) -> F64: ...


class Subset:
    """Uniform draws over the episodes ``[starts, ends)`` with ids ``ids``; ``where``: what
    selected them, for the error when none is; ``factor``: each episode's weight (None: 1)."""

    def __init__(
        self, ids: I64, starts: I64, ends: I64, where: str, factor: F64 | None = None
    ) -> None:
        self.ids, self.starts, self.ends = ids, starts, ends
        self.lengths = ends - starts
        self.where = where
        self.factor = factor

    def _empty(self, what: str) -> EmptyBufferError:
        return EmptyBufferError(f"no {what} to sample: no live episode matches {self.where}")

    def sample_rows(self, n: int, rng: np.random.Generator) -> Draw:
        if self.factor is None:
            rows, _, total = _draw_positions(self.starts, self.lengths, n, rng)
            if total == 0:
                raise self._empty("rows")
            return Draw(rows, np.full(n, 1.0 / total))
        mass = self.factor * self.lengths
        run, weight = _pick(mass, n, rng)
        if run is None:
            raise self._empty("rows")
        rows = self.starts[run] + rng.integers(0, self.lengths[run])
        return Draw(rows, self.factor[run] / weight)

    def sample_episodes(self, n: int, rng: np.random.Generator) -> EpisodeDraw:
        k = len(self.ids)
        if self.factor is None:
            if k == 0:
                raise self._empty("episodes")
            pick = rng.integers(0, k, size=n)
            probability = np.full(n, 1.0 / k)
        else:
            chosen, total = _pick(self.factor, n, rng)
            if chosen is None:
                raise self._empty("episodes")
            pick, probability = chosen, self.factor[chosen] / total
        return EpisodeDraw(self.ids[pick], self.starts[pick], self.ends[pick], probability)

    def sample_slices(
        self, n: int, length: int, rng: np.random.Generator, strict: bool = True
    ) -> SliceDraw:
        fits = _fits(self.lengths, length, strict)
        if self.factor is None:
            offsets, episode, total = _draw_positions(np.zeros_like(fits), fits, n, rng)
            if total == 0:
                raise self._too_short(length)
            probability = np.full(n, 1.0 / total)
        else:
            mass = self.factor * fits
            chosen, weight = _pick(mass, n, rng)
            if chosen is None:
                raise self._too_short(length)
            episode, probability = chosen, self.factor[chosen] / weight
            offsets = rng.integers(0, fits[episode])
        starts = self.starts[episode] + offsets
        lengths = np.minimum(self.lengths[episode], length)
        return SliceDraw(starts, lengths, probability)

    def _too_short(self, length: int) -> EmptyBufferError:
        return EmptyBufferError(
            f"cannot sample slices of {length} rows: no episode matching {self.where} is "
            "long enough"
        )

    def weights(self, probability: F64, beta: float | None) -> F64:
        """Ones: a uniform table corrects nothing (its factors are chosen, not a bias)."""
        if beta is not None:
            check_beta(beta)
        return np.ones(probability.size)


class PrioritySubset(Subset):
    """Draws by priority over the episodes ``[starts, ends)`` (see the module docstring):
    ``sampler`` gives the items' weights, ``unit`` says what an item is (a row in
    ``"transition"`` unit, an episode, keyed by its first row, in ``"episode"`` unit)."""

    def __init__(
        self,
        ids: I64,
        starts: I64,
        ends: I64,
        where: str,
        sampler: Weighted,
        unit: str,
        factor: F64 | None = None,
    ) -> None:
        super().__init__(ids, starts, ends, where, factor)
        self.beta = sampler.importance_exponent
        self.by_row = unit == "transition"
        if self.by_row:
            self.rows = episode_rows(starts, self.lengths)
            self.priority = sampler.item_weights(self.rows)
            self.mass = self.priority
            if factor is not None:
                self.mass = self.priority * np.repeat(factor, self.lengths)
        else:
            self.priority = sampler.item_weights(starts)
            self.mass = self.priority if factor is None else self.priority * factor
        drawable = self.priority[self.mass > 0]
        self.lowest = float(drawable.min()) if drawable.size else math.inf
        #: The priority weight of each item the last draw returned: what :meth:`weights` reads.
        self.drawn: F64 = np.zeros(0)

    def sample_rows(self, n: int, rng: np.random.Generator) -> Draw:
        pick, total = _pick(self.mass, n, rng)
        if pick is None:
            raise self._empty("rows")
        self.drawn = self.priority[pick]
        probability = self.mass[pick] / total
        if self.by_row:
            return Draw(self.rows[pick], probability)
        return Draw(self.starts[pick] + rng.integers(0, self.lengths[pick]), probability)

    def sample_episodes(self, n: int, rng: np.random.Generator) -> EpisodeDraw:
        mass, priority = self.mass, self.priority
        if self.by_row and len(self.ids):  # a chunk by a row drawn by weight: its summed weight
            firsts = np.cumsum(self.lengths) - self.lengths
            mass, priority = np.add.reduceat(mass, firsts), np.add.reduceat(priority, firsts)
        pick, total = _pick(mass, n, rng)
        if pick is None:
            raise self._empty("episodes")
        self.drawn = priority[pick]
        return EpisodeDraw(self.ids[pick], self.starts[pick], self.ends[pick], mass[pick] / total)

    def sample_slices(
        self, n: int, length: int, rng: np.random.Generator, strict: bool = True
    ) -> SliceDraw:
        fits = _fits(self.lengths, length, strict)
        if self.by_row:  # the start row by its own weight, among the rows a slice may start at
            offset = np.arange(self.rows.size) - np.repeat(
                np.cumsum(self.lengths) - self.lengths, self.lengths
            )
            valid = offset < np.repeat(fits, self.lengths)
            pick, total = _pick(self.mass * valid, n, rng)
            if pick is None:
                raise self._too_short(length)
            episode = np.searchsorted(np.cumsum(self.lengths), pick, side="right")
            starts = self.rows[pick]
        else:  # an episode by weight among those long enough, then a uniform start
            pick, total = _pick(self.mass * (fits > 0), n, rng)
            if pick is None:
                raise self._too_short(length)
            episode = pick
            starts = self.starts[pick] + rng.integers(0, fits[pick])
        self.drawn = self.priority[pick]
        probability = self.mass[pick] / total
        return SliceDraw(starts, np.minimum(self.lengths[episode], length), probability)

    def weights(self, probability: F64, beta: float | None) -> F64:
        beta = self.beta if beta is None else check_beta(beta)
        if not math.isfinite(self.lowest) or self.lowest <= 0:
            return np.ones(probability.size)
        out: F64 = np.power(self.drawn / self.lowest, -beta)
        return out


def _fits(lengths: I64, length: int, strict: bool) -> I64:
    """How many slices of ``length`` rows each episode holds (``strict=False``: a shorter one
    holds one, from its first row, padded)."""
    fits: I64 = np.maximum(lengths - length + 1, 0)
    if not strict:
        fits = np.where(lengths < length, 1, fits)
    return fits


def _pick(
    mass: npt.NDArray[np.float64] | I64, n: int, rng: np.random.Generator
) -> tuple[I64 | None, float]:
    """``n`` indices drawn in proportion to ``mass`` (>= 0), and its total; None when it
    holds no mass. An index of mass 0 is never drawn, rounding at the top included."""
    positive = np.flatnonzero(mass > 0)
    if positive.size == 0:
        return None, 0.0
    cumulative = np.cumsum(mass, dtype=np.float64)
    total = float(cumulative[-1])
    pick = np.searchsorted(cumulative, rng.random(n) * total, side="right")
    return np.minimum(pick, positive[-1]), total


def _draw_positions(
    firsts: I64, counts: I64, n: int, rng: np.random.Generator
) -> tuple[I64, I64, int]:
    """``n`` positions uniform over the runs ``[firsts[i], firsts[i] + counts[i])`` taken
    together: the positions, the run each is in, and how many positions there are."""
    ends = np.cumsum(counts)
    total = int(ends[-1]) if len(ends) else 0
    if total == 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64), 0
    u = rng.integers(0, total, size=n)
    run = np.searchsorted(ends, u, side="right")
    return firsts[run] + (u - (ends[run] - counts[run])), run, total
