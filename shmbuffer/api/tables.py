"""Several tables over one ring, as a user configures them: each table's options by name.

A table is a sampler and a rate limiter (with its generator and use counts) over rows every
table shares. ``Buffer(tables={"replay": {"sampler": "prioritized"}, "online": {"sampler":
"fifo", "max_times_sampled": 1}})`` names them; each table's options are the keywords one
table takes (the samplers' declared options and the limiter's), checked per table with the
table named in the error, and the options only a table takes (:data:`TABLE_OPTIONS`: which
live episodes it draws from at all, by age and by policy version; ``ring/bounds.py`` applies
them).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from shmbuffer.errors import InvalidArgumentError
from shmbuffer.samplers import RateLimiter, Sampler, table_parts
from shmbuffer.samplers.declare import Option

__all__ = [
    "TABLE_OPTIONS",
    "Bounds",
    "TableOption",
    "built_table_parts",
    "built_tables",
    "table_bounds",
    "table_options",
]

#: The metadata name the staleness options read: an int, the version of the policy that
#: wrote the episode.
POLICY_VERSION = "policy_version"
#: The most lags ``staleness_weights`` may weigh (a bound on the list a config may give).
MAX_LAGS = 1024


@dataclass(frozen=True)
class TableOption(Option[Any]):
    """An option only a table takes, declared as a sampler's are (:class:`Option`): its
    keyword and config key ``name``, the ``type`` of its value (of each value when ``many``),
    its ``default`` (None: off) and a one-line ``help``. ``many``: a list of values, written
    ``a/b/c`` on a command line (``--table name:kind,key=a/b/c``; commas part the options)."""

    many: bool = False

    def parse(self, text: str) -> Any:
        """The value a command line's ``text`` gives (ValueError if it does not parse)."""
        if self.many:
            return [self.type(part) for part in text.split("/")]
        return self.type(text)


MAX_EPISODES = TableOption(
    "max_episodes", int, None, "draw only from the newest N live episodes (a recent table)"
)
MAX_STALENESS = TableOption(
    "max_staleness",
    int,
    None,
    "draw only from episodes whose policy_version is at least the newest one minus K",
)
STALENESS_WEIGHTS = TableOption(
    "staleness_weights",
    float,
    None,
    "a weight per policy_version lag (lag 0 first); episodes lagging past the list are not drawn",
    many=True,
)
#: Every option a table takes besides its sampler's and its limiter's.
TABLE_OPTIONS: tuple[TableOption, ...] = (MAX_EPISODES, MAX_STALENESS, STALENESS_WEIGHTS)


@dataclass(frozen=True)
class Bounds:
    """Which live episodes a table draws from at all (``ring/bounds.py`` applies it): the
    newest ``max_episodes``, those whose ``policy_version`` lags the newest committed one by
    at most ``max_staleness``, each lag weighted by ``staleness_weights`` (lag 0 first; a
    lag past them not drawn). None: no bound of that kind."""

    max_episodes: int | None = None
    max_staleness: int | None = None
    staleness_weights: tuple[float, ...] | None = None

    @property
    def max_lag(self) -> int | None:
        """The largest lag drawn (None: any, and policy_version is not read)."""
        if self.staleness_weights is not None:
            return len(self.staleness_weights) - 1
        return self.max_staleness


def checked_tables(tables: Iterable[str] | None, names: Iterable[str]) -> list[str] | None:
    """The tables a write goes into, among the tables ``names``: each once, in order; None
    for None or every table. InvalidArgumentError naming the tables there are for a name
    that is none of them, a str given for a list, or no table at all (the rows would be in
    no table). The same words from a Buffer (``Container.members``) and a Writer."""
    if tables is None:
        return None
    known = list(names)
    listed = ", ".join(known)
    if isinstance(tables, str) or not isinstance(tables, Iterable):
        raise InvalidArgumentError(
            f"tables must be a list of table names, got {tables!r}; the tables are {listed}"
        )
    given = list(tables)
    for name in given:
        if not isinstance(name, str) or name not in known:
            raise InvalidArgumentError(f"tables: no table named {name!r}; the tables are {listed}")
    if not given:
        raise InvalidArgumentError(
            f"tables: an empty list puts the rows in no table; name one of {listed} (or give "
            "None: every table)"
        )
    chosen = list(dict.fromkeys(given))
    return None if len(chosen) == len(known) else chosen


def table_options(
    tables: Mapping[str, Mapping[str, Any]] | None, options: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """Each table's options by name: ``tables`` as given, or one table named ``"default"`` of
    the buffer's own sampler and limiter keywords (``options``), which ``tables`` excludes."""
    if tables is None:
        return {"default": options}
    own = [k for k, v in options.items() if v is not None and k not in ("sampler", "rate_limiter")]
    own += [
        k for k, plain in (("sampler", "uniform"), ("rate_limiter", "none")) if options[k] != plain
    ]
    if own:
        raise InvalidArgumentError(
            f"with tables= give {', '.join(sorted(own))} per table, inside tables=, not beside it"
        )
    if not isinstance(tables, Mapping) or not tables:
        raise InvalidArgumentError(
            f"tables must be a non-empty mapping of name -> options, got {tables!r}"
        )
    out = {}
    for name, given in tables.items():
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"a table's name must be a non-empty str, got {name!r}")
        if not isinstance(given, Mapping):
            raise InvalidArgumentError(f"table {name!r}: options must be a mapping, got {given!r}")
        out[name] = dict(given)
    return out


def table_bounds(name: str, options: Mapping[str, Any]) -> Bounds | None:
    """Table ``name``'s :class:`Bounds` from its options (None: it has none); the other
    options are left for :func:`built_table_parts`. InvalidArgumentError naming the table and
    the option for a value of the wrong type or out of range."""
    given = {o.name: options[o.name] for o in TABLE_OPTIONS if options.get(o.name) is not None}
    if not given:
        return None
    for key in ("max_episodes", "max_staleness"):
        value = given.get(key)
        least = 1 if key == "max_episodes" else 0
        if value is not None and (type(value) is not int or value < least):
            raise InvalidArgumentError(
                f"table {name!r}: {key} must be an int >= {least}, got {value!r}"
            )
    weights = given.get("staleness_weights")
    if weights is not None:
        weights = _weights(name, weights)
        if "max_staleness" in given:
            raise InvalidArgumentError(
                f"table {name!r}: give max_staleness or staleness_weights, not both (the "
                "weights' length bounds the lag already)"
            )
    return Bounds(given.get("max_episodes"), given.get("max_staleness"), weights)


def _weights(name: str, given: Any) -> tuple[float, ...]:
    what = f"table {name!r}: staleness_weights"
    if isinstance(given, str | bytes) or not hasattr(given, "__iter__"):
        raise InvalidArgumentError(f"{what} must be a list of floats (lag 0 first), got {given!r}")
    weights = []
    for value in given:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidArgumentError(f"{what}: {value!r} is not a number")
        if not (math.isfinite(value) and value >= 0):
            raise InvalidArgumentError(f"{what}: {value!r} is not finite and >= 0")
        weights.append(float(value))
    if not 0 < len(weights) <= MAX_LAGS or not any(weights):
        raise InvalidArgumentError(
            f"{what} must weigh 1 to {MAX_LAGS} lags, one of them above 0, got {given!r}"
        )
    return tuple(weights)


def built_table_parts(name: str, options: Mapping[str, Any]) -> tuple[Sampler, RateLimiter]:
    """Table ``name``'s sampler and limiter from its options, its :data:`TABLE_OPTIONS`
    checked (:func:`table_bounds`) and left out (InvalidArgumentError, naming the table, for
    an option it does not take or a part of the wrong type)."""
    table_bounds(name, options)
    own = {key: value for key, value in options.items() if key not in _TABLE_KEYS}
    try:
        return table_parts(**own)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"table {name!r}: {exc}") from None
    except TypeError as exc:  # a sampler or limiter of the wrong type, say
        raise InvalidArgumentError(f"table {name!r}: {exc}") from None


def built_tables(named: Mapping[str, Mapping[str, Any]]) -> dict[str, tuple[Sampler, RateLimiter]]:
    """Every table's sampler and limiter, by name (:func:`built_table_parts`); a sampler or
    limiter instance given to two tables is refused: each belongs to one table's state."""
    built = {name: built_table_parts(name, options) for name, options in named.items()}
    owners: dict[int, str] = {}
    for name, parts in built.items():
        for part in parts:
            other = owners.setdefault(id(part), name)
            if other != name:
                raise InvalidArgumentError(
                    f"tables {other!r} and {name!r} were given the same {type(part).__name__} "
                    "instance; give each table its own"
                )
    return built


_TABLE_KEYS = frozenset(option.name for option in TABLE_OPTIONS)
