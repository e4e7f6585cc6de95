"""Copying rows in and out of a segment's columns: the only code that touches row bytes.

Writes go through numpy (``np.copyto`` reached libc memcpy speed here, torch's single-thread
``copy_`` about two thirds of it); gathers use ``torch.index_select(out=)`` into one fresh
allocation per column. Both work on plain ``{key: tensor}`` dicts, not TensorDicts, to keep
per-call overhead in microseconds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from shmbuffer.schema import Key

Range = tuple[int, int]


def as_numpy(value: Any) -> np.ndarray | None:
    """A zero-copy numpy view of ``value`` when one exists (CPU tensors, arrays), else None."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu" or value.dtype == torch.bfloat16 or value.requires_grad:
            return None
        return value.numpy()
    return np.asarray(value)


class Progress:
    """How far a :func:`write` got: rows ``[0, rows)`` of the reservation (in fill order) may
    have been touched, the rest were not. An aborted reservation gives back what it evicted
    from the untouched rows (:meth:`~shmbuffer.container.Container.abort`).

    Used as a context manager around the copy into a reservation (the Buffer, the daemon's
    remote write and the Writer share it): a copy that fails calls ``abort(rows)`` before the
    error goes on, so reserve → copy → abort-on-error → commit is written once. A class, not
    ``contextlib.contextmanager``: this runs once per written chunk.
    """

    __slots__ = ("_abort", "rows")

    def __init__(self, abort: Callable[[int], object] | None = None) -> None:
        self.rows = 0
        self._abort = abort

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is not None and self._abort is not None:
            self._abort(self.rows)


def write(
    columns: Mapping[Key, torch.Tensor],
    arrays: Mapping[Key, np.ndarray],
    ranges: Sequence[Range],
    leaves: Mapping[Key, Any],
    first_row: int = 0,
    progress: Progress | None = None,
) -> None:
    """Copy rows ``first_row:`` of each validated leaf into the physical ``ranges`` in order.

    Casting is ``unsafe`` on purpose: :meth:`Schema.validate` already decided every cast (the
    dtype kind, and that the values fit), and numpy's own ``same_kind`` rule differs from
    torch's (it refuses int64 -> uint8 even for values that fit), which made a validated write
    fail halfway. Range by range, every key per range, so ``progress`` can tell which rows a
    failure left untouched.
    """
    offset = first_row
    for start, stop in ranges:
        n = stop - start
        # Every source slice first: one that cannot be read fails before a byte of the range.
        copies: list[tuple[Any, Any]] = []
        for key, value in leaves.items():
            src_np = as_numpy(value)
            # bfloat16 columns are uint16 bits to numpy: an unsafe cast would store garbage
            dst_np = arrays.get(key) if columns[key].dtype != torch.bfloat16 else None
            if src_np is not None and dst_np is not None:
                copies.append((dst_np[start:stop], src_np[offset : offset + n]))
            else:
                tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
                copies.append((columns[key][start:stop], tensor[offset : offset + n]))
        if progress is not None:  # from here rows of this range may change
            progress.rows = offset - first_row + n
        for dst, src in copies:
            if isinstance(dst, np.ndarray):
                np.copyto(dst, src, casting="unsafe")
            else:
                dst.copy_(src)
        offset += n


def owned_slice(
    value: Any, first: int, n: int, dtype: torch.dtype | None = None
) -> np.ndarray | torch.Tensor:
    """A private copy of rows ``first:first + n`` (the caller may reuse its arrays), converted
    to the column's ``dtype`` if given (validated: the values fit), so copying it later into
    shared memory is a plain memcpy that cannot fail."""
    array = as_numpy(value)
    if array is not None and dtype != torch.bfloat16:
        part = array[first : first + n]
        if dtype is None or part.dtype == _numpy_dtype(dtype):
            return part.copy()  # a third faster than astype(copy=True) on small rows
        return part.astype(_numpy_dtype(dtype))
    tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    return tensor[first : first + n].detach().to("cpu", dtype, copy=True)


def split_ranges(ranges: Sequence[Range], offset: int, n: int) -> list[Range]:
    """The parts of ``ranges`` (filled in order) that hold rows ``offset:offset + n``."""
    out: list[Range] = []
    seen = 0
    for start, stop in ranges:
        lo, hi = max(offset, seen), min(offset + n, seen + stop - start)
        if lo < hi:
            out.append((start + lo - seen, start + hi - seen))
        seen += stop - start
    return out


def nest(flat: Mapping[Key, torch.Tensor], batch_size: Sequence[int]) -> TensorDict:
    nested: dict[str, Any] = {}
    for key, tensor in flat.items():
        node = nested
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = tensor
    # The columns are ours and already consistent, so skip TensorDict's per-key validation
    # (9 us -> 2 us a call, which matters at 256-row samples).
    return TensorDict._new_unsafe(nested, batch_size=torch.Size(batch_size))


def gather_columns(
    columns: Mapping[Key, torch.Tensor], rows: np.ndarray
) -> dict[Key, torch.Tensor]:
    """Copy the given physical rows (any order, duplicates allowed) out of every column."""
    index = torch.from_numpy(np.require(rows, dtype=np.int64, requirements=["C", "W"]))
    out = {}
    for key, column in columns.items():
        dst = torch.empty((len(index), *column.shape[1:]), dtype=column.dtype)
        torch.index_select(column, 0, index, out=dst)
        out[key] = dst
    return out


def gather(columns: Mapping[Key, torch.Tensor], rows: np.ndarray) -> TensorDict:
    """Copy the given physical rows into a new TensorDict."""
    return nest(gather_columns(columns, rows), [len(rows)])


def copy_range(columns: Mapping[Key, torch.Tensor], start: int, stop: int) -> TensorDict:
    """Copy one contiguous range of rows (memcpy speed, no index tensor)."""
    return nest({k: c[start:stop].clone() for k, c in columns.items()}, [stop - start])


def view(columns: Mapping[Key, torch.Tensor], start: int, stop: int) -> TensorDict:
    """A zero-copy TensorDict view of rows ``start:stop`` (the caller guards against reuse)."""
    return nest({k: c[start:stop] for k, c in columns.items()}, [stop - start])


def read(columns: Mapping[Key, torch.Tensor], rows: np.ndarray) -> TensorDict:
    """Copy rows out, using a plain range copy when they are contiguous and ascending."""
    if len(rows) and rows[-1] - rows[0] == len(rows) - 1 and np.all(np.diff(rows) == 1):
        return copy_range(columns, int(rows[0]), int(rows[-1]) + 1)
    return gather(columns, rows)


def slice_rows(starts: np.ndarray, length: int) -> np.ndarray:
    """The physical rows of slices ``[start, start + length)``, concatenated, vectorised."""
    out: np.ndarray = (starts[:, None] + np.arange(length)).reshape(-1)
    return out


def episode_rows(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The physical rows of episodes ``[start, start + length)``, concatenated, vectorised."""
    ends_before = np.cumsum(lengths) - lengths
    out: np.ndarray = np.arange(int(lengths.sum()), dtype=np.int64)
    out += np.repeat(starts - ends_before, lengths)
    return out


_NUMPY_DTYPES: dict[torch.dtype, np.dtype[Any]] = {}


def _numpy_dtype(dtype: torch.dtype) -> np.dtype[Any]:
    # Cached: making a tensor to ask cost a fifth of a small-row writer's time.
    found = _NUMPY_DTYPES.get(dtype)
    if found is None:
        found = _NUMPY_DTYPES[dtype] = torch.empty(0, dtype=dtype).numpy().dtype
    return found


def from_bytes(
    frame: np.ndarray, dtype: torch.dtype, shape: Sequence[int], *, copy: bool = False
) -> np.ndarray | torch.Tensor:
    """Raw payload bytes (a uint8 array) viewed as rows of ``dtype`` and ``shape``: a numpy
    view when ``copy`` is False (a copy source), else an owned torch tensor."""
    if dtype == torch.bfloat16:  # no numpy dtype: go through int16
        return torch.from_numpy(frame.copy()).view(torch.bfloat16).reshape(tuple(shape))
    array: np.ndarray = frame.view(_numpy_dtype(dtype)).reshape(tuple(shape))
    return torch.from_numpy(array.copy()) if copy else array


def to_bytes(value: Any, dtype: torch.dtype) -> memoryview:
    """A leaf as contiguous bytes of the column's dtype (remote writers send these)."""
    tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    tensor = tensor.detach().to("cpu", dtype).contiguous()
    if dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return memoryview(tensor.numpy()).cast("B")  # type: ignore[arg-type]
