"""What a TorchRL buffer does to the whole of a daemon's rows: ``empty``, ``state_dict`` and
``load_state_dict``, ``dumps`` and ``loads`` (called by :class:`DaemonStorage`).

Each of these changes or copies the rows every process of the job shares, so the ones that
change them (``empty``, ``load_state_dict``, ``loads``) and the daemon checkpoint ``dumps``
asks for are admin requests: the daemon carries them out only where the transport vouches for
the caller (its owner-only ipc socket or lane, or CURVE: "Security" in ``docs/protocol.md``),
and otherwise they are refused with what to do instead.

A ``state_dict`` holds the rows, as TorchRL's own storages' do (``{"_storage", "initialized",
"_len"}``, rows in index order, so either kind of storage loads the other's), and the ring's
position (``"_shmbuffer"``: the pointer and the capacity). Loading one clears the daemon and
writes the rows again from this process, index order, so the rows get back their indices;
for a ring that had wrapped round, the rows before the pointer are written twice, so the
next write lands where it would have. Priorities are not in it (new rows get the largest
priority seen so far): a daemon checkpoint keeps them.

``dumps(path)`` is the daemon's live checkpoint into ``path`` (written by the daemon, on its
host; restore it with ``shmbuffer-daemon start --restore PATH``) and, beside it, the state
dict (``rows.pt``), which ``loads(path)`` loads into whatever daemon this storage uses.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from shmbuffer.clients.connection import Connection
from shmbuffer.errors import LimitExceededError, PermissionDeniedError
from shmbuffer.torchrl import pytrees
from shmbuffer.torchrl.batches import as_batch, with_row_batch_size

#: The file ``dumps`` writes the state dict to, beside the daemon's checkpoint.
ROWS_FILE = "rows.pt"
#: The folder under ``dumps``'s path the daemon writes its checkpoint to.
CHECKPOINT_DIR = "daemon"
#: How often ``clear`` is asked again while other writers hold reservations.
CLEAR_RETRY_S = 0.01

_ADMIN_HINT = (
    "{what} changes the rows every process of the job shares, so it is an admin request, and "
    "the daemon refused it: {reason}. Connect over the daemon's ipc socket (same user or "
    "--group) or with CURVE keys, or on a trusted network start the daemon with "
    "--insecure-tcp-admin; or restart the daemon to start afresh"
)


def admin_call(storage: Any, what: str, op: str, **fields: Any) -> dict[str, Any]:
    """``op`` as an admin client of ``storage``'s daemon (same target, transport and keys as
    its Reader); a refusal becomes a PermissionDeniedError saying what to do."""
    keys = {
        k: storage.reader_options[k]
        for k in ("curve_server_key", "curve_client_cert")
        if k in storage.reader_options
    }
    conn = Connection(
        storage.target, "admin", timeout=storage.timeout, remote=storage.remote, **keys
    )
    try:
        return conn.call(op, **fields)
    except PermissionDeniedError as exc:
        raise PermissionDeniedError(_ADMIN_HINT.format(what=what, reason=exc)) from None
    finally:
        conn.close()


def clear(storage: Any, what: str = "rb.empty()") -> None:
    """Clear the whole daemon buffer. This process's writes are flushed first (its Writer
    then holds no reservation); other writers' reservations are waited for, up to the
    storage's timeout (the daemon clears nothing while one is open)."""
    storage.flush()
    deadline = time.monotonic() + storage.timeout
    while True:
        try:
            admin_call(storage, what, "clear")
            break
        except LimitExceededError as exc:  # another writer's reservation: milliseconds
            if time.monotonic() > deadline:
                raise LimitExceededError(
                    f"{what}: {exc} after {storage.timeout}s: pause the job's writers "
                    "(or flush them) and try again"
                ) from None
            time.sleep(CLEAR_RETRY_S)
    storage.forget_reads()


def state_dict(
    storage: Any, save_hooks: list[Any] | None = None, path: Any = None
) -> dict[str, Any]:
    """The rows in index order and the ring's position (see the module docstring), the rows
    passed through TorchRL's ``save_hooks`` first (as its checkpointers do, with their
    ``shift`` and ``is_full`` set) when ``dumps`` has any."""
    stats = storage.reader.stats()
    size = storage._extent(stats)
    rows: Any = storage.get(slice(0, size)) if size else None
    for hook in save_hooks or ():
        if hasattr(hook, "is_full"):
            hook.is_full = size == int(stats["capacity"])
        if hasattr(hook, "shift"):
            hook.shift = int(stats["pointer"]) or size
        rows = hook(rows, path=path)
    if rows is not None and not isinstance(rows, TensorDictBase | torch.Tensor):
        # A pytree: its columns as stored (their names hold its shape), rebuilt once loaded.
        rows = TensorDict(pytrees.encode(rows), batch_size=[size])
    if isinstance(rows, TensorDictBase):
        rows = rows.state_dict()
    return {
        "_storage": {} if rows is None else rows,
        "initialized": rows is not None,
        "_len": size,
        "_shmbuffer": {"pointer": int(stats["pointer"]), "capacity": int(stats["capacity"])},
    }


def load_state_dict(storage: Any, state: Mapping[str, Any]) -> None:
    """Clear the daemon and write ``state``'s rows again (a DaemonStorage's state dict, or a
    TorchRL tensor storage's)."""
    if not isinstance(state, Mapping) or "_storage" not in state:
        raise ValueError(
            "DaemonStorage.load_state_dict takes a storage's state dict (keys '_storage', "
            f"'_len'), got {type(state).__name__}"
            + (f" with keys {sorted(state)}" if isinstance(state, Mapping) else "")
        )
    rows = state["_storage"]
    if isinstance(rows, Mapping):
        rows = _tensordict_of(rows) if rows else None
    elif isinstance(rows, list):
        raise TypeError(
            "a ListStorage's state dict holds a list of rows; DaemonStorage loads tensor "
            "storages' (rows stacked into tensors or TensorDicts)"
        )
    size = int(state.get("_len", 0 if rows is None else len(rows)))
    capacity = storage.max_size
    if size > capacity:
        raise ValueError(
            f"the state dict holds {size} rows; this daemon's capacity is {capacity}: start "
            f"it with --capacity {size} or more"
        )
    if rows is not None and size:
        rows = rows[:size].clone()  # decoupled from the caller's tensors (TorchRL does too)
        schema = storage.reader.attach()
        if schema is not None:  # refused before the clear, so nothing stored is lost
            schema.validate(with_row_batch_size(as_batch(rows[:1]), schema))
    clear(storage, "load_state_dict")
    if rows is None or size == 0:
        return
    saved = state.get("_shmbuffer") or {}
    pointer = int(saved.get("pointer", size % capacity))
    parts = [np.arange(size)]
    if size == capacity and 0 < pointer < size:
        # The ring had wrapped round: write the rows before the pointer again, so the ring's
        # next write lands where it would have (on the oldest row), as before the save.
        parts.append(np.arange(pointer))
    writer = storage.writer
    for part in parts:  # one write each: a write longer than the ring would keep its tail
        batch = as_batch(rows[torch.from_numpy(part)])
        writer.extend(with_row_batch_size(batch, writer.schema))
    writer.flush()
    storage.forget_reads()


def dumps(storage: Any, path: Any) -> None:
    """The daemon's checkpoint into ``path/daemon`` and the state dict into ``path/rows.pt``."""
    folder = Path(path).absolute()
    folder.mkdir(parents=True, exist_ok=True)
    storage.flush()
    if storage.reader.attach() is not None:  # a daemon checkpoints nothing before a schema
        admin_call(storage, "dumps", "checkpoint", to=str(folder / CHECKPOINT_DIR))
    torch.save(state_dict(storage, storage.save_hooks, folder), folder / ROWS_FILE)


def loads(storage: Any, path: Any) -> None:
    """Load what :func:`dumps` wrote into ``path`` (its ``rows.pt``) into this daemon."""
    file = Path(path).absolute() / ROWS_FILE
    if not file.exists():
        raise FileNotFoundError(
            f"{file} does not exist: DaemonStorage.loads reads what DaemonStorage.dumps wrote "
            f"(a daemon checkpoint alone, in {Path(path) / CHECKPOINT_DIR}, is restored with "
            "`shmbuffer-daemon start --restore DIR`)"
        )
    state = torch.load(file, weights_only=False)
    for hook in storage.load_hooks:  # TorchRL's, in the order they were registered
        state["_storage"] = hook(state["_storage"])
    load_state_dict(storage, state)


def _tensordict_of(state: Mapping[str, Any]) -> TensorDictBase:
    """The TensorDict a TensorDict's ``state_dict()`` came from (its batch size rides in the
    state dict's metadata; lacking it, rows are the leading dimension)."""
    data = TensorDict().load_state_dict(state, strict=False)
    if not data.batch_size:
        data.auto_batch_size_(batch_dims=1)
    return data
