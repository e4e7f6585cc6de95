"""How a cross-shard batch is divided, and what its items' probabilities and weights become.

Pure functions over numbers (no sockets, no Ray), so the arithmetic is tested on its own.

**Split.** A batch of ``n`` is divided in proportion to the shards' *masses* (what each
shard's sampler draws over: rows, episodes or valid slice starts for the uniform-like samplers,
the summed weight ``sum (p + eps)^alpha`` for ``prioritized``) by :func:`apportion`: every
shard gets ``floor(n * share)`` and the remaining ``r`` items go to ``r`` shards picked by
systematic sampling over the fractional parts, so each shard's expected count is exactly
``n * share`` (an unbiased mixture: an item of the union is drawn with its shard's share times
its probability there) with far less spread than a multinomial split.

**Probabilities and weights.** A shard reports ``P_s`` (the probability within the shard) and
the PER weight ``w_s = (P_s / P_min,s)^-beta``. Over the union the item's probability is
``share_s * P_s``; for ``prioritized`` (share = ``W_s / W``) that is ``v / W``, the probability
one sampler over all shards would give. The union's weight normalises by the smallest item
weight ``m = min_s m_s`` of all shards instead of the shard's own ``m_s``:
``w = w_s * (m / m_s)^beta`` (:func:`rescale_weights`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]


def apportion(n: int, masses: Sequence[float], rng: np.random.Generator) -> I64:
    """``n`` items divided over shards in proportion to ``masses`` (>= 0, finite), unbiased:
    ``E[count_s] = n * mass_s / sum(masses)`` and every count is within 1 of it. ValueError
    when no mass is positive (nothing to draw from)."""
    weights = np.asarray(masses, dtype=np.float64)
    if weights.ndim != 1 or not np.all(np.isfinite(weights)) or np.any(weights < 0):
        raise ValueError(f"shard masses must be finite and >= 0, got {list(weights)}")
    total = float(weights.sum())
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if total <= 0:
        raise ValueError("no shard has anything to draw from (every mass is 0)")
    quota = n * weights / total
    counts = np.floor(quota).astype(np.int64)
    left = n - int(counts.sum())
    if left > 0:
        # Systematic sampling over the fractional parts (they sum to ``left``): points
        # u, u + 1, ..., u + left - 1 land in shard s with probability exactly frac_s.
        frac = quota - counts
        edges = np.cumsum(frac)
        edges[-1] = left  # rounding must not lose the last point
        points = rng.random() + np.arange(left)
        hits = np.searchsorted(edges, points, side="right")
        np.add.at(counts, np.minimum(hits, counts.size - 1), 1)
    return counts


def shard_mass(stats: Mapping[str, Any], kind: str, length: int = 1, strict: bool = True) -> float:
    """What a shard's sampler draws a ``kind`` ("rows", "episodes", "slices") over, from its
    ``stats``: the prioritized sampler's total weight (``sampler.figures.priority_total``),
    else its rows or episodes; for slices the valid starts when every episode is at least
    ``length`` long (``rows - episodes * (length - 1)``, floored at the episodes for
    ``strict=False``, whose short episodes add one start each). The reader replaces the slice
    estimate with the exact count a uniform shard's reply implies (``1 / P``)."""
    sampler = stats.get("sampler") or {}
    if sampler.get("kind") == "prioritized":
        figures = sampler.get("figures") or {}
        return max(float(figures.get("priority_total", 0.0)), 0.0)
    rows, episodes = int(stats.get("rows", 0)), int(stats.get("episodes", 0))
    if kind == "episodes":
        return float(episodes)
    if kind == "slices":
        starts = rows - episodes * (length - 1)
        return float(max(starts, 0 if strict else episodes))
    return float(rows)


def smallest_weight(stats: Mapping[str, Any]) -> float | None:
    """The smallest positive item weight of a prioritized shard (``sampler.figures.
    weight_min``), None for other samplers or an empty shard."""
    sampler = stats.get("sampler") or {}
    if sampler.get("kind") != "prioritized":
        return None
    value = (sampler.get("figures") or {}).get("weight_min")
    if value is None or not math.isfinite(float(value)) or float(value) <= 0:
        return None
    return float(value)


def rescale_weights(
    weights: F64, shard_min: float | None, union_min: float | None, beta: float
) -> F64:
    """A shard's PER weights (normalised by its own smallest item weight ``shard_min``) as
    weights over the union (normalised by ``union_min``, the smallest of all shards):
    ``w * (union_min / shard_min) ** beta``. Unchanged when either is unknown or beta is 0."""
    if shard_min is None or union_min is None or beta == 0:
        return weights
    factor: F64 = weights * (union_min / shard_min) ** beta
    return factor
