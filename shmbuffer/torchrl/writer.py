"""``DaemonWriter``: a TorchRL ``Writer`` that hands rows to the daemon, which places them.

TorchRL's writers keep a cursor per buffer object and ``set`` rows at it; with many processes
each would have its own cursor and they would overwrite one another. This writer has none:
``extend`` gives the rows to this process's :class:`shmbuffer.Writer`, and the daemon reserves
the next rows of its one ring for them.

Indices: with ``flush=True`` (the default) a local writer's ``extend`` returns the rows the
daemon put the batch at (its reservations say, and the rows are committed when it returns),
and tells the buffer's entities (``mark_update``), as TorchRL's writers do: TorchRL's samplers
that keep state by index (a ``PrioritizedSliceSampler``'s sum tree) then see this process's
writes. With ``flush=False``, or remotely, it returns ``-1`` for each row: small writes are
gathered and stored later and commits are pipelined, so the rows are not placed when
``extend`` returns. To give rows a priority as they are written, name the column that holds
it (``DaemonWriter(priority_key="td_error")``): it travels with the write.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDictBase
from torchrl.data.replay_buffers.writers import Writer as TorchRLWriter

from shmbuffer.torchrl import pytrees
from shmbuffer.torchrl.batches import (
    as_batch,
    count_rows,
    one_row,
    write_rows,
)
from shmbuffer.torchrl.storage import _ADAPTERS, DaemonStorage, daemon_storage_of

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
        #: The daemon's count of committed rows at the last ``empty`` (``_write_count``
        #: counts from it); None: from the daemon's start.
        self._write_base: int | None = None

    def register_storage(self, storage: Any) -> None:
        super().register_storage(daemon_storage_of(storage, "DaemonWriter"))

    def _daemon(self) -> DaemonStorage:
        if self._storage is None:
            raise RuntimeError("DaemonWriter is not attached to a ReplayBuffer's storage yet")
        return daemon_storage_of(self._storage, "DaemonWriter")

    def add(self, data: Any) -> Any:
        """Write one row (a TensorDict of batch size ``[]``, a mapping, a tensor or a
        pytree); returns its index as :meth:`extend` does (one row: an int)."""
        row = one_row(data)
        # A list here is one row's pytree node, not a list of rows as extend reads one.
        index = self.extend(pytrees.encode(row) if isinstance(row, list) else row)
        return int(index[0]) if index.ndim == 1 and index.numel() == 1 else index

    def extend(self, data: Any) -> torch.Tensor:
        """Write a batch of rows (leading dimension: rows); returns where they went (``-1``
        per row where that is not known: see the module docstring)."""
        batch = as_batch(data)
        num_rows = count_rows(batch)
        if num_rows == 0:
            return torch.zeros(0, dtype=torch.long)
        priority = None
        if self.priority_key is not None:
            priority = _priority_of(batch, self.priority_key, num_rows)
            batch = _without(batch, self.priority_key)
        writer = self._daemon().writer
        if self.flush:
            writer.placing()
        written = write_rows(writer, batch, num_rows, priority)
        if written != num_rows:  # write_count counts the rows handed, as TorchRL's does
            self._write_base = (self._write_base or 0) + written - num_rows
        placed = writer.placed() if self.flush else None
        if placed is None or placed.size != num_rows:
            # An ndim=2 storage's index has a (row, step) pair per element, as TorchRL's
            # writers give it (the row unknown: -1, the step known).
            unknown = torch.full((num_rows,), UNKNOWN, dtype=torch.long)
            return self._replicate_index(unknown)  # type: ignore[no-any-return]
        # Committed now, and where the daemon put them is known (a local writer's
        # reservations say): TorchRL's samplers keep their state (a sum tree, trajectory
        # marks) by these indices, and are told of them as TorchRL's writers tell them.
        index: torch.Tensor = self._replicate_index(torch.from_numpy(placed))
        for entity in self._daemon()._attached_entities_iter():
            entity.mark_update(index)
        return index

    # -- what TorchRL code reads of a writer: the daemon's ring, for every process -----------

    def _committed(self) -> int:
        return int(self._daemon().reader.stats()["rows_committed"])

    @property
    def _cursor(self) -> int:
        """Where the ring's next row goes: the daemon's pointer (TorchRL's writers' cursor).
        The daemon moves it as rows are written; TorchRL code that moves it past the rows it
        is about to ``write_at`` (``ConsumingSampler``'s refills) sets nothing."""
        return int(self._daemon().reader.stats()["pointer"])

    @_cursor.setter
    def _cursor(self, value: int) -> None:
        pass

    def write_at(self, index: Any, data: Any) -> Any:
        """Write ``data`` at rows ``index`` (TorchRL's ``write_at``): rows already written
        are changed in place, the ring's next rows written as new (``DaemonStorage.set``).
        Returns ``index`` as a tensor, and tells the buffer's entities."""
        self._daemon().set(index, data, set_cursor=False)
        index = torch.as_tensor(index, dtype=torch.long)
        index = self._replicate_index(index)
        for entity in self._daemon()._attached_entities_iter():
            entity.mark_update(index)
        return index

    @property
    def _write_count(self) -> int:
        """Rows committed to the daemon, by every process of the job, since it started or
        since the last ``rb.empty()`` (TorchRL's ``rb.write_count``)."""
        if self._storage is None:
            return 0
        return self._committed() - (self._write_base or 0)

    @_write_count.setter
    def _write_count(self, value: int) -> None:
        self._write_base = self._committed() - int(value)

    def _empty(self, empty_write_count: bool = True) -> None:
        """Part of ``rb.empty()`` (the storage clears the daemon): restart the write count."""
        if empty_write_count:
            self._daemon().flush()  # this process's rows count before the clear, not after
            self._write_count = 0

    def dumps(self, path: Any) -> None:
        """Nothing to save: the cursor and the write count are the daemon's."""

    def loads(self, path: Any) -> None:
        """Nothing to load (see :meth:`dumps`)."""

    def state_dict(self) -> dict[str, Any]:
        return {} if self._storage is None else {"_write_count": self._write_count}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Takes ``{}`` and TorchRL writers' ``{"_cursor", "_write_count"}`` (the cursor is
        the daemon's, restored with the rows; a write count is taken as given)."""
        unknown = sorted(set(state_dict) - {"_cursor", "_write_count"})
        if unknown:
            raise ValueError(f"DaemonWriter keeps no state of this kind, got {unknown}")
        if state_dict.get("_write_count") is not None and self._storage is not None:
            self._write_count = int(state_dict["_write_count"])

    def __repr__(self) -> str:
        return f"DaemonWriter(flush={self.flush}, priority_key={self.priority_key!r})"


_ADAPTERS["writer"] = DaemonWriter
# Writes are round trips to the daemon, which torch.compile cannot trace: run them eagerly.
for _name in ("add", "extend", "write_at"):
    _eager = torch.compiler.disable(getattr(DaemonWriter, _name))  # type: ignore[no-untyped-call]
    setattr(DaemonWriter, _name, _eager)


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
