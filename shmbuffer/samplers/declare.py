"""What a sampler declares about itself: its name, options and capabilities, read by everything
that sets it up.

A sampler class (a :class:`~shmbuffer.samplers.base.Sampler`, or a
:class:`~shmbuffer.samplers.selector.Selector` written against the narrow item contract) is a
:class:`Declared` kind: its ``name`` (``--sampler``), its constructor options as :class:`Option`
values and its capabilities. The command line's flags, the daemon's config keys and their
checks, the cluster's pass-through options, the saved ``settings``, ``status`` and the
``hello`` reply all derive from them, so adding an option is one declaration beside the
constructor that takes it.

A class of this package that sets ``name`` registers itself when it is defined
(:func:`declared`); ``shmbuffer.samplers`` imports every module of the package, so adding a
sampler is adding its module. The module imports nothing heavy: the command line reads the
declarations to build its parser.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["Declared", "Option", "declared"]

T = TypeVar("T")

#: The package whose classes register (a sampler defined elsewhere, a test's say, does not).
_PACKAGE = __name__.rpartition(".")[0]
_KINDS: dict[str, type[Declared]] = {}


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


class Declared:
    """A sampler kind's declaration, read from the class by whatever configures or serves it.

    Plain class attributes, not ``ClassVar``: the shared layer that serves a selector
    (``shapes.SelectorSampler``) is one class for every selector and takes its selector's
    declaration per instance.
    """

    #: ``--sampler NAME``; a class of this package that sets it registers under it.
    name: str
    #: The constructor's keyword options, each declared once: flags, config keys, ``Buffer``
    #: keywords and ``settings()`` derive from them.
    options: tuple[Option[Any], ...] = ()
    #: Whether ``update_priorities`` and a ``priority`` on commit mean anything here.
    has_priorities: bool = False
    #: Whether a sample must be drawn when the learner asks for it, never ahead: what one
    #: hands out decides what later ones get (a shared walk, consume-once queues, the oldest
    #: data first), so a sample sent ahead would take data the learner never asked for.
    #: ``max_times_sampled`` makes any sampler consume.
    consumes: bool = False
    #: Whether a sample that finds nothing to hand out waits for writers instead of failing
    #: at once; ``max_times_sampled`` makes any sampler wait.
    waits_for_data: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in vars(cls) or not cls.__module__.startswith(_PACKAGE + "."):
            return
        known = _KINDS.setdefault(cls.name, cls)
        if known is not cls and known.__qualname__ != cls.__qualname__:
            raise TypeError(
                f"{cls.__qualname__} and {known.__qualname__} both declare {cls.name!r}"
            )
        _KINDS[cls.name] = cls  # a module imported again replaces its own class


def declared() -> dict[str, type[Declared]]:
    """Every sampler kind this package's modules imported so far declare, by name, in the
    order they were defined."""
    return dict(_KINDS)
