"""Samplers and rate limiters: the contracts (``base``, ``rate_limiter``) and one file each.

This package only hands names on, plus the two factories the configuration uses.
"""

from __future__ import annotations

import inspect
from typing import Any

from shmbuffer.samplers.base import Draw, EpisodeDraw, Sampler, SliceDraw, check_priority
from shmbuffer.samplers.fifo import FifoSampler
from shmbuffer.samplers.prioritized import PrioritizedSampler
from shmbuffer.samplers.rate_limiter import MinSize, NoLimit, RateLimiter, SampleToInsertRatio
from shmbuffer.samplers.sumtree import MinTree, SumTree
from shmbuffer.samplers.uniform import UniformSampler
from shmbuffer.samplers.without_replacement import WithoutReplacementSampler

__all__ = [
    "RATE_LIMITERS",
    "SAMPLERS",
    "Draw",
    "EpisodeDraw",
    "FifoSampler",
    "MinSize",
    "MinTree",
    "NoLimit",
    "PrioritizedSampler",
    "RateLimiter",
    "SampleToInsertRatio",
    "Sampler",
    "SliceDraw",
    "SumTree",
    "UniformSampler",
    "WithoutReplacementSampler",
    "build_rate_limiter",
    "build_sampler",
    "check_priority",
    "make_rate_limiter",
    "make_sampler",
]

SAMPLERS: dict[str, type[Sampler]] = {
    cls.name: cls
    for cls in (UniformSampler, WithoutReplacementSampler, PrioritizedSampler, FifoSampler)
}
RATE_LIMITERS: dict[str, type[RateLimiter]] = {
    cls.name: cls for cls in (NoLimit, MinSize, SampleToInsertRatio)
}


def _lookup(kind: str, name: str, table: dict[str, Any]) -> Any:
    try:
        return table[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown {kind} {name!r}; expected one of {list(table)}") from None


def _build(kind: str, name: str, cls: Any, options: dict[str, Any]) -> Any:
    try:
        return cls(**options)
    except TypeError as exc:  # an option this implementation does not take
        raise ValueError(f"{kind} {name!r}: {exc}") from None


def make_sampler(name: str, **options: Any) -> Sampler:
    """A sampler by its ``--sampler`` name; ValueError for an unknown name or option."""
    sampler: Sampler = _build("sampler", name, _lookup("sampler", name, SAMPLERS), options)
    return sampler


def make_rate_limiter(name: str, **options: Any) -> RateLimiter:
    """A rate limiter by its ``--rate-limiter`` name; ValueError for an unknown name or option."""
    cls = _lookup("rate limiter", name, RATE_LIMITERS)
    limiter: RateLimiter = _build("rate limiter", name, cls, options)
    return limiter


def _given(kind: str, name: str, cls: Any, options: dict[str, Any]) -> dict[str, Any]:
    """The options that were given (not None); ValueError naming any ``cls`` does not take."""
    given = {key: value for key, value in options.items() if value is not None}
    takes = [p for p in inspect.signature(cls).parameters if p in options]
    extra = sorted(set(given) - set(takes))
    if extra:
        allowed = ", ".join(takes) or "none"
        raise ValueError(f"{kind} {name!r} takes no {', '.join(extra)} (its options: {allowed})")
    return given


def build_sampler(name: str, **options: Any) -> Sampler:
    """A sampler from flag-style options (``--sampler`` and its settings), where None means
    "not given": the sampler's default. An option given that ``name`` does not take (say
    ``priority_exponent`` for ``uniform``) is refused with a ValueError naming it."""
    cls = _lookup("sampler", name, SAMPLERS)
    return make_sampler(name, **_given("sampler", name, cls, options))


def build_rate_limiter(name: str, **options: Any) -> RateLimiter:
    """A rate limiter from flag-style options; None means "not given" (see build_sampler)."""
    cls = _lookup("rate limiter", name, RATE_LIMITERS)
    return make_rate_limiter(name, **_given("rate limiter", name, cls, options))
