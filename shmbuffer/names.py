"""Names and choices checked before anything heavy is imported (the CLI's fast path)."""

from __future__ import annotations

import re
from collections.abc import Iterable

from shmbuffer.errors import InvalidNameError

MODES = ("circular", "fixed")
UNITS = ("transition", "episode")

_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def validate_name(name: str) -> str:
    """Return ``name`` if it is safe as a single folder name under the storage dir."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or name.startswith("."):
        raise InvalidNameError(
            f"invalid segment name {name!r}: use 1-64 characters of [A-Za-z0-9_.-], "
            "not starting with '.'"
        )
    return name


def check_choice(what: str, value: str, allowed: Iterable[str]) -> str:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; expected one of {list(allowed)}")
    return value
