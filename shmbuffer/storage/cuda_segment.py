"""Rows in GPU memory: a named segment whose columns are one CUDA allocation, shared by IPC.

The host half is a segment folder like any other (:mod:`shmbuffer.storage.segment`):
``manifest.json``, written last, and a ``data.bin`` that holds only the int64 generation stamps, so
the daemon and
readers compare stamps without a device sync. The columns are carved out of one
``torch.zeros(nbytes, uint8, device=...)`` at the offsets a CPU segment would give them; the
daemon exports that storage once (``UntypedStorage._share_cuda_``) and writes the description
into the manifest; a client opens it once, at attach (``UntypedStorage._new_shared_cuda``, the
call ``torch.multiprocessing.reductions.rebuild_cuda_tensor`` makes), with the storage offset
the export recorded. Clients learn nothing new from the wire protocol: the manifest says where
the rows live, as it says where a CPU segment's columns are.

PyTorch's CUDA IPC pitfalls and what this module does about each (``docs/cuda.md``):

* the exporter must keep the memory alive while importers use it: the daemon holds the one
  allocation for its whole life and frees it only when it exits; a view kept after that is
  dangling, so readers must not outlive their daemon (their next request fails anyway);
* one CUDA context per process (about 0.5 GB of device memory each) and no ``fork`` after
  CUDA is initialised: every process that attaches pays one context; env workers that should
  not can write with ``remote=True`` (the daemon copies their rows in);
* a handle may be opened once per process: torch caches what it opened by handle, so a Reader
  and a Writer in one process share one mapping; the exporting process cannot open its own;
* the caching allocator hands out blocks inside larger ``cudaMalloc`` segments and an IPC
  handle names the segment, not the block: the export's storage offset is recorded and
  applied, and the whole buffer is one block, so one handle covers every column;
* ``expandable_segments`` allocations share through file descriptors (``pidfd_getfd``) with
  open PyTorch bugs (#179220, #190860): the daemon turns it off before it allocates;
* importers' references: torch counts them in one shared-memory counter per export, which
  N importers of one export decrement N times; harmless here (the daemon never frees early),
  but torch may report at the daemon's exit that "producer process has been terminated before
  all shared CUDA tensors released".

``--pin-memory`` (a CPU buffer) is here too: page-locking is per process and per mapping, so
each reader registers its own mapping of the segment with ``cudaHostRegister`` at attach
(:class:`PinnedSegment`), as ``torch/cuda/_pin_memory_utils.py`` does for shared memory.

torch.cuda is touched only by these classes and functions, never at import.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

import numpy as np
import torch

from shmbuffer.errors import OutOfSpaceError, PermissionDeniedError, SchemaError, SegmentError
from shmbuffer.storage.schema import Field, Key, Schema, key_str
from shmbuffer.storage.segment import (
    ALIGN,
    MANIFEST,
    Nested,
    Segment,
    _free_bytes,
    _layout,
    _prefault,
    _views,
    check_capacity,
    check_fits,
    map_data,
    read_manifest,
    segment_path,
)

log = logging.getLogger("shmbuffer")

#: ``cudaHostRegisterPortable``: pinned for every CUDA context of the process.
_HOST_REGISTER_PORTABLE = 1
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


# -- devices ------------------------------------------------------------------------------


def normalize_device(text: Any) -> str:
    """``"cpu"`` or ``"cuda:N"`` for a device string (``cuda`` is ``cuda:0``); ValueError for
    anything else. Asks nothing of the driver."""
    if not isinstance(text, str):
        raise ValueError(f"device must be a string (cpu, cuda or cuda:N), got {text!r}")
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"device {text!r}: expected cpu, cuda or cuda:N") from None
    if device.type == "cpu" and not device.index:
        return "cpu"
    if device.type == "cuda":
        return f"cuda:{device.index or 0}"
    raise ValueError(f"device {text!r}: expected cpu, cuda or cuda:N")


def cuda_problem(device: str | None = None) -> str | None:
    """Why this process cannot use CUDA (or the GPU ``device`` names), in the words of what
    torch reports; None when it can. Initialises the driver (``cuInit``), not a context."""
    build = f"torch {torch.__version__}"
    if torch.version.cuda is None:
        return f"{build} is built without CUDA"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = "" if visible is None else f", CUDA_VISIBLE_DEVICES={visible!r}"
    count = torch.cuda.device_count()
    if count == 0:
        return (
            f"{build} (CUDA {torch.version.cuda}) finds no GPU (no driver, or none visible{shown})"
        )
    index = torch.device(device).index if device is not None else None
    if index is not None and index >= count:
        last = f"..cuda:{count - 1}" if count > 1 else ""
        plural = "s" if count > 1 else ""
        return f"{build} sees {count} GPU{plural} (cuda:0{last}{shown}), not {device}"
    return None


def gpu_uuid(index: int) -> str:
    """The GPU's UUID: the same physical device in every process, whatever its index there
    (``CUDA_VISIBLE_DEVICES`` renumbers them)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def local_index(uuid: str) -> int | None:
    """This process's index of the GPU with ``uuid`` (None: not visible here)."""
    for index in range(torch.cuda.device_count()):
        if gpu_uuid(index) == uuid:
            return index
    return None


def boot_id() -> str:
    """This machine's boot id: shared by every container on one kernel, so two different ones
    mean two machines (or VMs), between which CUDA IPC is impossible."""
    try:
        with open(_BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


# -- layout and room ----------------------------------------------------------------------


def cuda_layout(schema: Schema, capacity: int) -> dict[str, Any]:
    """Where everything of a CUDA segment lives: ``columns`` in the device buffer at the
    offsets of a CPU segment (``device_size`` bytes, 4096-aligned), ``generations`` at offset 0
    of the host file of ``size`` bytes."""
    columns = _layout(schema, capacity)["columns"]
    end = max((c["offset"] + c["nbytes"] for c in columns.values()), default=0)
    stamps = capacity * 8
    return {
        "columns": columns,
        "generations": {"offset": 0, "nbytes": stamps},
        "size": -(-stamps // ALIGN) * ALIGN,
        "device_size": max(ALIGN, -(-end // ALIGN) * ALIGN),
    }


def check_device_memory(name: str, needed: int, device: str, free: int | None = None) -> None:
    """OutOfSpaceError naming the needed and the free bytes when ``device`` cannot hold
    ``needed``; ``free``: the free bytes (None: ask the driver, ``cudaMemGetInfo``)."""
    if free is None:
        free, _total = torch.cuda.mem_get_info(torch.device(device))
    if needed > free:
        raise OutOfSpaceError(
            f"buffer {name!r} needs {needed:,} bytes on {device} but only {free:,} bytes are "
            "free there; lower --capacity, or free the GPU"
        )


def check_room(
    device: str, name: str, schema: Schema, capacity: int, storage_dir: str | Path | None
) -> None:
    """Refuse a buffer its device cannot hold before anything is allocated (the daemon's
    check at start; a CUDA segment's stamps need room on the storage folder too)."""
    if device == "cpu":
        check_fits(name, schema, capacity, storage_dir)
        return
    check_capacity(capacity)
    layout = cuda_layout(schema, capacity)
    path = segment_path(name, storage_dir)
    free = _free_bytes(path)
    if layout["size"] + ALIGN > free:
        raise OutOfSpaceError(
            f"buffer {name!r} needs {layout['size'] + ALIGN:,} bytes for its stamps but "
            f"{path.parent} has only {free:,} bytes free"
        )
    check_device_memory(name, layout["device_size"], device)


def create_segment(
    device: str, name: str, schema: Schema, capacity: int, **options: Any
) -> Segment:
    """A new segment of ``name`` on ``device`` (``cpu``: :meth:`Segment.create`; else a
    :class:`CudaSegment`); ``options`` as :meth:`Segment.create` takes them."""
    if device == "cpu":
        return Segment.create(name, schema, capacity, **options)
    return CudaSegment.create(name, schema, capacity, device=device, **options)


def attach_segment(
    name: str, storage_dir: str | Path | None = None, *, pin: bool = False
) -> Segment:
    """Attach segment ``name`` wherever its rows live: a :class:`CudaSegment` when its
    manifest names a device, else a host :class:`Segment`, page-locked for this process with
    ``pin`` when the daemon was started with ``--pin-memory`` and CUDA is usable here (else
    left pageable, and said so in the log). How a Reader or Writer maps its daemon's rows: a
    segment another user owns is refused saying how such a client still gets them."""
    try:
        return _attach_segment(name, storage_dir, pin)
    except PermissionDeniedError as exc:
        raise PermissionDeniedError(
            f"{exc}. A Reader or Writer of another user's daemon (one any local user may "
            "reach: loopback tcp) passes remote=True: its rows then travel over the socket"
        ) from None


def _attach_segment(name: str, storage_dir: str | Path | None, pin: bool) -> Segment:
    path, manifest = read_manifest(name, storage_dir)
    if "device" in manifest:
        return CudaSegment.open(name, path, manifest)
    extra = manifest.get("extra") or {}
    if pin and isinstance(extra, dict) and extra.get("pin_memory"):
        problem = cuda_problem()
        if problem is None:
            segment = PinnedSegment.attach(name, storage_dir=storage_dir)
            segment.pin()
            return segment
        log.info("segment %r is --pin-memory, but this process cannot use CUDA: %s", name, problem)
    return Segment.attach(name, storage_dir=storage_dir)


# -- the device buffer --------------------------------------------------------------------


def device_views(
    schema: Schema, capacity: int, columns: Mapping[str, Any], buffer: torch.Tensor
) -> tuple[Nested, dict[Key, torch.Tensor]]:
    """The columns as views of the uint8 ``buffer`` at the layout's ``columns`` offsets (any
    device: the CPU tests carve a host buffer the same way)."""

    def carve(field: Field, shape: tuple[int, ...], numel: int) -> torch.Tensor:
        if numel == 0:
            return torch.empty(shape, dtype=field.dtype, device=buffer.device)
        region = columns[key_str(field.key)]
        start = int(region["offset"])
        raw = buffer[start : start + int(region["nbytes"])]
        return raw.view(field.dtype).view(shape)

    nested, flat, _ = _views(schema, capacity, carve, host=False)
    return nested, flat


def _no_expandable_segments() -> None:
    """Expandable segments share by file descriptor, with open bugs: allocate without them."""
    # torch 2.11 moved the setter (the old name warns); older torch has only the old one
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    try:
        setter("expandable_segments:False")
    except (AttributeError, RuntimeError) as exc:  # older or newer torch: keep its default
        log.debug("could not turn expandable segments off: %s", exc)


def _allocate(name: str, device: str, nbytes: int) -> torch.Tensor:
    _no_expandable_segments()
    try:
        buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError as exc:
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        raise OutOfSpaceError(
            f"buffer {name!r} needs {nbytes:,} bytes on {device} but only {free:,} bytes are "
            f"free there ({str(exc).splitlines()[0]}); lower --capacity, or free the GPU"
        ) from None
    torch.cuda.synchronize(device)  # zeroed before anyone can open it
    return buffer


def _export(buffer: torch.Tensor) -> dict[str, Any]:
    """The IPC description of ``buffer``'s storage, as JSON (bytes as hex)."""
    shared = buffer.untyped_storage()._share_cuda_()  # type: ignore[no-untyped-call]
    _device, handle, size, offset, counter, counter_offset, event, event_sync = shared
    return {
        "handle": bytes(handle).hex(),
        "size": int(size),
        "offset": int(offset),  # of the storage inside the cudaMalloc block the handle names
        "ref_counter": bytes(counter).hex(),
        "ref_counter_offset": int(counter_offset),
        "event": bytes(event).hex(),
        "event_sync": bool(event_sync),
        "device_ptr": int(buffer.data_ptr()),  # in the daemon's address space (diagnostics)
    }


def _import(name: str, ipc: Mapping[str, Any], index: int, device: str) -> torch.Tensor:
    """The exported storage opened in this process, as a uint8 tensor on GPU ``index``."""
    try:
        args = (
            index,
            bytes.fromhex(ipc["handle"]),
            int(ipc["size"]),
            int(ipc["offset"]),
            bytes.fromhex(ipc["ref_counter"]),
            int(ipc["ref_counter_offset"]),
            bytes.fromhex(ipc["event"]),
            bool(ipc["event_sync"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise SegmentError(f"segment {name!r}: malformed IPC description: {exc}") from None
    try:
        torch.cuda.init()  # type: ignore[no-untyped-call]
        storage = torch.UntypedStorage._new_shared_cuda(*args)
    except RuntimeError as exc:
        raise SegmentError(
            f"segment {name!r}: CUDA IPC impossible: opening the handle of its {device} "
            f"memory failed ({str(exc).splitlines()[0]}); the daemon and this process must "
            "run on one machine, see the same GPU and share an IPC namespace (containers: "
            "--ipc=host)"
        ) from None
    return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index)).set_(storage)


class CudaSegment(Segment):
    """A named segment whose columns live on a GPU (see the module docstring).

    The daemon makes one with :meth:`create`; clients open it with :meth:`attach` (or
    :func:`attach_segment`). ``columns`` and ``data`` are device tensors, ``arrays`` is empty
    (numpy cannot see device memory), ``generations`` are host stamps, ``buffer`` the whole
    allocation, ``device`` this process's name for the GPU.
    """

    buffer: torch.Tensor

    def __init__(self, path: Path, manifest: dict[str, Any], mm: Any, buffer: torch.Tensor) -> None:
        # Not Segment.__init__: the columns are views of ``buffer``; ``mm`` holds the stamps.
        self.name = manifest["name"]
        self.path = path
        self.manifest = manifest
        self.schema = Schema.from_spec(manifest["schema"])
        self.capacity = manifest["capacity"]
        self._nbytes = int(manifest["device_size"])
        self.device = str(buffer.device)
        self.buffer = buffer
        _prefault(mm, int(manifest["size"]))
        self._nested, self.columns = device_views(
            self.schema, self.capacity, manifest["columns"], buffer
        )
        self.arrays = {}
        offset = int(manifest["generations"]["offset"])
        self.generations = np.frombuffer(mm, np.int64, count=self.capacity, offset=offset)

    @classmethod
    def create(
        cls,
        name: str,
        schema: Schema,
        capacity: int,
        *,
        device: str = "cuda",
        storage_dir: str | Path | None = None,
        file_mode: int = 0o600,
        group: int | None = None,
        extra: Mapping[str, Any] | None = None,
        prefault: bool = True,
        exist_ok: bool = False,
    ) -> Self:
        """Allocate the buffer on ``device`` and export it (the daemon's side). SegmentError
        when this process cannot use that GPU, OutOfSpaceError (needed and free bytes named)
        when it cannot hold the buffer."""
        check_capacity(capacity)
        device = normalize_device(device)
        problem = "it is not a GPU" if device == "cpu" else cuda_problem(device)
        if problem is not None:
            raise SegmentError(f"segment {name!r} cannot live on {device}: {problem}")
        layout = cuda_layout(schema, capacity)
        check_device_memory(name, layout["device_size"], device)
        index = torch.device(device).index
        assert index is not None
        fields = {**layout, "device": device, "device_uuid": gpu_uuid(index), "boot_id": boot_id()}

        return cls._create(
            name,
            schema,
            capacity,
            fields,
            cls._allocated,
            storage_dir=storage_dir,
            file_mode=file_mode,
            group=group,
            extra=extra,
            exist_ok=exist_ok,
        )

    @classmethod
    def _allocated(cls, path: Path, manifest: dict[str, Any], mm: Any) -> Self:
        """The segment over a fresh, exported device buffer (its description added to the
        manifest, which is written after this returns)."""
        buffer = _allocate(manifest["name"], manifest["device"], int(manifest["device_size"]))
        manifest["ipc"] = _export(buffer)
        return cls(path, manifest, mm, buffer)

    @classmethod
    def attach(
        cls, name: str, *, storage_dir: str | Path | None = None, prefault: bool = True
    ) -> Self:
        path, manifest = read_manifest(name, storage_dir)
        return cls.open(name, path, manifest)

    @classmethod
    def open(cls, name: str, path: Path, manifest: dict[str, Any]) -> Self:
        """Open the segment a manifest read by :func:`read_manifest` describes, checking
        first, in this order, that it is a device segment of a sound layout, that IPC can
        work (same machine, another process), that CUDA works here and that this process
        sees its GPU; each failure is a SegmentError saying which."""
        device = manifest.get("device")
        where = path / MANIFEST
        if not isinstance(device, str):
            raise SegmentError(f"segment {name!r} at {path} keeps its rows in host memory")
        try:
            schema = Schema.from_spec(manifest["schema"])
            layout = cuda_layout(schema, manifest["capacity"])
            ok = all(manifest[k] == v for k, v in layout.items()) and manifest["name"] == name
            ipc, uuid = manifest["ipc"], str(manifest["device_uuid"])
        except (KeyError, TypeError, SchemaError) as exc:
            raise SegmentError(f"segment {name!r}: malformed manifest {where}: {exc}") from None
        if not ok or not isinstance(ipc, dict):
            raise SegmentError(f"segment {name!r}: manifest {where} is inconsistent")
        host = manifest.get("host", "?")
        if manifest.get("boot_id") != boot_id():
            raise SegmentError(
                f"segment {name!r}: CUDA IPC impossible: its daemon (pid {manifest.get('pid')}) "
                f"runs on another machine ({host}; this is {socket.gethostname()}); connect "
                "with remote=True to have rows sent over the socket"
            )
        if manifest.get("pid") == os.getpid() and host == socket.gethostname():
            raise SegmentError(
                f"segment {name!r}: CUDA IPC impossible: this process (pid {os.getpid()}) "
                "made it, and CUDA cannot open a process's own IPC handle; use the "
                "CudaSegment it created"
            )
        problem = cuda_problem()
        if problem is not None:
            raise SegmentError(
                f"segment {name!r} keeps its rows on {device} (CUDA IPC), but this process "
                f"cannot use CUDA: {problem}. Run it where torch sees that GPU, or connect "
                "with remote=True (rows travel over the socket; the daemon copies them)"
            )
        index = local_index(uuid)
        if index is None:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise SegmentError(
                f"segment {name!r}: CUDA IPC impossible: its GPU ({device} in the daemon, uuid "
                f"{uuid}) is not among the {torch.cuda.device_count()} GPUs this process sees"
                f"{'' if visible is None else f' (CUDA_VISIBLE_DEVICES={visible!r})'}"
            )
        mm = map_data(name, path, manifest)
        buffer = _import(name, ipc, index, device)
        if buffer.numel() != layout["device_size"]:
            raise SegmentError(
                f"segment {name!r}: the shared allocation holds {buffer.numel():,} bytes, the "
                f"layout {layout['device_size']:,}"
            )
        return cls(path, manifest, mm, buffer)

    def settle(self) -> None:
        """Wait for the device's current stream: a kernel still queued on views of the rows
        must have read them before a lease on them goes (work on other streams is the
        caller's to finish)."""
        if self.buffer.is_cuda:
            torch.cuda.current_stream(self.buffer.device).synchronize()

    def close(self) -> None:
        super().close()
        # the last reference closes this process's mapping (the daemon's: frees the memory)
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def __repr__(self) -> str:
        return (
            f"CudaSegment({self.name!r}, capacity={self.capacity}, {self.schema}, "
            f"device={self.device}, path={self.path})"
        )


# -- pinned host segments ------------------------------------------------------------------


def pin_host(address: int, nbytes: int) -> None:
    """Page-lock ``nbytes`` of this process's memory at ``address`` for the GPU (as
    ``torch/cuda/_pin_memory_utils.py``); SegmentError with CUDA's error code if refused."""
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    code = int(cudart.cudaHostRegister(address, nbytes, _HOST_REGISTER_PORTABLE))
    if code != 0:
        raise SegmentError(f"cudaHostRegister of {nbytes:,} bytes failed: cudaError {code}")


def unpin_host(address: int) -> None:
    code = int(torch.cuda.cudart().cudaHostUnregister(address))  # type: ignore[no-untyped-call]
    if code != 0:
        log.warning("cudaHostUnregister failed: cudaError %d", code)


class PinnedSegment(Segment):
    """A host segment this process page-locked (a ``--pin-memory`` daemon's, in a reader):
    ``view.to("cuda", non_blocking=True)`` of its rows is then a DMA at full bus speed.
    Registration belongs to the process and the mapping, so each process registers its own,
    and unregisters it at :meth:`close` (before the mapping can go)."""

    _pinned_at: int | None = None

    def pin(self) -> bool:
        """Register the mapping; False (logged) where the driver refuses, the segment then
        staying pageable: a slower copy, never a failed read."""
        if self._pinned_at is not None:
            return True
        address = self.generations.ctypes.data - int(self.manifest["generations"]["offset"])
        try:
            pin_host(address, self._nbytes)
        except SegmentError as exc:
            log.warning("segment %r stays pageable here: %s", self.name, exc)
            return False
        self._pinned_at = address
        return True

    @property
    def pinned(self) -> bool:
        return self._pinned_at is not None

    def close(self) -> None:
        if self._pinned_at is not None:
            unpin_host(self._pinned_at)
            self._pinned_at = None
        super().close()
