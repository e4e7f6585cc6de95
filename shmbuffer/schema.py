"""Keys → dtype and per-row shape: what one row of a buffer holds.

A schema is declared up front (:meth:`Schema.from_spec`, e.g. from a TOML/JSON file) or taken
from the first batch written (:meth:`Schema.from_batch`). Later batches are checked against it
before a byte is copied; the error names the key and both dtypes or shapes.

Casting follows torch's ``can_cast`` ("same kind"): float64 → float32 and int64 → int32 are
accepted (Python scalars arrive as 64-bit), float → int, int → bool and complex → real are refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shmbuffer.errors import SchemaError

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


@dataclass(frozen=True)
class Field:
    """One leaf column: its key, element dtype and the shape of one row."""

    key: Key
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def row_nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def to_spec(self) -> dict[str, Any]:
        return {"dtype": dtype_name(self.dtype), "shape": list(self.shape)}


def iter_leaves(batch: Mapping[Any, Any], prefix: Key = ()) -> Iterator[tuple[Key, Any]]:
    """Leaf (key, value) pairs of a nested mapping or TensorDict, in a stable order."""
    for name in batch.keys():
        value = batch[name]
        key = (*prefix, str(name))
        if isinstance(value, Mapping) or _is_tensordict(value):
            yield from iter_leaves(value, key)
        else:
            yield key, value


def _is_tensordict(value: Any) -> bool:
    return hasattr(value, "batch_size") and hasattr(value, "keys")


_NUMPY_DTYPES: dict[np.dtype[Any], torch.dtype] = {}
_CAN_CAST: dict[tuple[torch.dtype, torch.dtype], bool] = {}


def _dtype_of(value: Any) -> torch.dtype:
    if isinstance(value, torch.Tensor):
        return value.dtype
    if isinstance(value, np.ndarray):  # cached: this runs for every key of every write
        dtype = _NUMPY_DTYPES.get(value.dtype)
        if dtype is None:
            dtype = _NUMPY_DTYPES[value.dtype] = torch.from_numpy(np.empty(0, value.dtype)).dtype
        return dtype
    return torch.as_tensor(value).dtype


def _can_cast(src: torch.dtype, dst: torch.dtype) -> bool:
    ok = _CAN_CAST.get((src, dst))
    if ok is None:
        ok = _CAN_CAST[(src, dst)] = torch.can_cast(src, dst)
    return ok


def _shape_of(value: Any) -> tuple[int, ...]:
    shape = getattr(value, "shape", None)
    return tuple(shape) if shape is not None else tuple(np.shape(value))


class Schema:
    """An immutable, ordered set of fields; equality is by value."""

    def __init__(self, fields: Iterable[Field]) -> None:
        ordered = sorted(fields, key=lambda f: f.key)
        keys = [f.key for f in ordered]
        if len(set(keys)) != len(keys):
            raise SchemaError(f"duplicate keys in schema: {[key_str(k) for k in keys]}")
        for field in ordered:
            if not field.key or any(not part for part in field.key):
                raise SchemaError(f"empty key component in {field.key!r}")
        self.fields: tuple[Field, ...] = tuple(ordered)
        self._by_key = {f.key: f for f in ordered}
        self._row_nbytes = sum(f.row_nbytes for f in ordered)

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_batch(cls, batch: Mapping[Any, Any], batch_dims: int = 1) -> Schema:
        """Take keys, dtypes and per-row shapes from a batch whose leading dims are rows."""
        fields = []
        for key, value in iter_leaves(batch):
            shape = _shape_of(value)
            if len(shape) < batch_dims:
                raise SchemaError(
                    f"key {key_str(key)!r}: shape {list(shape)} has no batch dimension"
                )
            fields.append(Field(key, _dtype_of(value), shape[batch_dims:]))
        if not fields:
            raise SchemaError("a batch with no keys cannot define a schema")
        return cls(fields)

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Schema:
        """From ``{"obs": {"dtype": "uint8", "shape": [4, 84, 84]}, "next": {"obs": ...}}``.

        Dotted names (``"next.obs"``) and nested tables are both accepted.
        """
        fields: list[Field] = []

        def walk(node: Mapping[str, Any], prefix: Key) -> None:
            for name, value in node.items():
                key = (*prefix, *as_key(name))
                if not isinstance(value, Mapping):
                    raise SchemaError(f"key {key_str(key)!r}: expected a table, got {value!r}")
                if "dtype" in value:
                    extra = set(value) - {"dtype", "shape"}
                    if extra:
                        raise SchemaError(f"key {key_str(key)!r}: unknown fields {sorted(extra)}")
                    shape = value.get("shape", [])
                    if not isinstance(shape, list | tuple) or not all(
                        isinstance(s, int) and s >= 0 for s in shape
                    ):
                        raise SchemaError(f"key {key_str(key)!r}: bad shape {shape!r}")
                    fields.append(Field(key, dtype_from_name(value["dtype"]), tuple(shape)))
                else:
                    walk(value, key)

        walk(spec, ())
        if not fields:
            raise SchemaError("an empty schema spec")
        return cls(fields)

    def to_spec(self) -> dict[str, Any]:
        """The JSON/msgpack-able form, flat with dotted keys; inverse of :meth:`from_spec`."""
        return {key_str(f.key): f.to_spec() for f in self.fields}

    # -- queries --------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Field]:
        return iter(self.fields)

    def __len__(self) -> int:
        return len(self.fields)

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def __getitem__(self, key: str | Key) -> Field:
        return self._by_key[as_key(key)]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schema) and self.fields == other.fields

    def __hash__(self) -> int:
        return hash(self.fields)

    def __repr__(self) -> str:
        inner = ", ".join(f"{key_str(f.key)}: {dtype_name(f.dtype)}{list(f.shape)}" for f in self)
        return f"Schema({inner})"

    @property
    def row_nbytes(self) -> int:
        return self._row_nbytes

    # -- validation -----------------------------------------------------------------------

    def check(self, batch: Mapping[Any, Any], batch_dims: int = 1) -> tuple[int, ...]:
        """Raise :class:`SchemaError` unless ``batch`` fits; return its batch shape."""
        return self.validate(batch, batch_dims)[0]

    def validate(
        self, batch: Mapping[Any, Any], batch_dims: int = 1
    ) -> tuple[tuple[int, ...], dict[Key, Any]]:
        """Check ``batch`` against the schema; return its batch shape and its leaves by key.

        Checks keys (missing and extra), castability of dtypes, per-row shapes, and that every
        key has the same leading batch dims. Touches no data, so a refused batch changes nothing.
        """
        seen: dict[Key, Any] = {}
        batch_shape: tuple[int, ...] | None = None
        for key, value in iter_leaves(batch):
            field = self._by_key.get(key)
            if field is None:
                raise SchemaError(
                    f"key {key_str(key)!r} is not in the schema (keys: "
                    f"{[key_str(f.key) for f in self.fields]})"
                )
            seen[key] = value
            dtype, shape = _dtype_of(value), _shape_of(value)
            if not _can_cast(dtype, field.dtype):
                raise SchemaError(
                    f"key {key_str(key)!r}: dtype {dtype_name(dtype)} cannot be stored safely "
                    f"in a {dtype_name(field.dtype)} column"
                )
            lead, row = shape[:batch_dims], shape[batch_dims:]
            if row != field.shape or len(lead) != batch_dims:
                raise SchemaError(
                    f"key {key_str(key)!r}: row shape {list(row)} (batch shape {list(shape)}) "
                    f"does not match the schema's {list(field.shape)}"
                )
            if batch_shape is None:
                batch_shape = lead
            elif lead != batch_shape:
                raise SchemaError(
                    f"key {key_str(key)!r}: batch dims {list(lead)} differ from other keys' "
                    f"{list(batch_shape)}"
                )
        missing = self._by_key.keys() - seen.keys()
        if missing:
            raise SchemaError(f"missing keys: {sorted(key_str(k) for k in missing)}")
        assert batch_shape is not None
        return batch_shape, seen
