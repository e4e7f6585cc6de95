"""``DaemonStorage(name, ndim=2)``: TorchRL's two-dimensional storages over daemon rows.

A TorchRL storage of ``ndim=2`` holds ``[rows, T]`` elements and counts each one: a buffer
``extend``s ``[T, num_envs]`` trajectories (its ``dim_extend`` puts the envs first), so each of
its rows is one env's ``T`` steps, and ``max_size`` and ``len`` count steps. Here each such
row is one daemon row, env-major, holding its ``[T]`` steps with their batch shape kept (the
zero-byte ``"_row_batch_size"`` column, as for any row that is a TensorDict of its own batch
size): the daemon's ``--capacity`` counts trajectories, ``max_size`` is that times ``T``, and
an index is ``(row, step)`` as in TorchRL (``_rand_given_ndim``, ``shape``). ``T`` is known
from the buffer's schema, so once the first trajectory is written, in every process.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["GridMixin", "check_ndim"]


def check_ndim(ndim: Any) -> int:
    """``ndim`` if it is 1 or 2; otherwise a clear refusal."""
    if isinstance(ndim, bool) or not isinstance(ndim, int) or ndim not in (1, 2):
        raise NotImplementedError(
            f"DaemonStorage is one- or two-dimensional (ndim=1: rows; ndim=2: [T, num_envs] "
            f"trajectories, one daemon row per env), got ndim={ndim!r}"
        )
    return ndim


class GridMixin:
    """What TorchRL reads of a storage's dimensions (``DaemonStorage`` supplies ``ndim``,
    ``reader``, ``_rows_in_use`` and ``get_rows``)."""

    ndim: int
    reader: Any

    def _rows_in_use(self) -> int:
        raise NotImplementedError

    def get_rows(self, index: Any) -> Any:
        raise NotImplementedError

    def _steps(self) -> int | None:
        """Elements per daemon row: 1 for ``ndim=1``; ``T`` for ``ndim=2`` once the schema
        says (None before the first write)."""
        if self.ndim == 1:
            return 1
        schema = self.reader.attach()
        if schema is None:
            return None
        keys = [field.key for field in schema.fields]
        # A TensorDict's own batch size, else the leading dimension every column shares.
        field = schema["_row_batch_size"] if ("_row_batch_size",) in keys else schema.fields[0]
        if not field.shape:
            raise ValueError(
                f"DaemonStorage(ndim=2): column {'.'.join(field.key)!r} holds one value a "
                "row; an ndim=2 buffer's rows are [T] steps (extend [T, num_envs] batches)"
            )
        return int(field.shape[0])

    @property
    def _total_shape(self) -> torch.Size | None:
        steps = self._steps()
        if steps is None:
            return None
        capacity = int(self.reader.capacity)
        return torch.Size([capacity]) if self.ndim == 1 else torch.Size([capacity, steps])

    @property
    def shape(self) -> torch.Size | None:
        steps = self._steps()
        if steps is None:
            return None
        rows = self._rows_in_use()
        return torch.Size([rows]) if self.ndim == 1 else torch.Size([rows, steps])

    @property
    def _len_along_dim0(self) -> int:
        return self._rows_in_use()

    def _max_size_along_dim0(self, *, single_data: Any = None, batched_data: Any = None) -> int:
        return int(self.reader.capacity)

    @property
    def _is_full(self) -> bool:
        return self._rows_in_use() == int(self.reader.capacity)

    def _rand_given_ndim(self, batch_size: int) -> Any:
        rows, rng = self._rows_in_use(), getattr(self, "_rng", None)  # a buffer's generator
        if self.ndim == 1:
            return torch.randint(rows, (batch_size,), generator=rng)
        steps = self._steps() or 1
        return (
            torch.randint(rows, (batch_size,), generator=rng),
            torch.randint(steps, (batch_size,), generator=rng),
        )

    def get_steps(self, index: tuple[Any, Any]) -> Any:
        """Elements ``(rows, steps)`` of an ``ndim=2`` storage, as TorchRL's indexing of its
        ``[rows, T]`` tensors gives them: ints and slices basic, two index arrays advanced
        (broadcast together)."""
        rows, steps = index
        if isinstance(rows, int | slice) or isinstance(steps, int | slice):
            data = self.get_rows(rows)  # [T] for an int, else [n, T]
            return data[steps] if isinstance(rows, int) else data[:, steps]
        rows, steps = torch.as_tensor(rows), torch.as_tensor(steps)
        shape = np.broadcast_shapes(tuple(rows.shape), tuple(steps.shape))
        rows, steps = rows.expand(shape).reshape(-1), steps.expand(shape).reshape(-1)
        data = self.get_rows(rows)
        return data[torch.arange(rows.numel()), steps].reshape(shape)
