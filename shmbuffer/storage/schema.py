"""Keys → dtype and per-row shape: what one row of a buffer holds.

A schema is declared up front (:meth:`Schema.from_spec`, e.g. from a TOML/JSON file) or taken
from the first batch written (:meth:`Schema.from_batch`). Later batches are checked against it
before a byte is copied; the error names the key and both dtypes or shapes.

Casting follows torch's ``can_cast`` ("same kind"): float64 → float32 and int64 → int32 are
accepted (Python scalars arrive as 64-bit), float → int, int → bool and complex → real are refused.
A narrowing cast is checked value by value, vectorised and only where the column cannot hold every
value of the source dtype: an integer out of the column's range, or a finite float that would
become ``inf``, is refused naming the key (a float that only rounds is stored; NaN and inf already
in the input are kept). So validation decides every cast, and the copy (``rows.write``) cannot
fail or narrow silently once rows are reserved.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from shmbuffer.errors import SchemaError
from shmbuffer.storage.fields import (
    CODECS,
    PADS,
    Field,
    Key,
    as_key,
    dtype_from_name,
    dtype_name,
    field_from_spec,
    key_str,
)
from shmbuffer.storage.indices import to_host as to_host  # noqa: PLC0414

# A column's words are defined with it (storage/fields.py) and said from here as well.
__all__ = [
    "CODECS",
    "PADS",
    "Field",
    "Key",
    "Schema",
    "as_key",
    "dtype_from_name",
    "dtype_name",
    "iter_leaves",
    "key_str",
    "to_host",
]


def iter_leaves(batch: Mapping[Any, Any], prefix: Key = ()) -> Iterator[tuple[Key, Any]]:
    """Leaf (key, value) pairs of a nested mapping or TensorDict, in a stable order."""
    for name in batch.keys():
        value = batch[name]
        key = (*prefix, str(name))
        if type(value) in _LEAF_TYPES:  # the common case, without the ABC checks below
            yield key, value
        elif isinstance(value, Mapping) or _is_tensordict(value):
            yield from iter_leaves(value, key)
        else:
            yield key, value


_LEAF_TYPES = (np.ndarray, torch.Tensor)


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


def _as_leaf(key: Key, value: Any) -> np.ndarray | torch.Tensor:
    """``value`` as an array or tensor a column can take, else a SchemaError naming the key.

    Lists and scalars become numpy arrays here, once, so the dtype validation checks is the
    dtype the copy reads (``torch.as_tensor`` and ``np.asarray`` disagree on Python floats).
    An array in the other byte order (``>f4`` here) is copied into this machine's: the same
    values exactly, and torch, which the schema and the copies go through, has no other.
    """
    if isinstance(value, torch.Tensor):
        return value
    if value is None:
        raise SchemaError(f"key {key_str(key)!r}: the value is None")
    try:
        leaf = np.asarray(value)
    except (TypeError, ValueError, OverflowError) as exc:  # ragged lists, odd objects
        raise SchemaError(
            f"key {key_str(key)!r}: a {type(value).__name__} that is not an array ({exc})"
        ) from None
    if leaf.dtype.kind in "USOVMm":  # str, bytes, objects, records, datetimes
        what = {"U": "str", "S": "bytes", "O": "Python object"}.get(leaf.dtype.kind, "")
        raise SchemaError(
            f"key {key_str(key)!r}: {what or leaf.dtype} values (numpy dtype {leaf.dtype}) "
            "cannot be stored; columns hold bool, int, float or complex"
        )
    if not leaf.dtype.isnative:
        leaf = leaf.astype(leaf.dtype.newbyteorder("="))
    try:
        _dtype_of(leaf)
    except TypeError:  # float128, uint16 on an old torch, ...
        raise SchemaError(f"key {key_str(key)!r}: unsupported dtype {leaf.dtype}") from None
    return leaf


# (value dtype, column dtype) -> None when every value of the first fits the second, else what
# a value check must compare: "int" (the column's integer range) or "float" (overflow to inf).
_RANGE_CHECK: dict[tuple[torch.dtype, torch.dtype], str | None] = {}


def _range_check(src: torch.dtype, dst: torch.dtype) -> str | None:
    check = _RANGE_CHECK.get((src, dst), "?")
    if check != "?":
        return check
    check = None
    if src not in (dst, torch.bool):
        if dst.is_floating_point or dst.is_complex:
            inexact = src.is_floating_point or src.is_complex
            src_max = torch.finfo(src).max if inexact else torch.iinfo(src).max
            check = "float" if torch.finfo(dst).max < src_max else None
        else:  # an int column: can_cast let only int (or bool) values through
            s, d = torch.iinfo(src), torch.iinfo(dst)
            check = "int" if s.min < d.min or s.max > d.max else None
    _RANGE_CHECK[(src, dst)] = check
    return check


def _extremes(value: np.ndarray | torch.Tensor) -> tuple[float, float] | None:
    """Smallest and largest finite value (real and imaginary parts alike); None if none.
    Two vectorised passes; NaN and inf are skipped, since they are stored as they are."""
    if (isinstance(value, np.ndarray) and value.dtype.kind == "c") or (
        isinstance(value, torch.Tensor) and value.is_complex()
    ):
        parts = [_extremes(value.real), _extremes(value.imag)]
        found = [p for p in parts if p is not None]
        return (min(p[0] for p in found), max(p[1] for p in found)) if found else None
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.device.type == "cpu" and value.dtype != torch.bfloat16:
            return _extremes(value.numpy())  # numpy's reductions: many times torch's
        if value.numel() == 0:
            return None
        lo, hi = value.min().item(), value.max().item()  # GPU and bfloat16 tensors
        if value.is_floating_point() and not (math.isfinite(lo) and math.isfinite(hi)):
            finite = value[torch.isfinite(value)]  # rare: NaN or inf present
            return _extremes(finite) if finite.numel() else None
        return lo, hi
    if value.size == 0:
        return None
    flat = value.reshape(-1) if value.flags.c_contiguous else value
    if value.dtype.kind in "iu":
        return flat.min().item(), flat.max().item()
    lo, hi = np.fmin.reduce(flat, axis=None).item(), np.fmax.reduce(flat, axis=None).item()
    if not (math.isfinite(lo) and math.isfinite(hi)):  # fmin/fmax skip NaN, not inf
        finite = value[np.isfinite(value)]
        return _extremes(finite) if finite.size else None
    return lo, hi


_INF_THRESHOLD: dict[torch.dtype, float] = {}


def _inf_threshold(dst: torch.dtype) -> float:
    """The smallest magnitude a copy into ``dst`` may round to inf (pure arithmetic, no cast).

    Rounding to nearest even sends the largest finite value plus half an ulp to inf. numpy
    casts float64 to float16 in one rounding, torch's CPU cast in two (via float32), which
    moves the threshold down by half a float32 ulp for the 16-bit dtypes; a value either one
    would send to inf is refused (a value that close to the limit is no loss). Exact in
    float64 for every float dtype.
    """
    limit = _INF_THRESHOLD.get(dst)
    if limit is None:
        info = torch.finfo(dst)  # a complex dtype: its real part's
        limit = info.max + info.eps * 2.0 ** (math.frexp(info.max)[1] - 1) / 2
        if info.bits < 32:  # float16, bfloat16: their limit is a float32; half its ulp below
            limit -= 2.0 ** (math.frexp(limit)[1] - 1 - 23) / 2
        _INF_THRESHOLD[dst] = limit
    return limit


def _check_fits(key: Key, value: Any, src: torch.dtype, dst: torch.dtype, check: str) -> None:
    """Refuse values the narrowing cast ``src`` → ``dst`` would wrap or overflow to inf."""
    extremes = _extremes(value)
    if extremes is None:
        return
    lo, hi = extremes
    if check == "int":
        info = torch.iinfo(dst)
        if info.min <= lo and hi <= info.max:
            return
        raise SchemaError(
            f"key {key_str(key)!r}: {dtype_name(src)} values from {lo} to {hi} do not fit the "
            f"{dtype_name(dst)} column (range {info.min}..{info.max}); a narrower column takes "
            "them only when every one fits: clip or convert them first"
        )
    limit = _inf_threshold(dst)
    if -limit < lo and hi < limit:
        return
    bad = lo if lo <= -limit else hi
    raise SchemaError(
        f"key {key_str(key)!r}: value {bad:g} would overflow to inf in the {dtype_name(dst)} "
        f"column (largest finite {torch.finfo(dst).max:g}); scale or clip it first"
    )


def _can_cast(src: torch.dtype, dst: torch.dtype) -> bool:
    ok = _CAN_CAST.get((src, dst))
    if ok is None:
        ok = _CAN_CAST[(src, dst)] = torch.can_cast(src, dst)
        # A pair the full check passes with no value check: the flat fast path's test.
        _PLAIN_COPY[(src, dst)] = ok and _range_check(src, dst) is None
    return ok


#: (value dtype, column dtype) -> whether values go in as they are (castable, no value check);
#: filled by :func:`_can_cast`, so a pair the full check never saw is not in it.
_PLAIN_COPY: dict[tuple[torch.dtype | None, torch.dtype], bool] = {}


def _nested_literal(key: Key) -> str:
    """``{'info': {'x': value}}`` for the key ``('info', 'x')``, for error messages."""
    return "".join(f"{{{part!r}: " for part in key) + "value" + "}" * len(key)


def _mapping(batch: Any) -> Mapping[Any, Any]:
    if not (isinstance(batch, Mapping) or _is_tensordict(batch)):
        raise SchemaError(
            f"a batch must be a mapping of key -> array (a dict or TensorDict), got a "
            f"{type(batch).__name__}"
        )
    return batch  # type: ignore[no-any-return]


def _shape_of(value: Any) -> tuple[int, ...]:
    shape = getattr(value, "shape", None)
    return tuple(shape) if shape is not None else tuple(np.shape(value))


class Schema:
    """An immutable, ordered set of fields; equality is by value.

    ``next_of``: keys that store nothing of their own, each the next observation of a stored
    field (``{("next", "obs"): ("obs",)}``): read from the row after (``docs/frames.md``)."""

    def __init__(self, fields: Iterable[Field], next_of: Mapping[Key, Key] | None = None) -> None:
        ordered = sorted(fields, key=lambda f: f.key)
        keys = [f.key for f in ordered]
        if len(set(keys)) != len(keys):
            raise SchemaError(f"duplicate keys in schema: {[key_str(k) for k in keys]}")
        self.next_of: dict[Key, Key] = dict(sorted((next_of or {}).items()))
        for key, of in self.next_of.items():
            if of not in keys:
                raise SchemaError(
                    f"key {key_str(key)!r}: next_of {key_str(of)!r} names no stored column "
                    f"(keys: {[key_str(k) for k in keys]})"
                )
            if key in keys or key in self.next_of.values():
                raise SchemaError(f"key {key_str(key)!r}: next_of a column, and a column too")
        for field in ordered:
            if not field.key or any(not part for part in field.key):
                raise SchemaError(f"empty key component in {field.key!r}")
            # Specs and manifests spell keys dotted, so a dotted name would come back nested.
            dotted = next((part for part in field.key if "." in part), None)
            if dotted is not None:
                raise SchemaError(
                    f"key {key_str(field.key)!r}: the name {dotted!r} contains '.', which "
                    f"separates nested keys; nest the value instead: "
                    f"{_nested_literal(as_key(dotted))}"
                )
        self.fields: tuple[Field, ...] = tuple(ordered)
        self._by_key = {f.key: f for f in ordered}
        self._row_nbytes = sum(f.row_nbytes for f in ordered)
        # asked by every write plan and every Reader.sample: decided once
        self._has_frames = bool(self.next_of) or any(f.stack > 1 for f in ordered)
        #: name -> (field, dims of a batch of its rows), when every key is one name: what
        #: :meth:`_validate_flat` checks a plain dict against.
        self._flat: dict[str, tuple[Field, int]] = (
            {f.key[0]: (f, len(f.shape) + 1) for f in ordered}
            if all(len(f.key) == 1 for f in ordered)
            else {}
        )

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_batch(cls, batch: Mapping[Any, Any], batch_dims: int = 1) -> Schema:
        """Take keys, dtypes and per-row shapes from a batch whose leading dims are rows."""
        fields = []
        for key, value in iter_leaves(_mapping(batch)):
            leaf = _as_leaf(key, value)  # a SchemaError for str, None, objects
            shape = _shape_of(leaf)
            if len(shape) < batch_dims:
                raise SchemaError(
                    f"key {key_str(key)!r}: shape {list(shape)} has no batch dimension (the "
                    "first dimension counts rows: one row is value[None])"
                )
            dtype = _dtype_of(leaf)
            if leaf is not value:  # Python floats keep defining float32 columns, as in torch
                with contextlib.suppress(TypeError, ValueError, RuntimeError):
                    dtype = torch.as_tensor(value).dtype
            fields.append(Field(key, dtype, shape[batch_dims:]))
        if not fields:
            raise SchemaError("a batch with no keys cannot define a schema")
        return cls(fields)

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Schema:
        """From ``{"obs": {"dtype": "uint8", "shape": [4, 84, 84]}, "next": {"obs": ...}}``.

        Dotted names (``"next.obs"``) and nested tables are both accepted.
        """
        fields: list[Field] = []
        next_of: dict[Key, Key] = {}

        def walk(node: Mapping[str, Any], prefix: Key) -> None:
            for name, value in node.items():
                key = (*prefix, *as_key(name))
                if not isinstance(value, Mapping):
                    raise SchemaError(f"key {key_str(key)!r}: expected a table, got {value!r}")
                if "next_of" in value:
                    if set(value) != {"next_of"} or not isinstance(value["next_of"], str):
                        raise SchemaError(
                            f"key {key_str(key)!r}: a next_of column is "
                            f'{{next_of = "<key>"}} alone, got {dict(value)!r}'
                        )
                    next_of[key] = as_key(value["next_of"])
                elif "dtype" in value:
                    fields.append(field_from_spec(key, value))
                else:
                    walk(value, key)

        walk(spec, ())
        if not fields:
            raise SchemaError("an empty schema spec")
        return cls(fields, next_of)

    def to_spec(self) -> dict[str, Any]:
        """The JSON/msgpack-able form, flat with dotted keys; inverse of :meth:`from_spec`."""
        spec = {key_str(f.key): f.to_spec() for f in self.fields}
        spec.update({key_str(k): {"next_of": key_str(of)} for k, of in self.next_of.items()})
        return spec

    @property
    def has_frames(self) -> bool:
        """Whether a column is a frame stack or a next_of: writes and reads then go through
        ``api/frames.py``."""
        return self._has_frames

    @property
    def tail(self) -> int:
        """Rows each episode is written with after its last step: one (its last next
        observation) with a next_of column, else none."""
        return 1 if self.next_of else 0

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
        return (
            isinstance(other, Schema)
            and self.fields == other.fields
            and self.next_of == other.next_of
        )

    def __hash__(self) -> int:
        return hash(self.fields)

    def __repr__(self) -> str:
        inner = ", ".join(
            f"{key_str(f.key)}: {dtype_name(f.dtype)}{list(f.shape)}"
            + (f" stack={f.stack}" if f.stack > 1 else "")
            for f in self
        )
        nexts = "".join(f", {key_str(k)}: next_of {key_str(o)}" for k, o in self.next_of.items())
        return f"Schema({inner}{nexts})"

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

        Checks keys (missing and extra), castability of dtypes, that values fit a narrower
        column (see the module docs), per-row shapes, and that every key has the same leading
        batch dims. Lists and scalars come back as numpy arrays. Writes nothing, so a refused
        batch changes nothing.
        """
        if batch_dims == 1 and type(batch) is dict and self._flat:
            flat = self._validate_flat(batch)
            if flat is not None:
                return flat
        seen: dict[Key, Any] = {}
        narrowing: list[tuple[Key, Any, torch.dtype, torch.dtype, str]] = []
        batch_shape: tuple[int, ...] | None = None
        for key, given in iter_leaves(_mapping(batch)):
            field = self._by_key.get(key)
            if field is None:
                raise SchemaError(self._unknown_key(key))
            # Arrays of a dtype seen before skip _as_leaf's checks (this runs per key per write).
            dtype = _NUMPY_DTYPES.get(given.dtype) if type(given) is np.ndarray else None
            if dtype is not None:
                value = seen[key] = given
            else:
                value = seen[key] = _as_leaf(key, given)
                dtype = _dtype_of(value)
            shape = _shape_of(value)
            if not _can_cast(dtype, field.dtype):
                raise SchemaError(
                    f"key {key_str(key)!r}: dtype {dtype_name(dtype)} cannot be stored safely "
                    f"in a {dtype_name(field.dtype)} column"
                )
            lead, row = shape[:batch_dims], shape[batch_dims:]
            if row != field.shape or len(lead) != batch_dims:
                if shape == field.shape:  # one row, or a scalar, given without its batch dim
                    raise SchemaError(
                        f"key {key_str(key)!r}: shape {list(shape)} is one row of the schema's "
                        f"{list(field.shape)} without a batch dimension; the first dimension "
                        f"counts rows (one row is shape {[1, *field.shape]}: value[None])"
                    )
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
            check = _range_check(dtype, field.dtype)
            if check is not None:
                narrowing.append((key, value, dtype, field.dtype, check))
        missing = self._by_key.keys() - seen.keys()
        if missing:
            raise SchemaError(f"missing keys: {sorted(key_str(k) for k in missing)}")
        for item in narrowing:  # last: only a batch that fits otherwise is worth a data pass
            _check_fits(*item)
        assert batch_shape is not None
        return batch_shape, seen

    def _validate_flat(
        self, batch: dict[Any, Any]
    ) -> tuple[tuple[int, ...], dict[Key, Any]] | None:
        """:meth:`validate` of the common write in one pass, at a fraction of the full
        check's cost (per-call work is what small-row writes lose to): a plain dict
        with exactly the schema's keys, all flat, of arrays or tensors whose dtype the column
        takes as it is (castable, no value check) and whose shapes agree. The result is what
        the full check returns for it; None sends anything else, a bad batch included, to the
        full check, which then names what is wrong."""
        flat, plain = self._flat, _PLAIN_COPY
        if len(batch) != len(flat):
            return None
        leaves: dict[Key, Any] = {}
        rows = -1
        for name, value in batch.items():
            entry = flat.get(name)
            if entry is None:
                return None
            field, dims = entry
            kind = type(value)
            if kind is torch.Tensor:
                dtype = value.dtype
            elif kind is np.ndarray:
                dtype = _NUMPY_DTYPES.get(value.dtype)
            else:
                return None
            shape = value.shape
            if not plain.get((dtype, field.dtype), False) or len(shape) != dims:
                return None
            if dims > 1 and shape[1:] != field.shape:
                return None
            if rows != shape[0]:
                if rows >= 0:
                    return None
                rows = shape[0]
            leaves[field.key] = value
        return (rows,), leaves

    def _unknown_key(self, key: Key) -> str:
        known = [key_str(f.key) for f in self.fields]
        nested = as_key(key_str(key))
        if nested != key and nested in self._by_key:  # {"info.x": v} for the key info -> x
            return (
                f"batch key {key_str(key)!r} is one name containing '.', but the schema's "
                f"{key_str(nested)!r} is a nested key ({' -> '.join(nested)}): pass "
                f"{_nested_literal(nested)}"
            )
        return f"key {key_str(key)!r} is not in the schema (keys: {known})"
