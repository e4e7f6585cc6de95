"""Draws over the episodes a filter selected: what a uniform table draws, over fewer of them.

``sample(n, where=...)`` and its kin draw only from the episodes a metadata filter matches
(:meth:`~shmbuffer.ring.meta.EpisodeMeta.bounds`). :class:`Subset` makes that draw with the
semantics the uniform sampler has over every live episode: rows uniform over the selected
episodes' rows, episodes uniform over them, slices uniform over every start that fits a
selected episode (``strict=False``: each shorter episode one more, its padded slice). A table
hands it the draw in place of its sampler's (:meth:`~shmbuffer.ring.table.Table.sample_rows`'s
``among``) and counts, limits and logs it as any other.

Its cost is O(selected episodes) to set up and O(n log selected) to draw: flat in the size of
the buffer when the filter is selective.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from shmbuffer.errors import EmptyBufferError
from shmbuffer.samplers.base import Draw, EpisodeDraw, SliceDraw

__all__ = ["Subset"]

I64 = npt.NDArray[np.int64]


class Subset:
    """Uniform draws over the episodes ``[starts, ends)`` with ids ``ids`` (the ``where``
    text, for the error when none is selected)."""

    def __init__(self, ids: I64, starts: I64, ends: I64, where: str) -> None:
        self.ids, self.starts, self.ends = ids, starts, ends
        self.lengths = ends - starts
        self.where = where

    def _empty(self, what: str) -> EmptyBufferError:
        return EmptyBufferError(
            f"no {what} to sample: no live episode matches where={self.where!r}"
        )

    def sample_rows(self, n: int, rng: np.random.Generator) -> Draw:
        rows, _, total = _draw_positions(self.starts, self.lengths, n, rng)
        if total == 0:
            raise self._empty("rows")
        return Draw(rows, np.full(n, 1.0 / total))

    def sample_episodes(self, n: int, rng: np.random.Generator) -> EpisodeDraw:
        k = len(self.ids)
        if k == 0:
            raise self._empty("episodes")
        pick = rng.integers(0, k, size=n)
        return EpisodeDraw(self.ids[pick], self.starts[pick], self.ends[pick], np.full(n, 1.0 / k))

    def sample_slices(
        self, n: int, length: int, rng: np.random.Generator, strict: bool = True
    ) -> SliceDraw:
        fits = np.maximum(self.lengths - length + 1, 0)
        if not strict:  # a shorter episode gives one slice: from its first row, padded
            fits = np.where(self.lengths < length, 1, fits)
        offsets, episode, total = _draw_positions(np.zeros_like(fits), fits, n, rng)
        if total == 0:
            raise EmptyBufferError(
                f"cannot sample slices of {length} rows: no episode matching "
                f"where={self.where!r} is long enough"
            )
        starts = self.starts[episode] + offsets
        lengths = np.minimum(self.lengths[episode], length)
        return SliceDraw(starts, lengths, np.full(n, 1.0 / total))


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
