"""Rows a TorchRL buffer changes in place, over the daemon.

TorchRL code sets rows at places it chose: ``storage.set(index, rows)`` (``rb[i] = x``,
``writer.write_at``, ``TensorDictMaxValueWriter``, ``ConsumingSampler`` refilling consumed
rows), and edits what ``storage[:]`` returned, then says so (``rb.set_at_``, ``set_``,
``update_``: ``_bump_mutation_revision``). Over the daemon each becomes

- for rows the daemon has committed: its ``rewrite`` (``shmbuffer/daemon/rewrites.py``): the
  daemon copies the new bytes in itself, in one request, re-stamping those rows' episodes
  first, so a reader in any process copies them whole, before or after;
- for rows not written yet: an ordinary write, when they are exactly the ring's next rows
  (the daemon's pointer on: this process is the only writer), stored in ring order.

Rows that are neither (another writer's reservation, rows beyond the next ones) are refused,
naming the pointer, with nothing written.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from shmbuffer.errors import SchemaError
from shmbuffer.torchrl import batches
from shmbuffer.torchrl.batches import ROW_BATCH_KEY

#: A ``DaemonStorage`` (``storage.py`` imports this module, so it is not named here).
DaemonStorage = Any


def set_rows(storage: DaemonStorage, positions: np.ndarray, batch: Any) -> None:
    """Store ``batch`` (``batches.as_batch``: one row per position) at ``positions``: all of
    it as new rows where they are the ring's next rows in order (a ``RoundRobinWriter`` in
    step with the daemon: its pointer moves on, as that writer's cursor does); otherwise new
    rows where they are the ring's next rows in any order, rewrites where they are written."""
    writer = storage.writer
    writer.flush()
    stats = storage._fresh_stats()
    pointer, capacity = int(stats["pointer"]), int(stats["capacity"])
    batch = _without_index(batch, writer.schema)
    positions = positions % capacity
    if np.array_equal(positions, (pointer + np.arange(positions.size)) % capacity):
        batches.write_rows(writer, batch, positions.size)
        writer.flush()
        storage.forget_reads()
        return
    # A row named twice gets its last value, as an assignment into a tensor does.
    _, last = np.unique(positions[::-1], return_index=True)
    order = np.sort(positions.size - 1 - last)
    positions = positions[order]
    committed = storage._refresh().committed[positions]
    fresh = positions[~committed]
    ahead = (fresh - pointer) % capacity
    if fresh.size and int(ahead.max()) >= fresh.size:
        raise TypeError(
            f"DaemonStorage writes new rows at the ring's pointer (row {pointer} next) and "
            f"changes rows already written; rows {fresh.tolist()[:8]} are neither: the daemon, "
            "not this process, decides where new rows go. Write through "
            "shmbuffer.torchrl.DaemonWriter() (a ReplayBuffer's default over this storage)"
        )
    if fresh.size:
        new = order[~committed][np.argsort(ahead)]  # in ring order
        batches.write_rows(writer, _take(batch, new), fresh.size)
        writer.flush()
    if committed.any():
        part = batches.with_row_batch_size(_take(batch, order[committed]), writer.schema)
        writer.rewrite(positions[committed], _stored(part))
    storage.forget_reads()


def write_back(
    storage: DaemonStorage, edited: Any, physical: np.ndarray, stamps: np.ndarray
) -> int:
    """Rewrite the rows of ``edited`` (a copy of rows ``physical``, read under ``stamps``,
    that TorchRL changed in place) that differ now from the daemon's; a row a writer
    reached since the copy keeps the writer's. Returns the rows rewritten."""
    if not isinstance(edited, TensorDictBase):
        raise TypeError(
            "DaemonStorage writes back edits of TensorDict rows only; these rows are "
            f"{type(edited).__name__}s"
        )
    current = storage.get_rows(physical)
    edited = edited.reshape(physical.size, *edited.batch_size[1:])
    changed = np.zeros(physical.size, dtype=bool)
    for key in edited.keys(include_nested=True, leaves_only=True):
        new = edited.get(key)
        old = current.get(key, None)
        if old is None or old.shape != new.shape or old.dtype != new.dtype:
            changed[:] = True  # a new key, shape or dtype: the schema check names it
            break
        same = new == old
        if new.is_floating_point():  # a NaN left as it was is no change
            same |= new.isnan() & old.isnan()
        differs = (~same).reshape(physical.size, -1).any(dim=1)
        changed |= differs.numpy()
    if not changed.any():
        return 0
    rows = torch.from_numpy(np.flatnonzero(changed))
    part = batches.with_row_batch_size(edited[rows], storage.writer.schema)
    written = storage.writer.rewrite(physical[changed], _stored(part), generation=stamps[changed])
    storage.forget_reads()
    return int(written.sum())


def patch_rows(storage: DaemonStorage, index: torch.Tensor, patch: dict[Any, torch.Tensor]) -> None:
    """TorchRL's conditional update, once it decided which records are live: ``patch``'s
    keys of the records ``index`` (rows; or ``(row, step)`` cells of an ``ndim=2`` storage,
    whose rows are read, patched and written whole) rewritten in the daemon."""
    index = torch.as_tensor(index, dtype=torch.long).cpu()
    if index.ndim > 1:
        rows = index[:, 0].numpy()
        whole = np.unique(rows)
        data = storage.get_rows(whole).select(*patch)
        where = torch.from_numpy(np.searchsorted(whole, rows))
        for key, value in patch.items():
            data.get(key)[where, index[:, 1]] = value.to(data.get(key).device)
        part = batches.with_row_batch_size(data, storage.writer.schema)
        storage.writer.rewrite(whole, _stored(part))
    else:
        data = TensorDict({}, batch_size=[index.numel()])
        for key, value in patch.items():
            data.set(key, value)
        storage.writer.rewrite(index.numpy(), data)
    storage.forget_reads()


def _take(batch: Any, index: np.ndarray) -> Any:
    """Rows ``index`` of a TensorDict or a nested mapping of tensors."""
    rows = torch.from_numpy(np.ascontiguousarray(index))
    if isinstance(batch, TensorDictBase | torch.Tensor):
        return batch[rows]
    return {name: _take(value, index) for name, value in batch.items()}


def _without_index(batch: Any, schema: Any) -> Any:
    """``batch`` without an ``"index"`` the buffer's rows do not have: TorchRL's writers set
    where a row goes into the row they hand the storage (``TensorDictMaxValueWriter.add``),
    which TorchRL's storages keep only if their rows held one from the start."""
    if schema is None or ("index",) in schema or "index" not in batch.keys():
        return batch
    if isinstance(batch, TensorDictBase):
        return batch.exclude("index")
    return {k: v for k, v in batch.items() if k != "index"}


def _stored(batch: Any) -> Any:
    """``batch`` as the Writer's ``rewrite`` takes it: without the zero-byte row-batch column
    (nothing of it is stored); SchemaError for a batch with no other key."""
    if isinstance(batch, TensorDictBase):
        batch = batch.exclude(ROW_BATCH_KEY)
        empty = batch.is_empty()
    else:
        batch = {k: v for k, v in batch.items() if k != ROW_BATCH_KEY}
        empty = not batch
    if empty:
        raise SchemaError("a batch with no keys cannot change rows")
    return batch
