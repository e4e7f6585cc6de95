"""Uniform sampling with replacement: the registry's O(log n) draws, with exact probabilities.

* ``sample_rows``: every live row equally likely, ``P = 1 / rows``.
* ``sample_episodes``: every live episode equally likely, ``P = 1 / episodes``.
* ``sample_slices``: every valid start equally likely (a start whose ``length`` rows lie in one
  episode: an episode of ``L >= length`` rows has ``L - length + 1``), ``P = 1 / T1``. With
  ``strict=False`` each shorter episode adds one start, its first row: ``P = 1 / (T1 + T2)``
  with ``T2`` the number of short episodes. A draw picks the long part with probability
  ``T1 / (T1 + T2)`` (then the registry's slice draw) or the short part (then uniform episodes
  by rejection, keeping short ones: ``E / T2`` tries per short draw, but short draws are only a
  ``T2 / (T1 + T2)`` share and ``T1 + T2 >= E``, so under one try per slice on average).
  ``T1`` and ``T2`` are counts kept per slice length by
  :class:`~shmbuffer.samplers.index.SliceMass` as rows come and go (exact integers, no scans).

The sampler's :class:`~shmbuffer.samplers.index.EpisodeIndex` serves only slices (their
masses and counts), so it is mirrored lazily: built from the registry the first time it is
read (O(C)), kept up to date from then on. A buffer that samples only rows or episodes never
pays for it on its writes (the mirror makes small writes into a full ring markedly slower:
``docs/sampling.md``).

Importance weights are ones. ``max_times_sampled=K`` needs the draws to skip retired items,
which the registry cannot do; the sampler then runs a :class:`PrioritizedSampler` with
``priority_exponent=0`` (all weights 1) inside, which draws every live, unretired *item*
(row in transition unit, episode in episode unit) equally likely.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from shmbuffer.errors import EmptyBufferError
from shmbuffer.registry.intervals import Episode, EpisodeRegistry
from shmbuffer.samplers.base import (
    MAX_TIMES_SAMPLED,
    Draw,
    EpisodeDraw,
    Priority,
    Sampler,
    SliceDraw,
    check_count,
)
from shmbuffer.samplers.index import EpisodeIndex, SliceMasses, rows_of
from shmbuffer.samplers.prioritized import PrioritizedSampler

__all__ = ["UniformSampler"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


class UniformSampler(Sampler):
    """Uniform draws with replacement; see the module docstring."""

    name = "uniform"

    def __init__(self, *, max_times_sampled: int | None = MAX_TIMES_SAMPLED.default) -> None:
        self._index = EpisodeIndex(1)
        self._mirrored = False  # whether _index follows the registry yet (module docstring)
        super().__init__(max_times_sampled=max_times_sampled)
        self._engine: PrioritizedSampler | None = None
        if self.max_times_sampled is not None:
            self._engine = PrioritizedSampler(
                priority_exponent=0.0, max_times_sampled=self.max_times_sampled
            )
        self._masses = SliceMasses(exact=True)
        self._probability: F64 = np.zeros(0)
        self._probability_key: tuple[int, float] = (0, 0.0)

    def attach(self, registry: EpisodeRegistry, unit: str, capacity: int) -> None:
        if self._engine is None:
            super().attach(registry, unit, capacity)
            return
        self._engine.attach(registry, unit, capacity)
        self._registry, self.unit, self.capacity = registry, unit, capacity

    def _reset(self) -> None:
        self._masses.clear()

    @property
    def index(self) -> EpisodeIndex:
        """The row mirror of the registry, built on first use (see the module docstring)."""
        if not self._mirrored and self._registry is not None:
            self._index.clear()
            self._index.add(self._registry)
            self._masses.clear()
            self._mirrored = True
        return self._index

    @index.setter
    def index(self, value: EpisodeIndex) -> None:
        self._index, self._mirrored = value, False

    # -- container events --------------------------------------------------------------------

    def on_commit(self, episodes: Sequence[Episode], priority: Priority = None) -> None:
        self.check_commit_priority(episodes, priority)
        if self._engine is not None:
            self._engine.on_commit(episodes)
            return
        if not self._mirrored:
            return
        self.index.add(episodes)
        if self._masses.has_lengths():
            rows = rows_of([ep.start for ep in episodes], [ep.end for ep in episodes])
            self._masses.change(self.index, rows, np.zeros(rows.size), np.ones(rows.size))

    def on_evict(self, start: int, stop: int) -> None:
        if self._engine is not None:
            self._engine.on_evict(start, stop)
            return
        if not self._mirrored:
            return
        removals = self.index.removals(start, stop, self.registry)
        if self._masses.has_lengths():
            rows = rows_of([rm.start for rm in removals], [rm.stop for rm in removals])
            self._masses.change(self.index, rows, np.ones(rows.size), np.zeros(rows.size))
        self.index.apply(removals)
        survivors = np.asarray([rm.survivor for rm in removals if rm.survivor is not None])
        if survivors.size and self._masses.has_lengths():
            survivors = survivors.astype(np.int64)
            self._masses.gain_first(self.index, survivors, np.ones(survivors.size))

    def on_restore(self, episodes: Sequence[Episode], registry: EpisodeRegistry) -> None:
        self._registry = registry
        if self._engine is not None:
            self._engine.on_restore(episodes, registry)
            return
        if not self._mirrored:
            return
        self.index.restore(episodes)
        self._masses.clear()  # recounted on the next slice draw: aborts are rare

    def on_clear(self) -> None:
        if self._engine is not None:
            self._engine.on_clear()
            return
        self.index.clear()
        self._masses.clear()

    @property
    def rows_uniform_over_spans(self) -> bool:
        return self._engine is None  # with max_times_sampled, retired items are skipped

    # -- sampling ----------------------------------------------------------------------------

    def sample_rows(self, n: int, rng: np.random.Generator) -> Draw:
        n = check_count(n, "n")
        if self._engine is not None:
            return self._engine.sample_rows(n, rng)
        registry = self.registry
        rows = registry.sample_rows(n, rng)
        return Draw(rows, self._constant(n, 1.0 / registry.num_rows))

    def _constant(self, n: int, value: float) -> F64:
        """``n`` times ``value``, read-only and reused while both stay the same (a full ring
        samples at one size: a fresh array per call was a visible share of a row draw)."""
        if self._probability_key != (n, value):
            self._probability = np.full(n, value)
            self._probability.setflags(write=False)
            self._probability_key = (n, value)
        return self._probability

    def sample_episodes(self, n: int, rng: np.random.Generator) -> EpisodeDraw:
        n = check_count(n, "n")
        if self._engine is not None:
            return self._engine.sample_episodes(n, rng)
        ids, starts, ends = self.registry.sample_episodes(n, rng)
        return EpisodeDraw(ids, starts, ends, np.full(n, 1.0 / len(self.registry)))

    def sample_slices(
        self, n: int, length: int, rng: np.random.Generator, strict: bool = True
    ) -> SliceDraw:
        n, length = check_count(n, "n"), check_count(length, "length")
        if self._engine is not None:
            return self._engine.sample_slices(n, length, rng, strict)
        mass = self._masses.get(length, self.index, None)
        long_starts = self.index.num_rows - mass.tail_count
        short = 0 if strict else mass.first_count
        total = long_starts + short
        if total == 0:
            raise EmptyBufferError(
                f"cannot sample slices of {length} rows: no episode is long enough "
                f"({self.index.num_episodes} episodes, {self.index.num_rows} rows)"
            )
        pick_long = rng.integers(0, total, size=n) < long_starts
        starts = np.empty(n, dtype=np.int64)
        lengths = np.full(n, length, dtype=np.int64)
        k = int(pick_long.sum())
        if k:
            starts[pick_long] = self.registry.sample_slices(k, length, rng)
        if k < n:
            first, size = self._short_episodes(n - k, length, short, rng)
            starts[~pick_long], lengths[~pick_long] = first, size
        return SliceDraw(starts, lengths, np.full(n, 1.0 / total))

    def _short_episodes(
        self, m: int, length: int, short: int, rng: np.random.Generator
    ) -> tuple[I64, I64]:
        """``m`` episodes shorter than ``length``, uniformly (rejection from all episodes)."""
        starts: list[I64] = []
        sizes: list[I64] = []
        need = m
        share = short / self.index.num_episodes
        while need:
            _, s, e = self.registry.sample_episodes(min(int(need / share * 1.2) + 8, 1 << 16), rng)
            keep = (e - s) < length
            s, e = s[keep][:need], e[keep][:need]
            starts.append(s)
            sizes.append(e - s)
            need -= s.size
        return np.concatenate(starts), np.concatenate(sizes)

    # -- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        engine = None if self._engine is None else self._engine.state_dict()
        return {**self._header(), "engine": engine}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_state(state)
        if self._engine is not None:
            if state.get("engine") is None:
                raise ValueError("sampler state has no retirement counts for max_times_sampled")
            self._engine.load_state_dict(state["engine"])

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"sampler": self.name, "unit": self.unit}
        if self._engine is None:
            reg = self._registry
            out.update(rows=0 if reg is None else reg.num_rows, episodes=len(reg or ()))
        else:
            engine = self._engine.stats()
            out.update(items=engine["items"], retired=engine["retired"])
        out["max_times_sampled"] = self.max_times_sampled
        return out
