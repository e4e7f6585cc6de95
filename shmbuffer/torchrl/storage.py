"""``DaemonStorage``: a TorchRL ``Storage`` whose rows live in a running shmbuffer daemon.

Indices are the daemon's physical rows, ``0 .. capacity - 1``: the positions of a ring, as in
TorchRL's own ring storages (``max_size`` is the capacity, a full ring wraps round, and
``_last_cursor_index`` is the row written last). TorchRL's client-side samplers therefore run
unchanged on it, and the rows :class:`~shmbuffer.torchrl.DaemonSampler` gets from the daemon
(and ``update_priority`` takes) are indices of this storage too.

``len()`` counts the ring positions in use: before the ring first wraps round, the rows
written so far; after it, the capacity. It is the daemon's row count plus the rows writers
have reserved and not committed yet (until their next commit, milliseconds), so that every
index below ``len`` holds data or soon will, as a TorchRL sampler assumes.

A read (``get``) copies the rows out of shared memory (remotely: the daemon sends them) and
checks them against the daemon's list of committed rows and their generation stamps: a row
still being written is waited for until its writer commits it, and a row a writer reached
during the copy is copied again (what that position holds now). A read is never torn. The
list is kept between reads and asked again (one ``iterate`` request, 16 bytes a stored row)
only when a read finds it out of date.

The Reader and the Writer are opened lazily, per process: a storage pickled into a spawned
worker, or inherited by a forked one, opens its own there.
"""

from __future__ import annotations

import functools
import inspect
import operator
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from torchrl.data.replay_buffers.samplers import PrioritizedSampler as TorchRLPrioritizedSampler
from torchrl.data.replay_buffers.storages import TensorStorage
from torchrl.data.replay_buffers.writers import TensorDictRoundRobinWriter

from shmbuffer.clients.reader import Reader
from shmbuffer.clients.writer import Writer
from shmbuffer.errors import TornReadError, WaitTimeoutError
from shmbuffer.storage import rows
from shmbuffer.storage.schema import Schema, to_host
from shmbuffer.torchrl import batches, inplace, pytrees, saving
from shmbuffer.torchrl.batches import ROW_BATCH_KEY, TENSOR_KEY
from shmbuffer.torchrl.dims import GridMixin, check_ndim

__all__ = ["DaemonStorage", "daemon_storage_of"]

#: ``{"writer": DaemonWriter, "sampler": DaemonSampler}``, filled in by their modules (which
#: import this one): what :meth:`DaemonStorage.attach` gives a buffer in place of TorchRL's
#: defaults.
_ADAPTERS: dict[str, Any] = {}
#: Rounds of copying again the rows a writer reached during the copy, then TornReadError.
MAX_RECOPIES = 8
#: Arguments DaemonStorage sets itself, so the options may not carry them.
_OWN = ("target", "timeout", "remote")


@dataclass
class _Listing:
    """The daemon's committed rows when last asked: a flag and a generation stamp per row."""

    committed: np.ndarray  # bool [capacity]
    stamps: np.ndarray  # int64 [capacity]


def _checked_options(options: Mapping[str, Any] | None, client: type, name: str) -> dict[str, Any]:
    """``options`` for ``client(...)``, refused now (naming the key) rather than at first use."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(f"{name} must be a mapping of keyword arguments, got {options!r}")
    known = set(inspect.signature(client).parameters) - {"self", *_OWN}
    for key in options:
        if key not in known:
            raise TypeError(
                f"{name}: {key!r} is not an argument of shmbuffer.{client.__name__} "
                f"(accepted: {', '.join(sorted(known))}; target, timeout and remote are "
                "DaemonStorage's own)"
            )
    return dict(options)


class DaemonStorage(GridMixin, TensorStorage):  # type: ignore[misc]  # TorchRL has no type hints
    """A TorchRL ``Storage`` backed by a shmbuffer daemon in transition unit.

    A ``TensorStorage`` to TorchRL (its rows are TensorDicts, read batched: no collate; the
    samplers and views that need one, ``SliceSampler`` and ``Sequence``, accept it), though
    every method that touches rows is this class's own: none keeps rows in this process.

    Args:
        target: a buffer name or endpoint, as ``shmbuffer.Reader``/``Writer`` take.
        timeout: seconds any single wait on the daemon may take, and how long a read waits
            for rows a writer has not committed yet.
        remote: as for ``Reader``/``Writer`` (None: automatic).
        reader_options, writer_options: further keyword arguments of the Reader and the
            Writer (CURVE keys, ``sample_timeout``, ``commit_delay``, ...). The Reader samples
            without ``prefetch`` unless asked, so a sample reflects every priority update
            made before it.
        ndim: 1 (rows), or 2: ``[T, num_envs]`` trajectories, one env's ``T`` steps a daemon
            row, indexed ``(row, step)`` (``shmbuffer/torchrl/dims.py``).

    Writes go through :class:`~shmbuffer.torchrl.DaemonWriter` (a buffer's default over this
    storage), or ``set`` at the ring's pointer: the daemon decides where new rows go; rows
    written already may be changed in place (:meth:`set`, ``inplace.py``). ``rb.empty()``,
    ``load_state_dict`` and ``loads`` change the rows every process of the job shares, as
    admin requests (``shmbuffer/torchrl/saving.py``).
    """

    #: TorchRL's conditional updates (``rb.update_if_present``, with a writer that tracks
    #: generations): the live records are rewritten in the daemon (``inplace.py``).
    supports_conditional_update = True

    def __init__(
        self,
        target: str = "default",
        *,
        timeout: float = 10.0,
        remote: bool | None = None,
        reader_options: Mapping[str, Any] | None = None,
        writer_options: Mapping[str, Any] | None = None,
        ndim: int = 1,
    ) -> None:
        # Neither TensorStorage.__init__ (it holds rows) nor Storage.__init__ (it sets
        # max_size, here the daemon's capacity, known once a client has said hello).
        if not isinstance(target, str) or not target:
            raise TypeError(f"target must be a buffer name or an endpoint, got {target!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.target = target
        self.ndim = check_ndim(ndim)
        self.timeout = float(timeout)
        self.remote = remote
        self.reader_options = {"prefetch": False} | _checked_options(
            reader_options, Reader, "reader_options"
        )
        self.writer_options = _checked_options(writer_options, Writer, "writer_options")
        self._compilable = False
        self.checkpointer = None  # TorchRL's default (unused: see dumps)
        self.save_hooks: list[Any] = []
        self.load_hooks: list[Any] = []
        self._attached_entities_list: list[Any] = []
        self._capacity: int | None = None
        self._pid = os.getpid()
        self._reader: Reader | None = None
        self._writer: Writer | None = None
        self._listing: _Listing | None = None
        self._stats: dict[str, Any] | None = None  # the daemon's stats when last asked
        #: ``(index, data)`` a DaemonSampler drew, for the ``get(index)`` that follows it.
        self._handed: tuple[Any, Any] | None = None
        #: The last ``storage[:]``: the rows, their physical rows and stamps (inplace.py).
        self._whole: tuple[Any, np.ndarray, np.ndarray] | None = None

    # -- the clients, one of each per process -------------------------------------------------

    def _own_clients(self) -> None:
        """Forget clients inherited through ``fork``: their sockets are the parent's."""
        if self._pid == os.getpid():
            return
        for client in (self._reader, self._writer):
            if client is not None:
                client.close()  # in a forked child this only marks the copy closed
        self._reader = self._writer = None
        self._listing = self._stats = self._handed = None
        self._pid = os.getpid()

    def _adopt(self, client: Reader | Writer) -> None:
        if client.unit != "transition":
            client.close()
            raise ValueError(
                f"DaemonStorage({self.target!r}) needs a daemon in transition unit (TorchRL "
                f"indexes rows): this one runs in {client.unit} unit; start it with "
                "`shmbuffer-daemon start --unit transition`"
            )
        self._capacity = client.capacity

    @property
    def reader(self) -> Reader:
        """This process's Reader (opened at first use)."""
        self._own_clients()
        if self._reader is None:
            reader = Reader(
                self.target, timeout=self.timeout, remote=self.remote, **self.reader_options
            )
            self._adopt(reader)
            self._reader = reader
        return self._reader

    @property
    def writer(self) -> Writer:
        """This process's Writer (opened at first use)."""
        self._own_clients()
        if self._writer is None:
            writer = Writer(
                self.target, timeout=self.timeout, remote=self.remote, **self.writer_options
            )
            self._adopt(writer)
            self._writer = writer
        return self._writer

    @property
    def max_size(self) -> int:
        """The daemon's capacity in rows (``ndim=2``: in steps, rows times ``T``)."""
        if self._capacity is None:  # an open Writer would have set it: ask through a Reader
            self._capacity = self.reader.capacity
        return self._capacity if self.ndim == 1 else self._capacity * (self._steps() or 1)

    def flush(self) -> None:
        """Wait until everything this process wrote is committed (a no-op before any write)."""
        self._own_clients()
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close this process's clients; the storage opens new ones if used again."""
        self._own_clients()
        reader, writer = self._reader, self._writer
        self._reader = self._writer = None
        self._listing = self._stats = self._handed = None
        try:
            if writer is not None:
                writer.close()
        finally:
            if reader is not None:
                reader.close()

    def __enter__(self) -> DaemonStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- pickling: settings travel, clients do not --------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(
            _reader=None, _writer=None, _listing=None, _stats=None, _handed=None, _rng=None
        )
        state["_pid"] = -1  # whoever unpickles it opens its own clients
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # -- sizes --------------------------------------------------------------------------------

    def _fresh_stats(self) -> dict[str, Any]:
        stats = self.reader.stats()
        self._stats = stats
        return stats

    @staticmethod
    def _extent(stats: Mapping[str, Any]) -> int:
        """Ring positions in use: committed or being written. Before the ring wraps round
        they are ``[0, pointer)``; once it has, every row (committed plus reserved rows then
        exceed the pointer)."""
        pointer, capacity = int(stats["pointer"]), int(stats["capacity"])
        in_use = int(stats["rows"]) + int(stats["reserved_rows"])
        return pointer if in_use <= pointer else capacity

    def __len__(self) -> int:
        rows = self._rows_in_use()
        return rows if self.ndim == 1 else rows * (self._steps() or 1)

    def _rows_in_use(self) -> int:
        return self._extent(self._fresh_stats())

    @property
    def _last_cursor_index(self) -> int | None:
        """The row written last (SliceSampler ends a trajectory there in a full ring), from
        the daemon's state at the last ``len()``."""
        stats = self._stats if self._stats is not None else self._fresh_stats()
        if self._extent(stats) == 0:
            return None
        return (int(stats["pointer"]) - 1) % int(stats["capacity"])

    @property
    def _mutation_revision(self) -> int:
        """Changes when the daemon commits or rewrites rows (TorchRL's caches key on it)."""
        stats = self._fresh_stats()
        return int(stats["rows_committed"]) + int(stats.get("rows_rewritten", 0))

    def attach(self, buffer: Any) -> None:
        """TorchRL's hook when a buffer takes this storage (before it makes its writer and
        sampler): TorchRL's defaults that cannot work over a daemon become the adapters, so
        that giving a buffer this storage is the whole change. A buffer built with no writer
        gets a :class:`DaemonWriter` (TorchRL's default ``RoundRobinWriter`` or
        ``TensorDictRoundRobinWriter`` sets rows at its own cursor, which is the daemon's
        only while this process is the only writer); a TorchRL ``PrioritizedSampler`` (one
        sum tree per process, keyed by the indices ``extend`` returns), a
        ``PrioritizedReplayBuffer``'s own included, becomes a :class:`DaemonSampler` with its
        ``beta``, whose ``alpha`` is the daemon's ``--priority-exponent`` (checked at the
        first sample)."""
        super().attach(buffer)
        if not hasattr(buffer, "_init_writer"):
            return
        writer, sampler = _ADAPTERS.get("writer"), _ADAPTERS.get("sampler")
        made = buffer._init_writer
        default = made is None or (  # TensorDictReplayBuffer's default: a partial of its writer
            isinstance(made, functools.partial) and made.func is TensorDictRoundRobinWriter
        )
        if default and writer is not None:
            buffer._init_writer = writer()
        if type(buffer._init_sampler) is TorchRLPrioritizedSampler and sampler is not None:
            prioritized = buffer._init_sampler
            buffer._init_sampler = sampler(
                beta=float(prioritized._beta), alpha=float(prioritized._alpha)
            )

    def contains(self, item: Any) -> Any:
        size = self._rows_in_use()
        if isinstance(item, torch.Tensor):
            return (item >= 0) & (item < size)
        index = operator.index(item)
        return 0 <= index < size

    # -- reading ------------------------------------------------------------------------------

    @property
    def _storage(self) -> Any:
        """What TorchRL's own storages keep their rows in, which TorchRL code and tests read
        (``storage._storage[index]``, its keys; ``Sequence`` checks it is a TensorDict): here
        a checked copy of the rows in use (:meth:`get`), ``capacity`` rows long as TorchRL's
        (the rows not written yet zeros). Writing into it stores nothing."""
        used = self._rows_in_use()
        schema = self.reader.attach()
        if self.ndim != 1 or schema is None or used == self.max_size:
            return self.get_rows(slice(None))
        rows = _unfilled(schema, self.max_size).zero_()
        rows[:used] = self._read(np.arange(used, dtype=np.int64))
        return self._unwrap(rows)

    @property
    def initialized(self) -> bool:
        """Whether the rows have a schema yet (TorchRL's ``TensorStorage`` flag)."""
        return self.reader.attach() is not None

    def get(self, index: Any) -> Any:
        """The rows at ``index`` (an int, a slice of ``[0, len)``, a sequence, array or tensor
        of rows, or a 1-tuple of one): a TensorDict of ``index``'s shape (one row: batch size
        ``[]``), or a tensor if the storage was written bare tensors."""
        handed, self._handed = self._handed, None
        if handed is not None and handed[0] is index:
            return handed[1]  # a DaemonSampler's draw, already copied and checked
        if isinstance(index, str) or (
            isinstance(index, tuple) and index and all(isinstance(k, str) for k in index)
        ):  # a key: that column of the rows in use, as a TensorStorage's get(key)
            return self.get_rows(slice(None))[index]
        if self.ndim == 2 and isinstance(index, tuple) and len(index) == 2:
            return self.get_steps(index)  # (rows, steps), as TorchRL indexes an ndim=2 one
        rows = self.get_rows(index)
        if isinstance(index, slice) and index == slice(None) and self._listing is not None:
            physical = np.arange(len(rows), dtype=np.int64)  # rb.set_at_ & co. edit storage[:]
            self._whole = (rows, physical, self._listing.stamps[physical])
        return rows

    def get_rows(self, index: Any) -> Any:
        """Whole daemon rows (see :meth:`get`)."""
        physical, shape = self._physical(index)
        data = self._read(physical)
        if shape == ():
            data = data[0]
        elif len(shape) > 1:
            data = data.reshape(*shape)
        return self._unwrap(data)

    def _unwrap(self, data: TensorDict) -> Any:
        """Rows as they were written: a bare tensor, or TensorDicts of their own batch size."""
        schema = self.reader.schema
        if schema is None:
            return data
        keys = [f.key for f in schema.fields]
        if keys == [(TENSOR_KEY,)]:
            return data[TENSOR_KEY]
        if pytrees.stored_as_tree([key[0] for key in keys]):
            return pytrees.rebuild(data.to_dict())
        if (ROW_BATCH_KEY,) in keys:
            row_batch = schema[ROW_BATCH_KEY].shape[:-1]
            data = data.exclude(ROW_BATCH_KEY)
            data.batch_size = torch.Size([*data.batch_size, *row_batch])
        return data

    def _physical(self, index: Any) -> tuple[np.ndarray, tuple[int, ...]]:
        """``index`` as int64 physical rows, and the shape of the result (``()``: one row)."""
        if isinstance(index, tuple):
            if len(index) != 1:
                raise IndexError(
                    f"DaemonStorage is one-dimensional (ndim=1), got an index of {len(index)} "
                    "dimensions"
                )
            (index,) = index
        if isinstance(index, slice):
            positions = np.arange(self._rows_in_use(), dtype=np.int64)[index]
            return positions, positions.shape
        array = np.asarray(to_host(index))
        if array.dtype == np.bool_:
            raise IndexError("DaemonStorage takes row numbers, not a boolean mask")
        if array.size and array.dtype.kind not in "iu":
            raise IndexError(f"DaemonStorage indices must be integers, got {array.dtype}")
        physical = array.astype(np.int64).reshape(-1)
        if (physical < 0).any():  # from the end of the rows in use, as a TorchRL storage
            physical = np.where(physical < 0, physical + self._rows_in_use(), physical)
        outside = (physical < 0) | (physical >= self.max_size)
        if outside.any():
            raise IndexError(
                f"row {int(array.reshape(-1)[outside][0])} is out of range for a buffer of "
                f"capacity {self.max_size}"
            )
        return physical, array.shape

    def _read(self, physical: np.ndarray) -> TensorDict:
        """A checked copy of ``physical`` (see the module docstring): the rows the list says
        are committed are copied at once, and only those a writer holds or reached during
        the copy wait for a fresh list (with many rows, some are always being written)."""
        schema = self.reader.attach()  # maps the segment once the buffer has a schema
        if schema is None:
            if physical.size:
                raise IndexError(f"row {int(physical[0])}: nothing has been written yet")
            return TensorDict({}, batch_size=[0])
        if not physical.size:
            return _unfilled(schema, 0)
        data: TensorDict | None = None
        deadline = time.monotonic() + self.timeout
        fresh = self._listing is None
        listing = self._refresh() if self._listing is None else self._listing
        todo = np.arange(physical.size)
        recopies, pause = 0, 0.001
        while todo.size:
            want = physical[todo]
            ready = listing.committed[want]
            if ready.any():
                part, moved = self._copy(want[ready], listing.stamps[want[ready]])
                if data is None and bool(ready.all()) and not moved.any():
                    return part  # the usual case: one copy, nothing to patch
                if data is None:
                    data = _unfilled(schema, physical.size)
                copied = todo[ready]
                if part is not None:
                    data[torch.from_numpy(copied)] = part
                if moved.any():
                    recopies += 1
                    if recopies > MAX_RECOPIES:
                        raise TornReadError(
                            f"rows kept being overwritten through {MAX_RECOPIES} copies (row "
                            f"{int(physical[copied[moved][0]])}): the ring is far too small "
                            "for the write rate"
                        )
                todo = np.concatenate([todo[~ready], copied[moved]])
            elif fresh:  # the daemon's current list lacks them all: wait for their writers
                self._check_pending(want, deadline)
                time.sleep(pause)
                pause = min(2 * pause, 0.05)
            if todo.size:
                listing, fresh = self._refresh(), True
        assert data is not None
        return data

    def _copy(self, want: np.ndarray, stamps: np.ndarray) -> tuple[TensorDict | None, np.ndarray]:
        """Copy rows ``want`` listed with ``stamps``; also says which moved during the copy
        (those must be copied again; remotely a torn copy is refused whole: all of them)."""
        try:
            return self.reader.read(want, stamps)
        except TornReadError:  # remote: the daemon refused the copy whole
            return None, np.ones(want.size, dtype=bool)

    def _refresh(self) -> _Listing:
        """Ask the daemon which rows are committed, and their stamps (then its stats: a row
        missing from the list and past the ring's extent after it was never written)."""
        reader = self.reader
        physical, gens = reader.committed_rows()
        self._fresh_stats()
        committed = np.zeros(reader.capacity, dtype=bool)
        stamps = np.full(reader.capacity, -1, dtype=np.int64)
        committed[physical], stamps[physical] = True, gens
        self._listing = _Listing(committed, stamps)
        return self._listing

    def _check_pending(self, absent: np.ndarray, deadline: float) -> None:
        """Raise unless the uncommitted rows ``absent`` may still be committed in time.

        Whether a writer holds them cannot be told from here (the daemon's stats count
        reserved rows, not which), so a row inside the ring's extent is waited for: a
        reservation ends, committed or aborted, within the daemon's ``--reservation-ttl``."""
        stats = self._stats
        assert stats is not None  # _refresh took them
        extent, row = self._extent(stats), int(absent[0])
        if row >= extent:
            raise IndexError(f"row {row} holds no data: {extent} rows of the ring are in use")
        if time.monotonic() > deadline:
            raise WaitTimeoutError(
                f"row {row} holds no committed data after {self.timeout}s: its writer is slow "
                "to commit, or died mid-write and left a gap that stays until the ring comes "
                "round to it"
            )

    # -- writing at rows this process names, emptying ----------------------------------------

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """Write ``data`` at rows ``cursor``: the ring's next rows (its pointer on: TorchRL's
        ``RoundRobinWriter``, a fresh storage's ``set(range(n), rows)``) as new rows; rows
        written already changed in place (``rb[i] = x``, ``write_at``, TorchRL's max-value
        writer: the daemon's ``rewrite``, ``inplace.py``); any other row is refused."""
        positions = batches.positions_of(cursor, self._max_size_along_dim0())
        if positions is None:
            raise TypeError(f"DaemonStorage.set takes row numbers, got {cursor!r}")
        if isinstance(data, range):
            data = list(data)
        batch = batches.as_batch(batches.one_row(data) if positions.ndim == 0 else data)
        num_rows = batches.count_rows(batch)
        positions = positions.reshape(-1)
        if positions.size != num_rows:
            raise ValueError(f"{positions.size} rows named for {num_rows} rows of data")
        inplace.set_rows(self, positions, batch)

    def _bump_mutation_revision(self) -> None:
        """After ``rb.set_at_``, ``set_`` or ``update_`` edited what ``storage[:]`` returned:
        the rows edited are rewritten in the daemon (``inplace.write_back``)."""
        whole, self._whole = self._whole, None
        if whole is not None:
            inplace.write_back(self, *whole)

    def _apply_conditional_patch(self, index: Any, patch: dict[Any, Any]) -> None:
        inplace.patch_rows(self, index, patch)  # rb.update_if_present's live records

    def _empty(self) -> None:
        """``rb.empty()``: clears the whole daemon buffer, for every process (an admin
        request: ``shmbuffer.torchrl.saving``)."""
        saving.clear(self)

    def forget_reads(self) -> None:
        """Drop what reads keep between calls (the committed rows, the stats, a handed draw):
        the daemon's rows changed wholesale."""
        self._listing = self._stats = self._handed = None

    def state_dict(self) -> dict[str, Any]:
        """The rows in index order and the ring's position (``shmbuffer.torchrl.saving``)."""
        return saving.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Clear the daemon and write ``state_dict``'s rows again, at their indices."""
        saving.load_state_dict(self, state_dict)

    def dumps(self, path: Any) -> None:
        """The daemon's checkpoint into ``path/daemon``, and the rows into ``path/rows.pt``."""
        saving.dumps(self, path)

    def register_save_hook(self, hook: Any) -> None:
        """A TorchRL save hook, called on the rows by :meth:`dumps` (``shift`` and ``is_full``
        set as TorchRL's checkpointers set them)."""
        self.save_hooks.append(hook)

    def register_load_hook(self, hook: Any) -> None:
        """A TorchRL load hook, called on the rows :meth:`loads` read."""
        self.load_hooks.append(hook)

    def loads(self, path: Any) -> None:
        """Load the rows :meth:`dumps` wrote into ``path`` into this daemon."""
        saving.loads(self, path)

    def __repr__(self) -> str:
        return f"DaemonStorage({self.target!r})"


def _unfilled(schema: Schema, num_rows: int) -> TensorDict:
    """``num_rows`` rows of ``schema``, not yet filled in."""
    columns = {f.key: torch.empty((num_rows, *f.shape), dtype=f.dtype) for f in schema}
    return rows.nest(columns, [num_rows])


def daemon_storage_of(storage: Any, who: str) -> DaemonStorage:
    """``storage`` if it is a DaemonStorage, else a TypeError saying ``who`` needs one."""
    if not isinstance(storage, DaemonStorage):
        raise TypeError(
            f"{who} works with a DaemonStorage only (storage=shmbuffer.torchrl."
            f"DaemonStorage(name)), got {type(storage).__name__}"
        )
    return storage


# torch.compile cannot trace a round trip to the daemon or a checked copy out of shared
# memory: a compiled function using a buffer over the daemon runs these eagerly (graph breaks).
_EAGER = "get set __len__ contains _max_size_along_dim0 _rand_given_ndim _rand_given_ndim_impl"
for _name in _EAGER.split():
    _eager = torch.compiler.disable(getattr(DaemonStorage, _name))  # type: ignore[no-untyped-call]
    setattr(DaemonStorage, _name, _eager)
