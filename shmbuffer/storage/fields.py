"""One column of a schema (:class:`Field`: key, dtype, a row's shape, and how it is stored:
compressed, or one frame of a stack), the dtype names a schema file uses, and keys.

A column's settings are checked here, each refusal naming the key; :mod:`shmbuffer.storage.schema`
builds schemas of them and checks batches against them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from shmbuffer.errors import SchemaError

__all__ = [
    "CODECS",
    "PADS",
    "Field",
    "Key",
    "as_key",
    "dtype_from_name",
    "dtype_name",
    "field_from_spec",
    "key_str",
]

Key = tuple[str, ...]

_DTYPES: dict[str, torch.dtype] = {
    name: dt
    for name, dt in {
        "bool": torch.bool,
        "uint8": torch.uint8,
        "int8": torch.int8,
        "int16": torch.int16,
        "int32": torch.int32,
        "int64": torch.int64,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "float32": torch.float32,
        "float64": torch.float64,
        "complex64": torch.complex64,
        "complex128": torch.complex128,
    }.items()
}
_DTYPE_NAMES: dict[torch.dtype, str] = {dt: name for name, dt in _DTYPES.items()}


def dtype_from_name(name: str) -> torch.dtype:
    if not isinstance(name, str):
        raise SchemaError(f"dtype must be a name like 'float32', got {name!r}")
    try:
        return _DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise SchemaError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise SchemaError(f"unsupported dtype {dtype}") from None


def key_str(key: Key) -> str:
    """The dotted spelling of a (possibly nested) key, used in messages and manifests."""
    return ".".join(key)


def as_key(key: str | Key) -> Key:
    return tuple(key.split(".")) if isinstance(key, str) else tuple(key)


#: What a stack column shows before its episode's first frame (``docs/frames.md``).
PADS = ("repeat", "zero")


@dataclass(frozen=True)
class Field:
    """One leaf column: its key, element dtype and the shape of one row. ``stack`` > 1: a
    frame stack, one frame (``shape``) stored per row and ``[stack, *shape]`` read, the
    frames before the episode's start ``pad``-ded (``api/frames.py``)."""

    key: Key
    dtype: torch.dtype
    shape: tuple[int, ...]
    #: A codec name (``"zstd"``, ``"lz4"``): the column is stored compressed, one chunk per
    #: episode in a byte store beside the rows, and its rows hold only where their chunk
    #: lies (``storage/packed.py``). None: stored as it is.
    compress: str | None = None
    level: int | None = None
    #: Frames a sampled row stacks (one stored per row: ``docs/frames.md``), and what comes
    #: before an episode's first frame (``"repeat"`` it, or ``"zero"``).
    stack: int = 1
    pad: str = "repeat"

    @property
    def stored(self) -> Field:
        """The column the rows hold: this one, or a compressed one's chunk reference (three
        int64 per row: the chunk's offset and length in the byte store, the row in it)."""
        return self if self.compress is None else Field(self.key, torch.int64, (3,))

    @property
    def raw_nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def row_nbytes(self) -> int:
        return self.raw_nbytes if self.compress is None else 24

    def to_spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"dtype": dtype_name(self.dtype), "shape": list(self.shape)}
        if self.compress is not None:
            spec["compress"] = self.compress
            if self.level is not None:
                spec["level"] = self.level
        if self.stack > 1:
            spec.update(stack=self.stack, pad=self.pad)
        return spec


def field_from_spec(key: Key, value: Mapping[str, Any]) -> Field:
    extra = set(value) - {"dtype", "shape", "stack", "pad", "compress", "level"}
    if extra:
        raise SchemaError(f"key {key_str(key)!r}: unknown fields {sorted(extra)}")
    shape = value.get("shape", [])
    if not isinstance(shape, list | tuple) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise SchemaError(f"key {key_str(key)!r}: bad shape {shape!r}")
    stack, pad = value.get("stack", 1), value.get("pad", "repeat")
    if type(stack) is not int or stack < 1:
        raise SchemaError(f"key {key_str(key)!r}: stack must be an int >= 1, got {stack!r}")
    if pad not in PADS:
        raise SchemaError(f"key {key_str(key)!r}: pad must be one of {list(PADS)}, got {pad!r}")
    codec, level = _compression(key, value.get("compress"), value.get("level"))
    if codec is not None and stack > 1:  # a stack gathers single rows; a chunk is an episode
        raise SchemaError(f"key {key_str(key)!r}: a stacked column cannot also be compressed")
    dtype = dtype_from_name(value["dtype"])
    return Field(key, dtype, tuple(shape), codec, level, stack, pad)


#: The codecs a column may be stored with (``compress = "zstd"`` in a schema) and their
#: levels' ranges (zstd's, and lz4 frame's compression levels).
CODECS: dict[str, tuple[int, int]] = {"zstd": (-7, 22), "lz4": (0, 16)}


def _compression(key: Key, codec: Any, level: Any) -> tuple[str | None, int | None]:
    if codec is None:
        if level is not None:
            raise SchemaError(f"key {key_str(key)!r}: 'level' without 'compress'")
        return None, None
    if codec not in CODECS:
        raise SchemaError(
            f"key {key_str(key)!r}: compress={codec!r}, expected one of {sorted(CODECS)}"
        )
    lo, hi = CODECS[codec]
    if level is not None and (type(level) is not int or not lo <= level <= hi):
        raise SchemaError(
            f"key {key_str(key)!r}: {codec} level {level!r}, expected an int in {lo}..{hi}"
        )
    return codec, level
