"""``DaemonWriter``: a TorchRL ``Writer`` that hands rows to the daemon, which places them.

TorchRL's writers keep a cursor per buffer object and ``set`` rows at it; with many processes
each would have its own cursor and they would overwrite one another. This writer has none:
``extend`` gives the rows to this process's :class:`shmbuffer.Writer`, and the daemon reserves
the next rows of its one ring for them.

Indices: ``extend`` returns ``-1`` for each row written (``add``: ``-1``). shmbuffer's Writer
does not report where rows went: small writes are gathered and stored together later, and
commits are pipelined, so the rows are not even placed when ``extend`` returns. A sampler's
``extend(index)`` hook (TorchRL calls it with this) is a no-op for the samplers that work here;
to give rows a priority as they are written, name the column that holds it
(``DaemonWriter(priority_key="td_error")``): it travels with the write instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDictBase, is_tensorclass
from torchrl.data.replay_buffers.writers import Writer as TorchRLWriter

from shmbuffer.errors import SchemaError
from shmbuffer.storage.schema import Schema
from shmbuffer.torchrl.storage import (
    _NOT_HERE,
    ROW_BATCH_KEY,
    TENSOR_KEY,
    DaemonStorage,
    daemon_storage_of,
)

__all__ = ["DaemonWriter"]

#: What ``extend`` returns for each row (its position is the daemon's, and not known here).
UNKNOWN = -1


class DaemonWriter(TorchRLWriter):  # type: ignore[misc]  # TorchRL has no type hints
    """Writes a TorchRL buffer's rows through its :class:`DaemonStorage`'s Writer.

    Args:
        flush: wait after every ``extend``/``add`` until the rows are committed, so that this
            process's next ``len``/``sample`` sees them (TorchRL's own buffers behave so).
            ``False`` lets small writes gather and commits ride on the next write (far fewer
            round trips: an env worker that never reads its own writes wants this); they
            become visible within the Writer's ``commit_delay`` (50 ms by default), and at the
            latest at ``rb.storage.flush()`` or ``rb.storage.close()``, which such a worker should
            call before it exits.
        priority_key: a key whose values (one per row) are the rows' priorities on a
            ``--sampler prioritized`` daemon: sent with the write, not stored as a column.
            None: the daemon gives new rows the largest priority seen so far.
    """

    def __init__(self, *, flush: bool = True, priority_key: Any = None) -> None:
        super().__init__()
        if type(flush) is not bool:
            raise TypeError(f"flush must be True or False, got {flush!r}")
        self.flush = flush
        self.priority_key = priority_key
        #: Rows this writer object wrote in this process (TorchRL's ``rb.write_count``).
        self._write_count = 0

    def register_storage(self, storage: Any) -> None:
        super().register_storage(daemon_storage_of(storage, "DaemonWriter"))

    def _daemon(self) -> DaemonStorage:
        if self._storage is None:
            raise RuntimeError("DaemonWriter is not attached to a ReplayBuffer's storage yet")
        return daemon_storage_of(self._storage, "DaemonWriter")

    def add(self, data: Any) -> int:
        """Write one row (a TensorDict of batch size ``[]``, a mapping or a tensor)."""
        self.extend(_one_row(data))
        return UNKNOWN

    def extend(self, data: Any) -> torch.Tensor:
        """Write a batch of rows (leading dimension: rows); returns ``-1`` per row."""
        batch = _as_batch(data)
        num_rows = _num_rows(batch)
        if num_rows == 0:
            return torch.zeros(0, dtype=torch.long)
        priority = None
        if self.priority_key is not None:
            priority = _priority_of(batch, self.priority_key, num_rows)
            batch = _without(batch, self.priority_key)
        writer = self._daemon().writer
        batch = _with_row_batch_size(batch, writer.schema)
        writer.extend(batch, priority=priority)
        if self.flush:
            writer.flush()
        self._write_count += num_rows
        return torch.full((num_rows,), UNKNOWN, dtype=torch.long)

    def _empty(self, empty_write_count: bool = True) -> None:
        raise NotImplementedError(_NOT_HERE.format(what="emptying"))

    def dumps(self, path: Any) -> None:
        """Nothing to save: the writer keeps no state (the rows are the daemon's)."""

    def loads(self, path: Any) -> None:
        """Nothing to load (see :meth:`dumps`)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            raise ValueError(f"DaemonWriter keeps no state, got {sorted(state_dict)}")

    def __repr__(self) -> str:
        return f"DaemonWriter(flush={self.flush}, priority_key={self.priority_key!r})"


def _as_batch(data: Any) -> Any:
    """``data`` as shmbuffer's Writer takes it: a TensorDict or a mapping (a bare tensor is
    stored under ``"_tensor"``, a list of rows is stacked, as TorchRL reads a list)."""
    if is_tensorclass(data):
        data = data.to_tensordict()
    if isinstance(data, list):
        if not data:
            return {TENSOR_KEY: torch.zeros(0)}
        data = _stack_rows(data, ())  # TensorDicts, mappings or tensors, one per row
    if isinstance(data, torch.Tensor):
        return {TENSOR_KEY: data}
    if isinstance(data, TensorDictBase):
        return data
    if isinstance(data, Mapping):
        _refuse_sequences(data, ())
        return data
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
    if isinstance(first, TensorDictBase | torch.Tensor):
        return torch.stack(rows)
    if isinstance(first, Mapping):
        return {name: _stack_rows([row[name] for row in rows], (*key, str(name))) for name in first}
    if isinstance(first, list | tuple):
        what = f"key {'.'.join(key)!r}" if key else "each row"
        raise SchemaError(
            f"{what}: a {type(first).__name__}; DaemonStorage columns are tensors, in "
            "TensorDicts or nested mappings (TorchRL pytrees with lists or tuples are not "
            "stored: give each element a key of its own)"
        )
    return torch.stack([torch.as_tensor(row) for row in rows])


def _refuse_sequences(data: Mapping[Any, Any], prefix: tuple[str, ...]) -> None:
    """A SchemaError naming the first key whose value is a list or tuple: a TorchRL pytree
    node, not a column (read back, it could not be told from a tensor)."""
    for name, value in data.items():
        key = (*prefix, str(name))
        if isinstance(value, Mapping):
            _refuse_sequences(value, key)
        elif isinstance(value, list | tuple):
            raise SchemaError(
                f"key {'.'.join(key)!r}: a {type(value).__name__}; DaemonStorage columns are "
                "tensors, in TensorDicts or nested mappings (TorchRL pytrees with lists or "
                "tuples are not stored: give each element a key of its own)"
            )


def _one_row(data: Any, prefix: tuple[str, ...] = ()) -> Any:
    """One row as a batch of one."""
    if is_tensorclass(data):
        data = data.to_tensordict()
    if isinstance(data, TensorDictBase | torch.Tensor):
        return data.unsqueeze(0)
    if isinstance(data, Mapping):
        return {key: _one_row(value, (*prefix, str(key))) for key, value in data.items()}
    if isinstance(data, list | tuple):
        _refuse_sequences({prefix[-1] if prefix else "": data}, prefix[:-1])
    return torch.as_tensor(data).unsqueeze(0)


def _with_row_batch_size(batch: Any, schema: Schema | None) -> Any:
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


def _num_rows(batch: Any) -> int:
    if isinstance(batch, TensorDictBase):
        if not batch.batch_size:
            raise ValueError(
                "extend takes a batch (leading dimension: rows), got a TensorDict of batch "
                "size []: use add for one row"
            )
        return int(batch.batch_size[0])
    for value in batch.values():
        return _num_rows(value) if isinstance(value, Mapping) else len(value)
    raise ValueError("extend got a mapping with no keys")


def _priority_of(batch: Any, key: Any, num_rows: int) -> torch.Tensor:
    """The priority column of ``batch``, one value per row (KeyError naming it if absent)."""
    try:
        value = batch[key] if isinstance(batch, TensorDictBase) else _nested(batch, key)
    except KeyError:
        raise KeyError(f"DaemonWriter(priority_key={key!r}): the batch has no such key") from None
    value = torch.as_tensor(value)
    if value.numel() != num_rows:
        raise ValueError(
            f"DaemonWriter(priority_key={key!r}): expected one priority per row ({num_rows}), "
            f"got shape {list(value.shape)}"
        )
    return value.reshape(num_rows)


def _without(batch: Any, key: Any) -> Any:
    """``batch`` less ``key`` (a shallow copy: the caller's batch is left as it was)."""
    if isinstance(batch, TensorDictBase):
        return batch.exclude(key)
    path = (key,) if isinstance(key, str) else tuple(key)
    out = dict(batch)
    if len(path) == 1:
        del out[path[0]]
    else:
        out[path[0]] = _without(out[path[0]], path[1:])
    return out


def _nested(batch: Mapping[Any, Any], key: Any) -> Any:
    node: Any = batch
    for part in (key,) if isinstance(key, str) else tuple(key):
        node = node[part]
    return node
