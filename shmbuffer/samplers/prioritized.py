"""Prioritized replay (Schaul et al. 2016): draws in proportion to ``(priority + eps) ** alpha``.

Items and leaves: one weight per *item* in a :class:`~shmbuffer.samplers.sumtree.SumTree` of
``capacity`` leaves, with a :class:`~shmbuffer.samplers.sumtree.PositiveMinTree` over the same
leaves for the smallest positive one. In transition unit an item is a row, leaf = row. In
episode unit an item is an episode, its leaf is its first row (episodes never trim there, so
the key is stable). Invariant: a leaf is positive exactly when
its item is live and not retired; every other leaf is 0, so the trees alone say what may be
drawn. New items get the largest priority ever seen (raw, before eps and alpha; initially 1)
unless the writer gives one.

Draws and their ``probability`` (that of the item carrying the priority, which is what the
importance weight corrects):

* ``sample_rows``: transition, a row by weight, ``P = w / W``; episode, an episode by weight,
  then a uniform row inside it, ``P = w_e / W`` (the in-episode choice is uniform and needs no
  correction).
* ``sample_episodes``: episode unit by weight; in transition unit the chunk holding a row drawn
  by weight, ``P = (sum of its rows' weights) / W``.
* ``sample_slices``, episode unit: an episode by weight among those long enough (all of them
  with ``strict=False``), then a uniform valid start, ``P = w_e / V``.
* ``sample_slices``, transition unit: the **start row is drawn by its own priority among the
  valid starts** (rows with at least ``length`` rows left in their chunk; with
  ``strict=False`` also the first row of each shorter chunk), ``P = w_start / V``. So a slice's
  priority is its first row's priority: to prioritise sequences, update the start rows (the
  R2D2 recipe: one priority per sequence). With equal priorities this is exactly uniform over
  valid starts, the uniform sampler's distribution. Drawing a chunk by summed priority was the
  alternative; it would ignore where in a chunk the high-priority rows are.

The normaliser ``V`` of a slice draw is ``W`` minus the weight on rows that cannot start one
(plus the short chunks' first rows when not strict), kept per slice length by
:class:`~shmbuffer.samplers.index.SliceMass` without scanning. Draws are by rejection from the
tree (expected ``W / V`` tries per slice, vectorised); if valid starts hold almost none of the
weight, an exact O(C) draw is used instead, so a call always ends.

Importance weights follow the PER paper: ``(N * P) ** -beta`` divided by the largest such
weight in the buffer, ``(N * P_min) ** -beta`` with ``P_min = min positive leaf / W`` (the
min tree); N cancels, leaving ``(P / P_min) ** -beta <= 1``. For slices, whose ``V <= W``,
this is at most the exact per-start normalisation (a constant factor within one call).

Evictions keep the weights (and counts) they zero in a bounded
:class:`~shmbuffer.samplers.index.Graveyard`, so an aborted reservation's ``on_restore`` brings
the old priorities back instead of treating restored rows as new data.

``max_times_sampled=K``: an item sampled K times is retired (leaf 0). Within one call an item is
never returned more than its remaining count: excess draws are redrawn after the retirement,
and the whole call is rolled back if the buffer runs dry. With ``priority_exponent=0`` this is
the uniform sampler's engine for ``max_times_sampled``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
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
    check_beta,
    check_count,
    check_update,
    from_bytes,
    to_bytes,
)
from shmbuffer.samplers.declare import Option
from shmbuffer.samplers.index import Graveyard, Removal, SliceMasses, rows_of
from shmbuffer.samplers.sumtree import PositiveMinTree, SumTree, assign_pair, update_pair

__all__ = ["PrioritizedSampler"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
Accept = Callable[[I64], npt.NDArray[np.bool_]]

_MIN_ACCEPT_RATE = 1e-3  # below it, rejection costs more than one exact O(C) draw
_MAX_ROUNDS = 32
_TINY = float(np.finfo(np.float64).tiny)
_LARGEST = float(np.finfo(np.float64).max)


def last_writes(keys: I64, bound: int) -> tuple[I64, I64]:
    """``keys`` without repeats, ascending, and for each the position of its last occurrence
    in ``keys`` (non-empty, every key in ``[0, bound)``): the batch's writes then apply as if
    one after another, the last one winning. Sorted keys also make the trees' gathers walk
    memory in order."""
    n = keys.size
    bits = max(n - 1, 1).bit_length()
    if bound <= 1 << (62 - bits):
        # Each key with its position in the low bits, one plain sort: equal keys end up in
        # position order, as a stable argsort would put them, at ~half its cost (an argsort
        # is a sort plus a gather; a stable one is a merge sort besides).
        packed = keys << bits
        packed |= np.arange(n, dtype=np.int64)
        packed.sort()
        ranked, order = packed >> bits, packed & ((1 << bits) - 1)
    else:
        order = keys.argsort(kind="stable")  # equal keys keep their order: last is last
        ranked = keys[order]
    last = np.empty(n, dtype=np.bool_)
    last[-1] = True
    np.not_equal(ranked[:-1], ranked[1:], out=last[:-1])
    if last.all():
        return ranked, order
    return ranked[last], order[last]


def _nonneg(value: float, what: str) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be finite and >= 0, got {value!r}")
    return value


PRIORITY_EXPONENT: Option[float] = Option(
    "priority_exponent", float, 0.6, "alpha, the exponent of priority + eps in an item's weight"
)
IMPORTANCE_EXPONENT: Option[float] = Option(
    "importance_exponent", float, 0.4, "beta of the importance weights; per call too"
)
PRIORITY_EPS: Option[float] = Option(
    "priority_eps", float, 1e-6, "added to priorities, so none weighs 0"
)


class PrioritizedSampler(Sampler):
    """Proportional prioritized replay over rows or episodes; see the module docstring."""

    name = "prioritized"
    options = (*Sampler.options, PRIORITY_EXPONENT, IMPORTANCE_EXPONENT, PRIORITY_EPS)
    has_priorities = True

    def __init__(
        self,
        *,
        priority_exponent: float = PRIORITY_EXPONENT.default,
        importance_exponent: float = IMPORTANCE_EXPONENT.default,
        priority_eps: float = PRIORITY_EPS.default,
        max_times_sampled: int | None = MAX_TIMES_SAMPLED.default,
    ) -> None:
        super().__init__(max_times_sampled=max_times_sampled)
        self.priority_exponent = _nonneg(priority_exponent, "priority_exponent")
        self.importance_exponent = check_beta(importance_exponent)
        self.priority_eps = _nonneg(priority_eps, "priority_eps")
        self._max_priority = 1.0
        self._retired_total = 0
        #: The probabilities of the last plain row draw, known valid (see ``weights``).
        self._drawn: F64 = np.zeros(0)
        self._reset()

    def _reset(self) -> None:
        size = max(self.capacity, 1)
        self._sum = SumTree(size)
        self.weight_limit, self.priority_limit = self._limits(self._sum.size)
        self._min = PositiveMinTree(self._sum)
        self._positive = 0  # leaves > 0: live, unretired items
        self._times = np.zeros(size if self.max_times_sampled else 0, dtype=np.int64)
        self._masses = SliceMasses(exact=False)
        self._graveyard = Graveyard(size)

    def _limits(self, leaves: int) -> tuple[float, float]:
        """The largest weight a leaf may hold, and the largest priority that gives it: with
        every one of ``leaves`` at that weight the tree's total is half of float64's largest
        value, so no sum in the tree (nor its rounding) reaches inf, whatever the other leaves
        hold. A static bound per item, not a check of the running total: whether a priority
        is accepted never depends on the others, so a journal's replay agrees with the run."""
        weight = _LARGEST / (2 * leaves)
        if self.priority_exponent == 0:  # every weight is 1
            return weight, math.inf
        with np.errstate(over="ignore"):
            root = float(np.float64(weight) ** (1 / self.priority_exponent))
        return weight, root - self.priority_eps  # inf where no finite priority can reach it

    # -- leaves ------------------------------------------------------------------------------

    def _weight(self, priority: F64) -> F64:
        out: F64 = (priority + self.priority_eps) ** self.priority_exponent
        return out

    def _set(self, keys: I64, new: F64) -> None:
        """Leaves ``keys`` (unique, their episodes in the index now) take weights ``new``."""
        if keys.size == 0:
            return
        old = self._sum.get_unchecked(keys)
        self._masses.change(self.index, keys, old, new)
        # Weights are >= 0, so nonzero means positive.
        self._positive += int(np.count_nonzero(new)) - int(np.count_nonzero(old))
        self._update_trees(keys, new)

    def _update_trees(self, keys: I64, new: F64) -> None:
        update_pair(self._sum, self._min, keys, new)

    def _keys(self, starts: Sequence[int], stops: Sequence[int]) -> I64:
        if self.unit == "episode":
            return np.asarray(starts, dtype=np.int64)
        return rows_of(starts, stops)

    # -- container events --------------------------------------------------------------------

    def on_commit(self, episodes: Sequence[Episode], priority: Priority = None) -> None:
        given = self.check_commit_priority(episodes, priority)
        keys = self._keys([ep.start for ep in episodes], [ep.end for ep in episodes])
        self.index.add(episodes)
        if given is None:
            given = np.full(keys.size, self._max_priority)
        elif given.size:
            self._max_priority = max(self._max_priority, float(given.max()))
        if self.max_times_sampled:
            self._times[keys] = 0
        self._set(keys, self._weight(given))

    def on_evict(self, start: int, stop: int) -> None:
        removals = self.index.removals(start, stop, self.registry)
        if not removals:
            return
        moved: F64 | None = None
        if self.unit == "episode":
            # Episodes never trim in episode unit; a survivor would just move its leaf.
            keys = np.asarray([rm.start for rm in removals], dtype=np.int64)
            moved = self._sum.get([rm.start for rm in removals if rm.survivor is not None])
        else:
            keys = rows_of([rm.start for rm in removals], [rm.stop for rm in removals])
        for rm in removals:  # kept for an abort that publishes them again
            lo, hi = rm.start, rm.start + 1 if self.unit == "episode" else rm.stop
            kept: list[npt.NDArray[Any]] = [self._sum.leaves[lo:hi].copy()]
            if self.max_times_sampled:
                kept.append(self._times[lo:hi].copy())
            self._graveyard.bury(rm.id, lo, hi, *kept)
        self._set(keys, np.zeros(keys.size))
        if self.max_times_sampled:
            self._times[keys] = 0
        self.index.apply(removals)
        self._after_trims(removals, moved)

    def _after_trims(self, removals: list[Removal], moved_weights: F64 | None) -> None:
        survivors = np.asarray(
            [rm.survivor for rm in removals if rm.survivor is not None], dtype=np.int64
        )
        if survivors.size == 0:
            return
        if moved_weights is not None:
            self._set(survivors, moved_weights)
        else:
            self._masses.gain_first(self.index, survivors, self._sum.get(survivors))

    def on_restore(self, episodes: Sequence[Episode], registry: EpisodeRegistry) -> None:
        self._registry = registry
        before = self.index.restore(episodes)
        self._masses.clear()  # rebuilt on the next slice draw: aborts are rare
        fresh = float(self._weight(np.array([self._max_priority]))[0])
        for ep, now in zip(episodes, before, strict=True):
            if self.unit == "episode":
                lo, hi = ep.start, ep.start + 1 if now is None else ep.start
            else:
                lo, hi = ep.start, ep.end if now is None else now
            if hi <= lo:
                continue
            defaults: list[npt.NDArray[Any]] = [np.full(hi - lo, fresh)]
            if self.max_times_sampled:
                defaults.append(np.zeros(hi - lo, dtype=np.int64))
            back = self._graveyard.exhume(ep.id, lo, hi, tuple(defaults))
            if self.max_times_sampled:
                self._times[lo:hi] = back[1]
            self._set(np.arange(lo, hi, dtype=np.int64), back[0])

    def on_clear(self) -> None:
        self.index.clear()
        self._reset()

    # -- drawing -----------------------------------------------------------------------------

    def _valid_mass(self, length: int | None, strict: bool) -> tuple[float, int]:
        """Weight and count of the leaves a draw may return."""
        total, count = self._sum.total, self._positive
        if length is None or (self.unit == "episode" and not strict):
            return total, count
        mass = self._masses.get(length, self.index, self._sum.leaves)
        total -= mass.tail_mass
        count -= mass.tail_count
        if not strict:
            total += mass.first_mass
            count += mass.first_count
        return total, count

    def _accept(self, length: int | None, strict: bool) -> Accept | None:
        if length is None or (self.unit == "episode" and not strict):
            return None
        end_of_row, start_by_end = self.index.end_of_row, self.index.start_by_end

        def accept(keys: I64) -> npt.NDArray[np.bool_]:
            ends = end_of_row[keys]
            ok: npt.NDArray[np.bool_] = ends - keys >= length
            if not strict:
                ok |= start_by_end[ends] == keys
            return ok

        return accept

    def _candidates(
        self, m: int, rng: np.random.Generator, accept: Accept | None, rate: float
    ) -> I64:
        """``m`` leaves drawn by weight among those ``accept`` admits (rate: admitted share)."""
        if accept is None:
            return self._sum.sample(m, rng)
        parts: list[I64] = []
        need = m
        for _ in range(_MAX_ROUNDS if rate >= _MIN_ACCEPT_RATE else 0):
            draw = self._sum.sample(min(int(need / rate * 1.2) + 8, 1 << 20), rng)
            draw = draw[accept(draw)][:need]
            parts.append(draw)
            need -= draw.size
            if need == 0:
                return np.concatenate(parts)
        # Valid leaves hold a sliver of the weight: one exact draw over them, O(C).
        leaves = self._sum.leaves
        keys = np.flatnonzero(leaves > 0)
        keys = keys[accept(keys)]
        cum = np.cumsum(leaves[keys])
        pick = np.searchsorted(cum, rng.random(need) * cum[-1], side="right")
        parts.append(keys[np.minimum(pick, keys.size - 1)])
        return np.concatenate(parts)

    def _draw(
        self, n: int, rng: np.random.Generator, length: int | None = None, strict: bool = True
    ) -> tuple[I64, F64]:
        """``n`` item keys and their probabilities; EmptyBufferError (nothing changed) if none."""
        accept = self._accept(length, strict)
        if not self.max_times_sampled:
            valid, _ = self._checked_mass(length, strict)
            if accept is None:  # every leaf: the tree's own draw, with its weights
                keys, weight = self._sum.draw(n, rng)
                np.divide(weight, valid, out=weight)
                self._drawn = weight
                return keys, weight
            keys = self._candidates(n, rng, accept, valid / self._sum.total)
            return keys, self._sum.get_unchecked(keys) / valid
        return self._draw_counted(n, rng, length, strict, accept)

    def _checked_mass(self, length: int | None, strict: bool) -> tuple[float, int]:
        valid, count = self._valid_mass(length, strict)
        if count <= 0:
            what = "rows" if length is None else f"slices of {length} rows"
            raise EmptyBufferError(f"cannot sample {what}: no live, unretired item fits")
        if valid <= 0.0:  # rounding ate a tiny remainder: recount exactly
            self._masses.clear()
            valid, count = self._valid_mass(length, strict)
        return max(valid, _TINY), count

    def _draw_counted(
        self,
        n: int,
        rng: np.random.Generator,
        length: int | None,
        strict: bool,
        accept: Accept | None,
    ) -> tuple[I64, F64]:
        limit = self.max_times_sampled
        assert limit is not None
        keys, prob = np.empty(n, dtype=np.int64), np.empty(n)
        pending = np.arange(n)
        undo_times: list[tuple[I64, I64]] = []
        undo_leaves: list[tuple[I64, F64]] = []
        try:
            while pending.size:
                valid, _ = self._checked_mass(length, strict)
                cand = self._candidates(pending.size, rng, accept, valid / self._sum.total)
                # Occurrence rank of each draw among equal keys, in draw order.
                order = np.argsort(cand, kind="stable")
                ranked = cand[order]
                rank = np.empty_like(order)
                rank[order] = np.arange(cand.size) - np.searchsorted(ranked, ranked, side="left")
                ok = rank < limit - self._times[cand]
                keys[pending[ok]] = cand[ok]
                prob[pending[ok]] = self._sum.get_unchecked(cand[ok]) / valid
                taken, counts = np.unique(cand[ok], return_counts=True)
                undo_times.append((taken, self._times[taken].copy()))
                self._times[taken] += counts
                done = taken[self._times[taken] >= limit]
                undo_leaves.append((done, self._sum.get(done)))
                self._set(done, np.zeros(done.size))
                pending = pending[~ok]
        except EmptyBufferError:
            for done, weights in reversed(undo_leaves):
                self._set(done, weights)
            for taken, before in reversed(undo_times):
                self._times[taken] = before
            raise
        self._retired_total += sum(done.size for done, _ in undo_leaves)
        return keys, prob

    # -- sampling ----------------------------------------------------------------------------

    def sample_rows(self, n: int, rng: np.random.Generator) -> Draw:
        n = check_count(n, "n")
        total = self._sum.total
        if self.unit == "transition" and not self.max_times_sampled and total > 0:
            # The hot path, _draw's first case without its calls: a row by weight.
            keys, prob = self._sum.draw(n, rng)
            np.divide(prob, total, out=prob)
            self._drawn = prob
            return Draw(keys, prob)
        keys, prob = self._draw(n, rng)
        if self.unit == "transition":
            return Draw(keys, prob)
        ends = self.index.end_of_row[keys].astype(np.int64)
        return Draw(keys + rng.integers(0, ends - keys), prob)

    def sample_episodes(self, n: int, rng: np.random.Generator) -> EpisodeDraw:
        n = check_count(n, "n")
        if self.unit == "episode":
            keys, prob = self._draw(n, rng)
            ids, starts, ends = self.index.lookup(keys)
            return EpisodeDraw(ids, starts, ends, prob)
        if self.max_times_sampled:
            raise ValueError(
                "max_times_sampled counts rows in transition unit; sample_episodes would hand "
                "out whole chunks past their count (use episode unit)"
            )
        rows, _ = self._draw(n, rng)
        ids, starts, ends = self.index.lookup(rows)
        return EpisodeDraw(ids, starts, ends, self._sum.range_sum(starts, ends) / self._sum.total)

    def sample_slices(
        self, n: int, length: int, rng: np.random.Generator, strict: bool = True
    ) -> SliceDraw:
        n, length = check_count(n, "n"), check_count(length, "length")
        keys, prob = self._draw(n, rng, length, strict)
        ends = self.index.end_of_row[keys].astype(np.int64)
        room = ends - keys
        if self.unit == "transition":
            return SliceDraw(keys, np.minimum(room, length), prob)
        offset = rng.integers(0, np.maximum(room - length + 1, 1))
        return SliceDraw(keys + offset, np.minimum(room, length), prob)

    # -- priorities --------------------------------------------------------------------------

    def update_priorities(self, rows: npt.ArrayLike, priority: npt.ArrayLike) -> int:
        idx, given = check_update(rows, priority, self.capacity, self.priority_limit)
        return self.set_priorities(idx, given)

    def set_priorities(self, rows: I64, priority: F64) -> int:
        ends = self.index.end_of_row.take(rows)
        if ends.size and ends.min() > 0:  # all live, the usual case: rows sampled just now
            keys, given = rows, priority
        else:
            keep = ends > 0
            keys, given = rows[keep], priority[keep]
        if self.unit == "episode":
            keys = self.index.start_by_end[self.index.end_of_row[keys]].astype(np.int64)
        if self.max_times_sampled:
            alive = self._times[keys] < self.max_times_sampled
            keys, given = keys[alive], given[alive]
        if keys.size == 0:
            return 0
        if self._sum.kernels is not None and not self._masses.has_lengths():
            # Compiled trees apply the writes in order (a repeated row: the last one wins);
            # only slice masses need the repeats sorted out first, to see each old weight.
            self._positive += assign_pair(self._sum, self._min, keys, self._weight(given))
        else:
            uniq, last = last_writes(keys, self.capacity)
            self._set(uniq, self._weight(given[last]))
        self._max_priority = max(self._max_priority, float(given.max()))
        return int(keys.size)

    def item_weights(self, keys: I64) -> F64:
        """The weights items ``keys`` are drawn by now, 0 for one retired or not live: a
        row's in transition unit, an episode's (keyed by its first row) in episode unit. What
        a draw over a filter's selection weighs its items by (``ring/subset.py``)."""
        return self._sum.get_unchecked(keys)

    def weights(self, probability: npt.ArrayLike, beta: float | None = None) -> F64:
        beta = self.importance_exponent if beta is None else check_beta(beta)
        prob = np.asarray(probability, dtype=np.float64)
        # Probabilities this sampler just drew are valid; others are checked (min and max:
        # NaN fails both comparisons, and two reductions beat four ufuncs).
        checked = prob is self._drawn or not prob.size
        if not checked and not (prob.min() > 0 and prob.max() < math.inf):
            raise ValueError("probability values must be finite and > 0")
        lowest, total = self._min.min, self._sum.total
        if total <= 0 or not math.isfinite(lowest):
            return np.ones(prob.shape)
        out: F64 = prob * (total / lowest)
        np.power(out, -beta, out=out)
        return out

    # -- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            **self._header(),
            "priority_exponent": self.priority_exponent,
            "priority_eps": self.priority_eps,
            "max_priority": self._max_priority,
            "retired_total": self._retired_total,
            "leaves": to_bytes(self._sum.leaves),
            "times": to_bytes(self._times) if self.max_times_sampled else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_state(state)
        leaves = from_bytes(state["leaves"], np.float64, self.capacity, "leaves")
        if not np.all(np.isfinite(leaves) & (leaves >= 0)):
            raise ValueError("sampler state 'leaves' holds negative or non-finite weights")
        keys = self.index.live_rows() if self.unit == "transition" else self.index.live_starts()
        live = np.zeros(self.capacity, dtype=np.bool_)
        live[keys] = True
        if np.any((leaves > 0) & ~live):
            raise ValueError("sampler state gives weight to rows that hold no committed data")
        alpha, eps = float(state["priority_exponent"]), float(state["priority_eps"])
        if (alpha, eps) != (self.priority_exponent, self.priority_eps):
            if alpha == 0:
                raise ValueError("cannot convert priorities saved with priority_exponent=0")
            raw = np.maximum(leaves[live] ** (1 / alpha) - eps, 0.0)
            with np.errstate(over="ignore"):
                leaves[live] = self._weight(raw)
        if leaves.size and leaves.max() > self.weight_limit:  # inf too
            raise ValueError(
                f"sampler state 'leaves' holds a weight over {self.weight_limit:.6g}, the most "
                "one item may have for the sum of every item's to stay finite"
            )
        max_priority = float(state["max_priority"])
        if not 0 <= max_priority <= self.priority_limit:
            raise ValueError(
                f"sampler state 'max_priority' = {max_priority} is out of range "
                f"[0, {self.priority_limit:.6g}]"
            )
        times = np.zeros(0, dtype=np.int64)
        if self.max_times_sampled:
            times = np.zeros(self.capacity, dtype=np.int64)
            if state.get("times") is not None:
                times = from_bytes(state["times"], np.int64, self.capacity, "times")
            leaves[times >= self.max_times_sampled] = 0.0
        self._sum.fill(leaves)
        self._min.rebuild()
        self._positive = int(np.count_nonzero(leaves))
        self._times = times
        self._masses.clear()
        self._max_priority = max_priority
        self._retired_total = int(state.get("retired_total", 0))

    def stats(self) -> dict[str, Any]:
        return {
            "sampler": self.name,
            "unit": self.unit,
            "items": self._positive,
            "priority_total": self._sum.total,
            # the smallest item weight: a cluster reader normalises PER weights across shards
            "weight_min": self._min.min if self._positive else None,
            "priority_max": self._max_priority,
            "priority_exponent": self.priority_exponent,
            "importance_exponent": self.importance_exponent,
            "max_times_sampled": self.max_times_sampled,
            "retired": self._retired_total,
        }
