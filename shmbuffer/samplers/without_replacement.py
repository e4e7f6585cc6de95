"""Sampling without replacement in epochs that every reader shares.

An *epoch* is one random permutation of the items live when it begins (rows in transition
unit, episodes in episode unit; retired items are left out). Successive ``sample_*`` calls,
whoever makes them, hand out the permutation in order, so within an epoch each item goes to
exactly one reader exactly once; when it is used up the next call begins a new epoch. A call
larger than what is left of the epoch takes the rest and continues in the next one (an item
can then appear twice in that one call, once per epoch).

Items that change during an epoch: an evicted item is skipped when its turn comes; an item
committed after the epoch began waits for the next one. Both are decided at hand-out time from
``joined[key]``, the epoch number current when the item was committed (its key is its row, or
its first row in episode unit): a key is handed out in epoch ``e`` only if it is live, still an
item (a first row, in episode unit) and ``joined < e``. So no permutation is ever edited.

Costs: O(n) per call, plus one O(C) scan and permutation per epoch (amortised O(1) per item).

Call kinds follow the unit: ``sample_rows`` in transition unit; ``sample_episodes`` and
``sample_slices`` (one slice per episode, a uniform valid start inside it; with ``strict=True``
episodes shorter than the slice are passed over) in episode unit. ``probability`` is
``1 / items in the epoch`` (for a slice, also ``1 / starts in its episode``); weights are ones.
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
    from_bytes,
    to_bytes,
)

__all__ = ["WithoutReplacementSampler"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
Bool = npt.NDArray[np.bool_]


class WithoutReplacementSampler(Sampler):
    """Shared epochs over rows or episodes; see the module docstring."""

    name = "without-replacement"
    consumes = True

    def __init__(self, *, max_times_sampled: int | None = MAX_TIMES_SAMPLED.default) -> None:
        super().__init__(max_times_sampled=max_times_sampled)
        self._reset()

    def _reset(self) -> None:
        size = max(self.capacity, 1)
        self._epoch = 0  # epochs begun so far; items committed now join epoch _epoch + 1
        self._order = np.zeros(0, dtype=np.int64)
        self._pos = 0
        self._joined = np.zeros(size, dtype=np.int64)
        self._times = np.zeros(size if self.max_times_sampled else 0, dtype=np.int64)

    # -- container events --------------------------------------------------------------------

    def on_commit(self, episodes: Sequence[Episode], priority: Priority = None) -> None:
        self.check_commit_priority(episodes, priority)
        self.index.add(episodes)
        for ep in episodes:
            key = (
                slice(ep.start, ep.start + 1) if self.unit == "episode" else slice(ep.start, ep.end)
            )
            self._joined[key] = self._epoch
            if self.max_times_sampled:
                self._times[key] = 0

    def on_evict(self, start: int, stop: int) -> None:
        # Nothing to edit: evicted keys fail the liveness test when their turn comes.
        self.index.apply(self.index.removals(start, stop, self.registry))

    def on_restore(self, episodes: Sequence[Episode], registry: EpisodeRegistry) -> None:
        # Eviction never touched joined/times, so restored keys are exactly as they were.
        self._registry = registry
        self.index.restore(episodes)

    @property
    def draws_change_state(self) -> bool:
        return True  # every draw moves the epoch's walk

    def on_clear(self) -> None:
        self.index.clear()
        epoch = self._epoch
        self._reset()
        self._epoch = epoch  # keep counting: a cleared buffer starts a fresh epoch

    # -- the epoch walk ----------------------------------------------------------------------

    def _eligible(self) -> I64:
        keys = self.index.live_rows() if self.unit == "transition" else self.index.live_starts()
        if self.max_times_sampled:
            keys = keys[self._times[keys] < self.max_times_sampled]
        return keys

    def _valid(self, keys: I64, epoch: int) -> Bool:
        ok: Bool = self.index.is_live(keys) & (self._joined[keys] < epoch)
        if self.unit == "episode":
            ok &= self.index.is_first(keys)
        if self.max_times_sampled:
            ok &= self._times[keys] < self.max_times_sampled
        return ok

    def _take(self, n: int, rng: np.random.Generator, min_length: int = 1) -> tuple[I64, F64]:
        """The next ``n`` valid keys of the shared walk and ``1 / epoch size`` for each."""
        epoch, order, pos = self._epoch, self._order, self._pos
        keys: list[I64] = []
        sizes: list[F64] = []
        counted: list[I64] = []
        need, fresh_pass = n, False
        try:
            while need:
                if pos >= order.size:
                    if fresh_pass:  # a whole new epoch went by without one usable key
                        raise self._empty(min_length)
                    items = self._eligible()
                    if items.size == 0:
                        raise self._empty(min_length)
                    epoch, order, pos, fresh_pass = epoch + 1, rng.permutation(items), 0, True
                window = order[pos : pos + need]
                pos += window.size
                ok = self._valid(window, epoch)
                if min_length > 1:
                    ok &= self.index.end_of_row[window] - window >= min_length
                got = window[ok]
                if got.size:
                    fresh_pass = False
                    keys.append(got)
                    sizes.append(np.full(got.size, 1.0 / order.size))
                    need -= got.size
                    if self.max_times_sampled:
                        self._times[got] += 1  # undone below if the call fails
                        counted.append(got)
        except EmptyBufferError:
            for got in counted:
                self._times[got] -= 1
            raise
        self._epoch, self._order, self._pos = epoch, order, pos
        return np.concatenate(keys), np.concatenate(sizes)

    def _empty(self, min_length: int) -> EmptyBufferError:
        what = "items" if min_length == 1 else f"episodes of >= {min_length} rows"
        return EmptyBufferError(
            f"cannot sample without replacement: no live {what} "
            f"({self.index.num_episodes} episodes, {self.index.num_rows} rows)"
        )

    def _require(self, unit: str, call: str) -> None:
        if self.unit != unit:
            items = "rows" if self.unit == "transition" else "episodes"
            raise ValueError(
                f"the {self.name} sampler hands out {items} in {self.unit} unit; "
                f"{call} needs {unit} unit"
            )

    # -- sampling ----------------------------------------------------------------------------

    def sample_rows(self, n: int, rng: np.random.Generator) -> Draw:
        self._require("transition", "sample_rows")
        keys, prob = self._take(check_count(n, "n"), rng)
        return Draw(keys, prob)

    def sample_episodes(self, n: int, rng: np.random.Generator) -> EpisodeDraw:
        self._require("episode", "sample_episodes")
        keys, prob = self._take(check_count(n, "n"), rng)
        ids, starts, ends = self.index.lookup(keys)
        return EpisodeDraw(ids, starts, ends, prob)

    def sample_slices(
        self, n: int, length: int, rng: np.random.Generator, strict: bool = True
    ) -> SliceDraw:
        self._require("episode", "sample_slices")
        n, length = check_count(n, "n"), check_count(length, "length")
        keys, prob = self._take(n, rng, length if strict else 1)
        room = self.index.end_of_row[keys].astype(np.int64) - keys
        starts_per_episode = np.maximum(room - length + 1, 1)
        offset = rng.integers(0, starts_per_episode)
        return SliceDraw(keys + offset, np.minimum(room, length), prob / starts_per_episode)

    # -- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            **self._header(),
            "epoch": self._epoch,
            "pos": self._pos,
            "order": to_bytes(self._order),
            "joined": to_bytes(self._joined),
            "times": to_bytes(self._times) if self.max_times_sampled else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_state(state)
        order = np.frombuffer(state["order"], dtype=np.int64).copy()
        if order.size and (int(order.min()) < 0 or int(order.max()) >= self.capacity):
            raise ValueError("sampler state 'order' holds rows outside the ring")
        pos, epoch = int(state["pos"]), int(state["epoch"])
        if not 0 <= pos <= order.size or epoch < 0:
            raise ValueError(f"sampler state has pos={pos}, epoch={epoch} for {order.size} items")
        joined = from_bytes(state["joined"], np.int64, self.capacity, "joined")
        times = np.zeros(0, dtype=np.int64)
        if self.max_times_sampled:
            times = np.zeros(self.capacity, dtype=np.int64)
            if state.get("times") is not None:
                times = from_bytes(state["times"], np.int64, self.capacity, "times")
        self._epoch, self._order, self._pos = epoch, order, pos
        self._joined, self._times = joined, times

    def stats(self) -> dict[str, Any]:
        return {
            "sampler": self.name,
            "unit": self.unit,
            "epoch": self._epoch,
            "epoch_size": int(self._order.size),
            "epoch_position": self._pos,
            "max_times_sampled": self.max_times_sampled,
        }
