"""A field of a request or reply (:class:`Spec`) and its check (:func:`check_field`): what the
request tables (``protocol.py``) and the reply tables (``replies.py``) are made of, and the one
place a field's type, range and choices are checked, with the message that names it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shmbuffer.errors import ProtocolError


@dataclass(frozen=True)
class Spec:
    """One field of a request or reply: accepted Python types, whether required (in a reply:
    always present), numeric bounds."""

    types: tuple[type, ...]
    required: bool = True
    lo: int | None = None
    hi: int | None = None
    choices: tuple[str, ...] | None = None


def check_field(op: str, name: str, value: Any, spec: Spec, what: str = "field") -> None:
    # bool is an int subclass; never accept one for the other.
    if type(value) not in spec.types:
        expected = "/".join(t.__name__ for t in spec.types)
        raise ProtocolError(
            f"op {op!r}: {what} {name!r} must be {expected}, got {type(value).__name__}"
        )
    if (spec.lo is not None and value < spec.lo) or (spec.hi is not None and value > spec.hi):
        raise ProtocolError(
            f"op {op!r}: {what} {name!r}={value} is out of range [{spec.lo}, {spec.hi}]"
        )
    if spec.choices is not None and value not in spec.choices:
        raise ProtocolError(f"op {op!r}: {what} {name!r}={value!r} is not one of {spec.choices}")
