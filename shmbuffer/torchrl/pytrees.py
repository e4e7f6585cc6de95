"""TorchRL pytree rows (lists and tuples of tensors inside mappings, int keys) as columns.

A TorchRL storage takes rows such as ``{"a": t, "b": {"c": [t1, (t2,)]}, 30: t3}`` and gives
them back in the same shape. Columns are tensors under string keys, and a schema keeps its
keys sorted, so such a row is stored with every node's kind and place in its key (one column
per leaf), and the shape is rebuilt on read from the schema every process shares:

- a mapping's entry ``name`` at position ``i`` is ``"#d{i}:{name}"`` (an int key:
  ``"#i{i}:{key}"``), a list's element ``i`` is ``"#l{i}"``, a tuple's ``"#t{i}"``;
- so the row above is stored as the columns ``#d0:a``, ``#d1:b.#d0:c.#l0``,
  ``#d1:b.#d0:c.#l1.#t0`` and ``#i2:30``, and read back as the same dicts, list and tuple,
  in the same order (``torch.utils._pytree.tree_flatten`` gives the same leaves).

Mappings with only string keys and tensor values stay TensorDict columns under their own
names (and read back as TensorDicts); only a row holding a list, a tuple or an int key is
stored this way. Names starting with ``#`` are therefore taken as this encoding on read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from shmbuffer.errors import SchemaError

__all__ = ["encode", "is_tree", "rebuild", "stored_as_tree"]

_PART = re.compile(r"#(?:(d|i)(\d+):(.+)|(l|t)(\d+))\Z")


def is_tree(data: Any) -> bool:
    """Whether the mapping ``data`` holds a list, a tuple or a non-str key anywhere."""
    for name, value in data.items():
        if not isinstance(name, str) or isinstance(value, list | tuple):
            return True
        if isinstance(value, Mapping) and is_tree(value):
            return True
    return False


def encode(node: Any, where: str = "") -> Any:
    """``node`` (a mapping) as nested mappings of tensors whose keys say each node's kind and
    place (module docstring)."""
    if isinstance(node, Mapping):
        out: dict[str, Any] = {}
        for i, (name, value) in enumerate(node.items()):
            if isinstance(name, bool) or not isinstance(name, str | int):
                raise SchemaError(
                    f"key {where + str(name)!r}: a {type(name).__name__} key; pytree rows "
                    "take str and int keys"
                )
            part = f"#d{i}:{name}" if isinstance(name, str) else f"#i{i}:{name}"
            if isinstance(name, str) and "." in name:
                raise SchemaError(f"key {where + name!r}: a name holding '.' nests it")
            out[part] = encode(value, f"{where}{name}.")
        return out
    if isinstance(node, list | tuple):
        if not node:
            raise SchemaError(
                f"key {where.rstrip('.')!r}: an empty {type(node).__name__} holds no column"
            )
        kind = "l" if isinstance(node, list) else "t"
        return {f"#{kind}{i}": encode(value, f"{where}{i}.") for i, value in enumerate(node)}
    return node


def stored_as_tree(top_keys: list[str]) -> bool:
    """Whether a storage's columns (their first key parts) are an encoded pytree."""
    return bool(top_keys) and all(_PART.match(key) for key in top_keys)


def rebuild(node: Any) -> Any:
    """The pytree :func:`encode` stored (``node``: nested dicts of the columns read)."""
    if not isinstance(node, Mapping):
        return node
    parts = []
    for key, value in node.items():
        match = _PART.match(key)
        if match is None:
            raise ValueError(f"column {key!r} of a pytree storage has no place in the tree")
        kind, index = (match[1], match[2]) if match[1] else (match[4], match[5])
        parts.append((int(index), kind, match[3], rebuild(value)))
    parts.sort(key=lambda part: part[0])
    kinds = {kind for _, kind, _, _ in parts}
    if kinds == {"l"}:
        return [value for _, _, _, value in parts]
    if kinds == {"t"}:
        return tuple(value for _, _, _, value in parts)
    return {(int(name) if kind == "i" else name): value for _, kind, name, value in parts}
