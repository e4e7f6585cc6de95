"""What a TorchRL buffer hands its writer, as rows shmbuffer's Writer takes: a bare tensor
under ``"_tensor"``, a list of rows stacked, a TensorDict's own row batch size kept as a
zero-byte column (used by :class:`~shmbuffer.torchrl.DaemonWriter` and by loading a state
dict, ``saving.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase, is_tensorclass

from shmbuffer.errors import SchemaError
from shmbuffer.storage.schema import Schema, to_host
from shmbuffer.torchrl import pytrees

#: The key a batch that is one bare tensor is stored under (TorchRL's StoreStorage does the
#: same); a storage whose schema has only this key reads back bare tensors.
TENSOR_KEY = "_tensor"
#: A column of zero bytes a row whose shape is the rows' own batch size, present when the
#: rows are TensorDicts of a batch size other than ``[]`` (TorchRL's storages keep it): the
#: schema every process shares then carries that size, at no cost in shared memory.
ROW_BATCH_KEY = "_row_batch_size"


def as_batch(data: Any) -> Any:
    """``data`` as shmbuffer's Writer takes it: a TensorDict or a mapping (a bare tensor is
    stored under ``"_tensor"``, a list of rows is stacked, as TorchRL reads a list)."""
    if is_tensorclass(data):
        data = data.to_tensordict()
    if isinstance(data, list):  # a list of rows, as TorchRL reads a list
        if not data:
            return {TENSOR_KEY: torch.zeros(0)}
        data = _stack_rows(data, ())  # TensorDicts, mappings or tensors, one per row
    if isinstance(data, torch.Tensor):
        return {TENSOR_KEY: data}
    if isinstance(data, TensorDictBase):
        return data
    if isinstance(data, Mapping):
        return pytrees.encode(data) if pytrees.is_tree(data) else data
    if isinstance(data, tuple | list):  # a batch of pytree rows that are tuples (or lists)
        return pytrees.encode(data)
    raise TypeError(
        f"DaemonWriter writes TensorDicts, mappings of tensors or tensors, got "
        f"{type(data).__name__}"
    )


def _stack_rows(rows: list[Any], key: tuple[str, ...]) -> Any:
    """A list of rows as one batch: TensorDicts and tensors stacked, mappings key by key."""
    first = rows[0]
    if is_tensorclass(first):
        rows = [row.to_tensordict() for row in rows]
        first = rows[0]
    if isinstance(first, TensorDictBase):
        return torch.stack(rows)
    if isinstance(first, Mapping):
        return {name: _stack_rows([row[name] for row in rows], (*key, str(name))) for name in first}
    if isinstance(first, list | tuple):  # a pytree node: stacked element by element
        stacked = [_stack_rows([row[i] for row in rows], (*key, str(i))) for i in range(len(first))]
        return stacked if isinstance(first, list) else tuple(stacked)
    try:
        return torch.stack(
            [row if isinstance(row, torch.Tensor) else torch.as_tensor(row) for row in rows]
        )
    except RuntimeError as exc:  # TorchRL's words for it, naming the key
        where = f" (key {'.'.join(key)!r})" if key else ""
        raise RuntimeError(
            f"Stacking the elements of the list resulted in an error{where}: {exc}"
        ) from None


def one_row(data: Any, prefix: tuple[str, ...] = ()) -> Any:
    """One row as a batch of one."""
    if is_tensorclass(data):
        data = data.to_tensordict()
    if isinstance(data, TensorDictBase | torch.Tensor):
        return data.unsqueeze(0)
    if isinstance(data, Mapping):
        return {key: one_row(value, (*prefix, str(key))) for key, value in data.items()}
    if isinstance(data, list | tuple):  # a pytree node
        rows = [one_row(value, (*prefix, str(i))) for i, value in enumerate(data)]
        return rows if isinstance(data, list) else tuple(rows)
    return torch.as_tensor(data).unsqueeze(0)


def with_row_batch_size(batch: Any, schema: Schema | None) -> Any:
    """``batch`` with the zero-byte column that records its rows' own batch size (a
    TensorDict of batch size ``[n, *row]`` with ``row`` not empty), checked against the size
    the buffer's rows already have."""
    row = tuple(batch.batch_size[1:]) if isinstance(batch, TensorDictBase) else ()
    if schema is not None and (TENSOR_KEY,) not in schema:
        held = tuple(schema[ROW_BATCH_KEY].shape[:-1]) if (ROW_BATCH_KEY,) in schema else ()
        if held != row:
            raise SchemaError(
                f"this buffer's rows are TensorDicts of batch size {list(held)}, got rows of "
                f"batch size {list(row)}"
            )
    if not row:
        return batch
    marked = batch.copy()  # shallow: the caller's TensorDict is left as it was
    marked.set(ROW_BATCH_KEY, torch.empty((*batch.batch_size, 0), dtype=torch.uint8))
    return marked


def count_rows(batch: Any) -> int:
    if isinstance(batch, TensorDictBase):
        if not batch.batch_size:
            raise ValueError(
                "extend takes a batch (leading dimension: rows), got a TensorDict of batch "
                "size []: use add for one row"
            )
        return int(batch.batch_size[0])
    for value in batch.values():
        return count_rows(value) if isinstance(value, Mapping) else len(value)
    raise ValueError("extend got a mapping with no keys")


def rows_between(batch: Any, first: int, end: int) -> Any:
    """Rows ``first .. end - 1`` of a TensorDict or a nested mapping of tensors."""
    if isinstance(batch, TensorDictBase | torch.Tensor):
        return batch[first:end]
    return {name: rows_between(value, first, end) for name, value in batch.items()}


def _ring_parts(num_rows: int, capacity: int) -> list[tuple[int, int]]:
    """The row ranges of a write to store, in order. A write longer than the ring keeps its
    last ``capacity`` rows, each where TorchRL's ring puts it (row ``i`` at ``(start + i) %
    capacity``) with the pointer ``num_rows`` on: the ``num_rows % capacity`` rows before
    them are written first, and overwritten by them."""
    if num_rows <= capacity:
        return [(0, num_rows)]
    tail, skip = num_rows - capacity, num_rows % capacity
    return ([(tail - skip, tail)] if skip else []) + [(tail, num_rows)]


def write_rows(writer: Any, batch: Any, num_rows: int, priority: Any = None) -> int:
    """Hand ``batch`` (from :func:`as_batch`) to shmbuffer's ``writer``; a batch longer than
    the ring is stored as TorchRL's ring keeps it (:func:`_ring_parts`). Returns the rows
    written (more than ``num_rows`` then)."""
    batch = with_row_batch_size(batch, writer.schema)
    parts = _ring_parts(num_rows, writer.capacity)
    for first, end in parts:
        part = batch if end - first == num_rows else rows_between(batch, first, end)
        writer.extend(part, priority=None if priority is None else priority[first:end])
        if len(parts) > 1:  # stored apart: gathered, the parts would not fit the ring
            writer.flush()
    return sum(end - first for first, end in parts)


def positions_of(cursor: Any, capacity: int) -> np.ndarray | None:
    """``cursor`` (an int, a range or slice, a sequence, array or tensor of ints) as an
    int64 array (0-d for one int), or None if it holds something else."""
    if isinstance(cursor, slice):
        cursor = range(*cursor.indices(capacity))
    if isinstance(cursor, range):
        return np.arange(cursor.start, cursor.stop, cursor.step, dtype=np.int64)
    try:
        array = np.asarray(to_host(cursor))
    except (TypeError, ValueError):
        return None
    if array.dtype.kind not in "iu":
        return None
    return array.astype(np.int64)
