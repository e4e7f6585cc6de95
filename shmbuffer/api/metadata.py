"""What an episode's metadata may be, checked with the same words by every front end: the
in-process :class:`~shmbuffer.Buffer` (through :class:`~shmbuffer.ring.meta.EpisodeMeta`), the
daemon's, and a :class:`~shmbuffer.clients.writer.Writer` before it writes anything.

Names are identifiers (a filter names them) other than the buffer's own (:data:`BUILTIN`).
Values are scalars (numpy scalars and 0-d tensors count as the scalar they hold), each of one
kind per name, :data:`KINDS`: declared up front, or taken from the first value given; an int is
taken where a float is kept, nothing else mixes. A refusal is InvalidArgumentError naming the
name.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from shmbuffer.errors import InvalidArgumentError

__all__ = [
    "BUILTIN",
    "KINDS",
    "EpisodeRecords",
    "check_kinds",
    "check_name",
    "check_values",
    "kind_of",
]

KINDS = ("int", "float", "bool", "str")
#: The names the buffer records itself, and their kinds (``id`` is computed, never stored).
BUILTIN = {"id": "int", "length": "int", "commit_time": "float", "writer": "str"}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def kind_of(value: Any) -> str | None:
    """A scalar's kind, or None for anything else (numpy scalars and 0-d arrays count)."""
    if isinstance(value, bool | np.bool_):
        return "bool"
    if isinstance(value, int | np.integer):
        return "int"
    if isinstance(value, float | np.floating):
        return "float"
    if isinstance(value, str):
        return "str"
    return None


def check_name(name: Any) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidArgumentError(
            f"metadata name {name!r} must be an identifier (letters, digits, _), as a "
            "filter names it"
        )
    if name in BUILTIN:
        raise InvalidArgumentError(
            f"metadata {name!r} is recorded by the buffer itself "
            f"({', '.join(BUILTIN)}); give your value another name"
        )


def check_kinds(declared: Mapping[str, str]) -> dict[str, str]:
    """Declared names and kinds (``{"ret": "float", "env_id": "str"}``), checked."""
    if not isinstance(declared, Mapping):
        raise InvalidArgumentError(f"metadata kinds must map name -> kind, got {declared!r}")
    for name, kind in declared.items():
        check_name(name)
        if kind not in KINDS:
            raise InvalidArgumentError(
                f"metadata {name!r}: kind {kind!r} is not one of {', '.join(KINDS)}"
            )
    return dict(declared)


def check_values(
    meta: Mapping[str, Any] | None, kinds: Mapping[str, str], declared: bool
) -> tuple[dict[str, Any], dict[str, str]]:
    """``(values, new kinds)``: ``meta`` as plain Python scalars, each of its name's kind in
    ``kinds``, and the kinds of names ``kinds`` lacks (taken from their values; refused when
    ``declared``, where ``kinds`` lists every name allowed)."""
    if meta is None:
        return {}, {}
    if not isinstance(meta, Mapping):
        raise InvalidArgumentError(f"meta must be a mapping of name -> scalar, got {meta!r}")
    out: dict[str, Any] = {}
    new: dict[str, str] = {}
    for name, given in meta.items():
        check_name(name)
        value = given
        if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
            value = value.item()  # a 0-d tensor or array: the scalar it holds
        kind = kind_of(value)
        if kind is None:
            raise InvalidArgumentError(
                f"metadata {name!r}: a scalar (int, float, bool or str) is needed, got "
                f"{type(given).__name__}"
            )
        known = kinds.get(name)
        if known is None and declared:
            raise InvalidArgumentError(
                f"metadata {name!r} is not declared (declared: {', '.join(kinds) or 'none'})"
            )
        if known is None:  # taken lazily: the first value given decides its kind
            new[name] = known = kind
        if known != kind and not (known == "float" and kind == "int"):
            raise InvalidArgumentError(
                f"metadata {name!r} holds {known} values, got a {kind} ({value!r})"
            )
        if hasattr(value, "item"):  # a numpy scalar: the Python one (msgpack, JSON)
            value = value.item()
        out[name] = float(value) if known == "float" else value
    return out, new


class EpisodeRecords:
    """The episodes a query found (``EpisodeMeta.select``, or a daemon's ``episodes``
    reply): ``ids`` (int64, in the order asked for) and, per name, a
    ``numpy.ma.MaskedArray`` of the values, masked where an episode has none."""

    def __init__(self, ids: npt.NDArray[np.int64], columns: dict[str, np.ma.MaskedArray]) -> None:
        self.ids = ids
        self.columns = columns

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, name: str) -> np.ma.MaskedArray:
        return self.columns[name]

    def rows(self) -> list[dict[str, Any]]:
        """One dict per episode: ``id`` and every value it has (missing names left out)."""
        out: list[dict[str, Any]] = []
        for i, episode_id in enumerate(self.ids.tolist()):
            row: dict[str, Any] = {"id": episode_id}
            for name, column in self.columns.items():
                if name != "id" and not np.ma.getmaskarray(column)[i]:
                    row[name] = column.data[i].item() if column.dtype != object else column.data[i]
            out.append(row)
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.rows())

    def __repr__(self) -> str:
        return f"EpisodeRecords({len(self)} episodes, names={sorted(self.columns)})"
