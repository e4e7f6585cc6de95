"""Copying rows of columns that live on a GPU (:mod:`shmbuffer.storage.cuda_segment`): the device's
counterpart of :mod:`shmbuffer.storage.rows`, which hands it every gather of device columns.

* **Gathers** run on the device (``torch.index_select`` per column) on a side stream of this
  process, so they do not wait behind the learner's queued work, and end with that stream
  synchronised: the reader compares generation stamps (host memory) after the copy, and a
  gather still queued at that moment could read a row a writer reached after the check. The
  results are handed to the caller's current stream (``record_stream``) so the caching
  allocator never gives their blocks to the side stream while the caller still reads them.
  With ``out`` (host arrays, as :func:`rows.out_arrays` makes) the rows are copied there.
* **Writes** (:class:`DeviceWriter`): host rows go through a ring of pinned staging slots
  (numpy copy into the slot, then a non-blocking host -> device copy, a slot reused only once
  its copies are done), GPU rows device -> device; :meth:`DeviceWriter.write` returns once an
  event recorded after the last copy completed, so the commit that follows publishes only
  copied rows, and after a failure nothing of the write lands later (the abort that follows
  may hand the rows to another writer).

Every function also works on CPU tensors (no streams, no pinning), which is how the CPU test
run covers their logic; the GPU tests (``-m gpu``) run them on a device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from shmbuffer.storage.schema import Key

#: Bytes per pinned staging slot, and slots in the ring: a slot is refilled while the copy
#: out of the other one runs.
SLOT_BYTES = 8 << 20
SLOTS = 2
_ALIGN = 256  # slot offsets: any dtype can be viewed there

_side_streams: dict[torch.device, Any] = {}


class Progress(Protocol):
    """What :class:`rows.Progress` is to this module: how far a write got."""

    rows: int


def _side_stream(device: torch.device) -> Any:
    """This process's side stream for ``device`` (one per device, made at first use)."""
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    return stream


def _check_rows(index: np.ndarray, capacity: int) -> None:
    # an index past the end would be a device-side assert, which ends the CUDA context
    if len(index) and int(np.maximum.reduce(index.view(np.uint64))) >= capacity:
        bad = index[(index < 0) | (index >= capacity)]
        raise IndexError(f"row {int(bad[0])} is out of range for {capacity} rows")


def gather_columns(
    columns: Mapping[Key, torch.Tensor],
    rows: np.ndarray,
    *,
    out: Mapping[Key, np.ndarray] | None = None,
) -> dict[Key, torch.Tensor]:
    """Copy the given physical rows (any order, duplicates allowed) out of every device
    column into fresh device tensors, or into ``out`` (host numpy views with at least
    ``len(rows)`` rows; bfloat16 columns as uint16 bits), complete when this returns. A row
    out of range raises IndexError before anything runs."""
    if not columns:
        return {}
    index = np.ascontiguousarray(rows, dtype=np.int64)
    first = next(iter(columns.values()))
    _check_rows(index, int(first.shape[0]))
    device = first.device
    if device.type != "cuda":
        picked = torch.from_numpy(index)
        return _into(out, {k: torch.index_select(c, 0, picked) for k, c in columns.items()})
    caller = torch.cuda.current_stream(device)
    side = _side_stream(device)
    with torch.cuda.stream(side):
        picked = torch.from_numpy(index).to(device, non_blocking=True)
        result = {key: torch.index_select(column, 0, picked) for key, column in columns.items()}
        if out is not None:
            return _into(out, result)  # synchronous copies to the host
    side.synchronize()
    for tensor in result.values():
        tensor.record_stream(caller)
    return result


def _into(
    out: Mapping[Key, np.ndarray] | None, result: dict[Key, torch.Tensor]
) -> dict[Key, torch.Tensor]:
    if out is None:
        return result
    copied = {}
    for key, got in result.items():
        host = torch.from_numpy(out[key][: len(got)])
        if got.dtype == torch.bfloat16:
            host = host.view(torch.bfloat16)
        copied[key] = host.copy_(got)
    return copied


def _rows_of(value: Any, offset: int, n: int) -> torch.Tensor | np.ndarray:
    """Rows ``offset:offset + n`` of a validated leaf (a tensor on any device, or an array)."""
    if isinstance(value, torch.Tensor):
        part = value.detach()[offset : offset + n]
        # host tensors through numpy: its copy into the slot runs at memcpy speed
        return part.numpy() if part.device.type == "cpu" and part.dtype != torch.bfloat16 else part
    array: np.ndarray = np.asarray(value)[offset : offset + n]
    return array


class DeviceWriter:
    """Copies validated rows into device columns (a Writer's copy into a CUDA segment).

    ``write`` takes what :func:`rows.write` takes and keeps its rules: every range filled in
    order, every key per range, ``progress.rows`` set before a range may change, casts already
    decided by validation. Staging slots are pinned host memory, made at the first host row
    (a writer whose rows are all on the GPU never allocates one).
    """

    def __init__(self, device: str | torch.device, slot_bytes: int = SLOT_BYTES) -> None:
        self.device = torch.device(device)
        self.slot_bytes = slot_bytes
        self._cuda = self.device.type == "cuda"
        self._slots: list[torch.Tensor] = []
        self._done: list[Any] = []  # an event per slot, recorded after its last copy
        self._slot = 0
        self._used = 0

    def write(
        self,
        columns: Mapping[Key, torch.Tensor],
        arrays: Mapping[Key, np.ndarray],
        ranges: Sequence[tuple[int, int]],
        leaves: Mapping[Key, Any],
        first_row: int = 0,
        progress: Progress | None = None,
    ) -> None:
        """Copy rows ``first_row:`` of each leaf into the physical ``ranges``, in order, and
        return once every copy is complete. ``arrays`` is unused (device columns have none)."""
        side = _side_stream(self.device) if self._cuda else None
        try:
            if side is not None:  # GPU rows may still be being made on the caller's stream
                side.wait_stream(torch.cuda.current_stream(self.device))  # (before we switch)
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                offset = first_row
                for start, stop in ranges:
                    n = stop - start
                    # Every source slice first: one that cannot be read fails before a byte
                    # of the range (as rows.write).
                    copies = [
                        (columns[key][start:stop], _rows_of(value, offset, n))
                        for key, value in leaves.items()
                    ]
                    if progress is not None:  # from here rows of this range may change
                        progress.rows = offset - first_row + n
                    for dst, src in copies:
                        self._copy(dst, src, side)
                    offset += n
            self._finish(side)
        except BaseException:
            if side is not None:  # no copy of this write may land after its abort
                with contextlib.suppress(Exception):
                    side.synchronize()
            raise

    def _copy(self, dst: torch.Tensor, src: torch.Tensor | np.ndarray, side: Any) -> None:
        n = len(dst)
        if isinstance(src, torch.Tensor) and src.device.type != "cpu":
            if side is not None and src.device != self.device:
                side.wait_stream(torch.cuda.current_stream(src.device))
            dst.copy_(src, non_blocking=True)  # device -> device
            return
        row_bytes = dst[0].numel() * dst.element_size() if n else 0
        per_chunk = max(1, self.slot_bytes // max(1, row_bytes))
        for first in range(0, n, per_chunk):
            k = min(per_chunk, n - first)
            staged = self._stage(k * row_bytes, side).view(dst.dtype).view(k, *dst.shape[1:])
            part = src[first : first + k]
            if isinstance(part, np.ndarray) and dst.dtype != torch.bfloat16:
                np.copyto(staged.numpy(), part, casting="unsafe")  # validated: a plain memcpy
            else:
                staged.copy_(torch.as_tensor(part).detach())
            dst[first : first + k].copy_(staged, non_blocking=True)

    def _stage(self, nbytes: int, side: Any) -> torch.Tensor:
        """``nbytes`` of a staging slot no copy still reads (the next slot once this one is
        full, after waiting for its copies), grown for a row larger than a slot."""
        if nbytes > self.slot_bytes or not self._slots:
            self._grow(max(nbytes, self.slot_bytes), side)
        if self._used + nbytes > self.slot_bytes:
            self._record(side)
            self._slot = (self._slot + 1) % len(self._slots)
            done = self._done[self._slot]
            if done is not None:
                done.synchronize()
            self._used = 0
        view = self._slots[self._slot][self._used : self._used + nbytes]
        self._used += -(-nbytes // _ALIGN) * _ALIGN
        return view

    def _grow(self, slot_bytes: int, side: Any) -> None:
        if side is not None:
            side.synchronize()  # nothing reads the old slots any more
        self.slot_bytes = slot_bytes
        pin = self._cuda
        self._slots = [
            torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(SLOTS)
        ]
        self._done = [None] * SLOTS
        self._slot = self._used = 0

    def _record(self, side: Any) -> None:
        if side is not None:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(side)
            self._done[self._slot] = event

    def _finish(self, side: Any) -> None:
        """Wait until every copy of this write is complete (the staging slots are then free)."""
        if side is not None:
            # The whole side stream, not a slot's event: a write of GPU rows alone never made
            # a slot (nor a list of events to record one in).
            side.synchronize()
            self._done = [None] * len(self._done)
        self._used = 0
