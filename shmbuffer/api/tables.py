"""Several tables over one ring, as a user configures them: each table's options by name.

A table is a sampler and a rate limiter (with its generator and use counts) over rows every
table shares. ``Buffer(tables={"replay": {"sampler": "prioritized"}, "online": {"sampler":
"fifo", "max_times_sampled": 1}})`` names them; each table's options are the keywords one
table takes (the samplers' declared options and the limiter's), checked per table with the
table named in the error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shmbuffer.errors import InvalidArgumentError
from shmbuffer.samplers import RateLimiter, Sampler, table_parts

__all__ = ["built_table_parts", "built_tables", "table_options"]


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


def built_table_parts(name: str, options: Mapping[str, Any]) -> tuple[Sampler, RateLimiter]:
    """Table ``name``'s sampler and limiter from its options (InvalidArgumentError, naming
    the table, for an option it does not take or a part of the wrong type)."""
    try:
        return table_parts(**options)
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
