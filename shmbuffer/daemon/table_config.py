"""The daemon's tables as its settings give them: ``--table NAME:SAMPLER[,option=value...]``
(repeatable) and ``[tables.NAME]`` in the config file.

Each table's options are the words a ``Buffer(tables=...)`` table takes (the samplers'
declared options and the rate limiter's), spelled as the ``start`` flags spell them without
``--`` on the command line (``priority-exponent=0.6``, ``min-size=100``) and either way in the
file; both go through :func:`shmbuffer.api.tables.built_tables`, so the daemon and the Buffer
refuse a bad option with the same words. The first table named is the default one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from shmbuffer.api.tables import TABLE_OPTIONS, built_tables
from shmbuffer.errors import ConfigError, InvalidArgumentError
from shmbuffer.samplers import OPTIONS, RateLimiter, Sampler

__all__ = ["TABLE_NAME", "built_config_tables", "normalized_tables", "parse_table_flag"]

#: A table's name: a word that goes into file names (its use counts), metric labels and
#: command lines as it is.
TABLE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
#: The options only a table takes (bounds: ``api/tables.py``), by name.
_BOUNDS = {option.name: option for option in TABLE_OPTIONS}
#: Each numeric option's type, as a table's options name them.
_TYPES: dict[str, type] = {
    **{option.name: option.type for option in OPTIONS},
    "min_size": int,
    "samples_per_insert": float,
    "error_buffer": float,
}


def parse_table_flag(text: str) -> tuple[str, dict[str, Any]]:
    """``NAME:SAMPLER[,option=value...]`` as a name and its options (numbers parsed by the
    option's type; an option no table takes is left for :func:`built_config_tables` to
    refuse naming the options there are). ConfigError naming the flag for a malformed one."""
    name, sep, rest = text.partition(":")
    if not sep or not rest:
        raise ConfigError(
            f"--table {text!r}: expected NAME:SAMPLER[,option=value...], e.g. "
            "replay:prioritized,priority-exponent=0.6"
        )
    sampler, *pairs = rest.split(",")
    options: dict[str, Any] = {"sampler": sampler.strip()}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--table {text!r}: {pair!r} is not option=value")
        key = key.strip().replace("-", "_")
        options[key] = _parsed(name, key, value.strip())
    return name, options


def _parsed(table: str, key: str, value: str) -> Any:
    bound = _BOUNDS.get(key)
    if bound is not None:  # a table's own option: a number, or numbers a/b/c
        try:
            return bound.parse(value)
        except ValueError:
            what = "an integer" if bound.type is int else "a number"
            what = "numbers a/b/c" if bound.many else what
            raise ConfigError(
                f"--table {table}: {bound.flag[2:]} must be {what}, got {value!r}"
            ) from None
    kind = _TYPES.get(key)
    if kind is None:
        return value  # sampler, rate_limiter, or a word refused later with the options named
    try:
        return kind(value)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        flag = key.replace("_", "-")
        raise ConfigError(f"--table {table}: {flag} must be {what}, got {value!r}") from None


def normalized_tables(tables: Any) -> dict[str, dict[str, Any]]:
    """``tables`` (name -> options, from the flags or the file) with each option's name in
    the Buffer's spelling (``priority_exponent``) and its type checked; ConfigError naming
    the table for a bad name or value."""
    if not isinstance(tables, Mapping) or not tables:
        raise ConfigError(f"tables must be a non-empty table of name -> options, got {tables!r}")
    out: dict[str, dict[str, Any]] = {}
    for name, options in tables.items():
        if not isinstance(name, str) or not TABLE_NAME.fullmatch(name):
            raise ConfigError(
                f"table name {name!r}: use letters, digits, '_', '.' and '-' (at most 64)"
            )
        if not isinstance(options, Mapping):
            raise ConfigError(f"table {name!r}: options must be a table, got {options!r}")
        given = {str(k).replace("-", "_"): v for k, v in options.items()}
        for key, value in given.items():
            kind = _TYPES.get(key)
            if kind is None or value is None:
                continue
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if not number or (kind is int and type(value) is not int) or not math.isfinite(value):
                what = "an integer" if kind is int else "a finite number"
                raise ConfigError(
                    f"table {name!r}: {key.replace('_', '-')} must be {what}, got {value!r}"
                )
        out[name] = given
    return out


def built_config_tables(
    tables: Mapping[str, Mapping[str, Any]], capacity: int
) -> dict[str, tuple[Sampler, RateLimiter]]:
    """Every table's sampler and limiter, by name (``api/tables.built_tables``), each
    limiter bound to ``capacity`` (a ``min-size`` above it is never met). A limiter that
    needs a minimum size gets 1 when none is given, as ``--rate-limiter`` does. ConfigError
    naming the table for anything refused."""
    named = {}
    for name, given in tables.items():
        options = dict(given)
        if options.get("rate_limiter") in ("sample-to-insert", "min-size"):
            options.setdefault("min_size", 1)
        named[name] = options
    try:
        built = built_tables(named)
        for name, (_, limiter) in built.items():
            try:
                limiter.bind(capacity)
            except ValueError as exc:
                raise InvalidArgumentError(f"table {name!r}: {exc}") from None
    except InvalidArgumentError as exc:
        raise ConfigError(str(exc)) from None
    return built
