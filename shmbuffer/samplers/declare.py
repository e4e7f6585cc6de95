"""What a sampler declares about itself: its options, read by everything that sets them.

A sampler class lists its constructor options as :class:`Option` values
(``Sampler.options``); the command line's flags, the daemon's config keys and their checks,
the cluster's pass-through options and the saved ``settings`` all derive from those lists,
so adding an option is one declaration beside the constructor that takes it. The module
imports nothing heavy: the command line reads the declarations to build its parser.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["Option"]

T = TypeVar("T")


@dataclass(frozen=True)
class Option(Generic[T]):
    """One constructor option of a sampler: keyword ``name`` (also its config key), the
    ``type`` a given value must have (``int`` or ``float``), the constructor's ``default``
    and a one-line ``help``. The flag that sets it is :attr:`flag`."""

    name: str
    type: type[int] | type[float]
    default: T
    help: str

    @property
    def flag(self) -> str:
        """The command-line flag: ``priority_exponent`` -> ``--priority-exponent``."""
        return "--" + self.name.replace("_", "-")
