"""Samplers and rate limiters: the contracts (``base``, ``selector``, ``rate_limiter``) and one
file each.

This package only hands names on, plus the registry of samplers (``SAMPLERS``, and
``OPTIONS``: every option they declare) and the factories the configuration uses. A sampler
registers itself: every module of the package is imported here, and each class that declares
a ``name`` is listed (``declare.Declared``), so adding a sampler is adding its module, written
against the narrow item contract (``selector.Selector``) and served by the shared layer
(``shapes.SelectorSampler``).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable
from typing import Any

from shmbuffer.errors import InvalidArgumentError, ShmBufferError
from shmbuffer.samplers.base import Draw, EpisodeDraw, Sampler, SliceDraw, check_priority
from shmbuffer.samplers.declare import Declared, Option, declared
from shmbuffer.samplers.fifo import FifoSampler
from shmbuffer.samplers.prioritized import PrioritizedSampler
from shmbuffer.samplers.rate_limiter import MinSize, NoLimit, RateLimiter, SampleToInsertRatio
from shmbuffer.samplers.selector import Items, Selection, Selector
from shmbuffer.samplers.shapes import SelectorSampler
from shmbuffer.samplers.sumtree import MinTree, SumTree
from shmbuffer.samplers.uniform import UniformSampler
from shmbuffer.samplers.without_replacement import WithoutReplacementSampler

__all__ = [
    "LIMITER_OPTIONS",
    "OPTIONS",
    "RATE_LIMITERS",
    "SAMPLERS",
    "Declared",
    "Draw",
    "EpisodeDraw",
    "FifoSampler",
    "Items",
    "MinSize",
    "MinTree",
    "NoLimit",
    "Option",
    "PrioritizedSampler",
    "RateLimiter",
    "SampleToInsertRatio",
    "Sampler",
    "Selection",
    "Selector",
    "SelectorSampler",
    "SliceDraw",
    "SumTree",
    "UniformSampler",
    "WithoutReplacementSampler",
    "build_rate_limiter",
    "build_sampler",
    "check_priority",
    "instance_or_built",
    "make_rate_limiter",
    "make_sampler",
    "table_parts",
    "takers",
]

#: The samplers that came first, in the order they came: listed first, in this order.
_FIRST = ("uniform", "without-replacement", "prioritized", "fifo")


def _discover() -> dict[str, type[Declared]]:
    """Every sampler the package's modules declare: those of :data:`_FIRST` in that order,
    then the others in module order. Private modules (``_jit``: numba) are not imported."""
    for module in pkgutil.iter_modules(__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")
    kinds = declared()
    first = {name: kinds[name] for name in _FIRST}
    return first | {name: cls for name, cls in kinds.items() if name not in first}


#: Every sampler by its ``--sampler`` name: a wide :class:`Sampler` or a narrow
#: :class:`Selector` (which :func:`make_sampler` serves through :class:`SelectorSampler`).
SAMPLERS: dict[str, type[Declared]] = _discover()


def _options() -> tuple[Option[Any], ...]:
    """Every option some sampler declares, once each, in registry order; two samplers that
    declare one name must declare the same option."""
    seen: dict[str, Option[Any]] = {}
    for cls in SAMPLERS.values():
        for option in cls.options:
            if seen.setdefault(option.name, option) != option:
                raise TypeError(f"{cls.__name__} declares {option.name!r} unlike another sampler")
    return tuple(seen.values())


#: Every sampler option (``Sampler.options``, one entry per name): what the command line,
#: the daemon's config, ``Buffer`` and the cluster's daemon options accept.
OPTIONS = _options()


def takers(option: Option[Any]) -> list[str]:
    """The names of the samplers that take ``option``."""
    return [name for name, cls in SAMPLERS.items() if option in cls.options]


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
    made = _build("sampler", name, _lookup("sampler", name, SAMPLERS), options)
    sampler: Sampler = SelectorSampler(made) if isinstance(made, Selector) else made
    return sampler


def make_rate_limiter(name: str, **options: Any) -> RateLimiter:
    """A rate limiter by its ``--rate-limiter`` name; ValueError for an unknown name or option."""
    cls = _lookup("rate limiter", name, RATE_LIMITERS)
    limiter: RateLimiter = _build("rate limiter", name, cls, options)
    return limiter


def _given(kind: str, name: str, takes: list[str], options: dict[str, Any]) -> dict[str, Any]:
    """The options that were given (not None); ValueError naming any not in ``takes``."""
    given = {key: value for key, value in options.items() if value is not None}
    takes = [p for p in takes if p in options]
    extra = sorted(set(given) - set(takes))
    if extra:
        allowed = ", ".join(takes) or "none"
        raise ValueError(f"{kind} {name!r} takes no {', '.join(extra)} (its options: {allowed})")
    return given


def build_sampler(name: str, **options: Any) -> Sampler:
    """A sampler from flag-style options (``--sampler`` and its settings), where None means
    "not given": the sampler's default. An option given that ``name`` does not take (say
    ``priority_exponent`` for ``uniform``) is refused with a ValueError naming it."""
    cls: type[Declared] = _lookup("sampler", name, SAMPLERS)
    takes = [option.name for option in cls.options]
    return make_sampler(name, **_given("sampler", name, takes, options))


def build_rate_limiter(name: str, **options: Any) -> RateLimiter:
    """A rate limiter from flag-style options; None means "not given" (see build_sampler)."""
    takes = list(inspect.signature(_lookup("rate limiter", name, RATE_LIMITERS)).parameters)
    return make_rate_limiter(name, **_given("rate limiter", name, takes, options))


def instance_or_built(
    what: str, part: Any, kind: type[Any], build: Callable[..., Any], **options: Any
) -> Any:
    """A sampler or limiter: an instance as given (its options went to its constructor), or
    built by name from the options given (InvalidArgumentError names a bad one)."""
    if isinstance(part, kind):
        given = sorted(k for k, v in options.items() if v is not None)
        if given:
            raise InvalidArgumentError(
                f"{what} is an instance; pass {', '.join(given)} to its constructor instead"
            )
        return part
    try:
        return build(part, **options)
    except (ValueError, IndexError) as exc:
        if isinstance(exc, ShmBufferError):
            raise
        raise InvalidArgumentError(str(exc)) from exc


#: A rate limiter's settings, as a table's options name them.
LIMITER_OPTIONS = ("min_size", "samples_per_insert", "error_buffer")


def table_parts(
    sampler: str | Sampler = "uniform", rate_limiter: str | RateLimiter = "none", **options: Any
) -> tuple[Sampler, RateLimiter]:
    """A table's sampler and rate limiter, each an instance as given or built by name from
    ``options`` (the samplers' declared options and :data:`LIMITER_OPTIONS`; None: not
    given). InvalidArgumentError names an option no sampler or limiter takes, or one the
    chosen part does not take."""
    known = {option.name for option in OPTIONS} | set(LIMITER_OPTIONS)
    unknown = sorted(set(options) - known)
    if unknown:
        raise InvalidArgumentError(
            f"unknown table option {unknown[0]!r}; the options are {', '.join(sorted(known))}"
        )
    limiter_options = {k: options.get(k) for k in LIMITER_OPTIONS}
    sampler_options = {k: v for k, v in options.items() if k not in LIMITER_OPTIONS}
    built_sampler = instance_or_built("sampler", sampler, Sampler, build_sampler, **sampler_options)
    built_limiter = instance_or_built(
        "rate_limiter", rate_limiter, RateLimiter, build_rate_limiter, **limiter_options
    )
    return built_sampler, built_limiter
