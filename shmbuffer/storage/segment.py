"""Rows in named shared memory: one data file on tmpfs plus ``manifest.json``.

Layout of ``<storage_dir>/<name>/``: ``data.bin`` holds every column back to back, each at a
4096-aligned offset, sized and reserved with ``posix_fallocate`` (a full tmpfs then fails at
creation with :class:`OutOfSpaceError`, not later with SIGBUS). ``manifest.json`` is written last,
atomically, so an attacher never sees a half-made segment. Any process that knows the name maps
the same file (``MAP_SHARED``) and sees the same memory.

Creation costs per page, not per byte: kernel time per 4 KiB page to reserve it
(``posix_fallocate``) and as much to map it (``MADV_POPULATE_WRITE``); zeroing is cheap next to
that (figures in ``docs/architecture.md``). A tmpfs mounted with ``huge=within_size`` gives
named segments 2 MiB pages, far cheaper. Populating from several threads was slower there (the
faults contend in the kernel), so each mapping is populated by one ``madvise`` call, made through
ctypes so that it releases the GIL.

Lifetime of a mapping: ``torch.frombuffer`` keeps a reference to the ``mmap`` object but holds no
buffer export, so ``mmap.close()`` would succeed and leave every live view dangling (a segfault on
the next access). We therefore never call it: :meth:`Segment.close` drops our references, and the
kernel mapping goes away when the last tensor/array view is garbage-collected.

numpy has no bfloat16: ``arrays`` exposes such columns as ``uint16`` views of the raw bits.
After the columns, ``generations`` holds one int64 stamp per row (outside the schema) that
the daemon bumps on overwrite so readers can detect torn copies.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import mmap
import os
import shutil
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import numpy as np
import torch

if TYPE_CHECKING:
    from tensordict import TensorDict

from shmbuffer.errors import (
    OutOfSpaceError,
    PermissionDeniedError,
    SchemaError,
    SegmentError,
    SegmentNotFoundError,
)
from shmbuffer.names import validate_name
from shmbuffer.runtime import access_refusal, check_private_dir
from shmbuffer.storage import pages
from shmbuffer.storage.schema import Field, Key, Schema, key_str

FORMAT_VERSION = 1
#: Columns as a tree of dicts keyed by the parts of their keys (what a TensorDict is made of).
Nested = dict[str, Any]
ALIGN = 4096
DATA_FILE = "data.bin"
MANIFEST = "manifest.json"
ENV_STORAGE_DIR = "SHMBUFFER_STORAGE_DIR"
_PAGE = mmap.PAGESIZE


def check_fits(
    name: str, schema: Schema, capacity: int, storage_dir: str | Path | None = None
) -> None:
    """Refuse a buffer its file system cannot hold before anything is allocated (``create``
    checks again, exactly, and reserves the pages)."""
    path = segment_path(name, storage_dir)
    needed = capacity * (schema.row_nbytes + 8)  # rows + one generation stamp each
    free = _free_bytes(path)
    if needed > free:
        raise OutOfSpaceError(
            f"buffer {name!r} needs {needed:,} bytes ({capacity:,} rows x "
            f"{schema.row_nbytes + 8} bytes) but {path.parent} has only {free:,} bytes free; "
            "lower --capacity or use a larger --storage-dir"
        )


def default_storage_dir() -> Path:
    """``$SHMBUFFER_STORAGE_DIR``, else ``/dev/shm/shmbuffer-<uid>``: per user, like the
    runtime folder, so the first user's owner-only root never locks the others out."""
    return Path(os.environ.get(ENV_STORAGE_DIR) or f"/dev/shm/shmbuffer-{os.getuid()}")


def _check_default_root(storage_dir: str | Path | None) -> None:
    """The default root sits in world-writable /dev/shm, where anyone could have made it
    first: refuse one that is not ours or that others may write (they could swap our segment
    folders). A root named explicitly is the caller's choice and is not checked."""
    if storage_dir is None and not os.environ.get(ENV_STORAGE_DIR):
        root = default_storage_dir()
        if root.exists():
            hint = f" (or pass --storage-dir / set ${ENV_STORAGE_DIR})"
            check_private_dir(root, "storage folder", hint=hint)


def _open_root_to_group(root: Path, group: int) -> None:
    """A private root of ours (the per-user default, made by a daemon without ``--group``)
    becomes traversable by ``group``, whose members map this segment; a root that is not ours,
    or already open to someone, is left as it is (it must let the group in already)."""
    st = os.stat(root)
    if st.st_uid == os.getuid() and not st.st_mode & 0o077:
        os.chown(root, -1, group)
        os.chmod(root, (st.st_mode & 0o777) | 0o050)


def segment_path(name: str, storage_dir: str | Path | None = None) -> Path:
    root = Path(storage_dir) if storage_dir is not None else default_storage_dir()
    return root / validate_name(name)


def _layout(schema: Schema, capacity: int) -> dict[str, Any]:
    """Where everything lives: ``columns`` (dotted key -> {offset, nbytes}), ``generations``
    (one int64 stamp per row, for torn-read checks) and the total ``size``; 4096-aligned."""
    regions, end = [], 0
    for nbytes in [capacity * f.row_nbytes for f in schema] + [capacity * 8]:
        offset = -(-end // ALIGN) * ALIGN
        regions.append({"offset": offset, "nbytes": nbytes})
        end = offset + nbytes
    columns = {key_str(f.key): r for f, r in zip(schema, regions[:-1], strict=True)}
    return {"columns": columns, "generations": regions[-1], "size": -(-end // ALIGN) * ALIGN}


def _views(
    schema: Schema,
    capacity: int,
    make: Callable[[Field, tuple[int, ...], int], torch.Tensor],
    host: bool = True,
) -> tuple[Nested, dict[Key, torch.Tensor], dict[Key, np.ndarray]]:
    """One tensor per field from ``make(field, shape, numel)``, as a nested dict (the tree a
    TensorDict is built from) and flat dicts (no numpy views unless ``host``: device memory has
    none)."""
    columns: dict[Key, torch.Tensor] = {}
    arrays: dict[Key, np.ndarray] = {}
    nested: Nested = {}
    for given in schema:
        field = given.stored  # a compressed column's rows hold chunk references
        shape = (capacity, *field.shape)
        t = make(field, shape, int(np.prod(shape, dtype=np.int64)))
        columns[field.key] = t
        if host:
            # numpy has no bfloat16: expose the raw bits as uint16 (np.copyto still works on them)
            raw = t.view(torch.uint16) if field.dtype == torch.bfloat16 else t
            arrays[field.key] = raw.numpy()
        node = nested
        for part in field.key[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise SchemaError(f"key {key_str(field.key)!r} nests under a leaf column")
        if field.key[-1] in node:
            raise SchemaError(f"key {key_str(field.key)!r} is both a leaf and a group")
        node[field.key[-1]] = t
    return nested, columns, arrays


def _free_bytes(path: Path) -> int:
    """Free bytes on the file system that ``path`` will live on (nearest existing ancestor)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize


def _make_dir(path: Path, mode: int, group: int | None) -> None:
    os.mkdir(path, mode)
    os.chmod(path, mode)  # exact mode, whatever the umask
    if group is not None:
        os.chown(path, -1, group)


def _open_new(path: Path, file_mode: int, group: int | None) -> int:
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = os.open(path, flags, file_mode)
    os.fchmod(fd, file_mode)
    if group is not None:
        os.fchown(fd, -1, group)
    return fd


def _address(mm: mmap.mmap) -> int:
    """Where ``mm`` starts (the buffer export is dropped before this returns)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


def _prefault(mm: mmap.mmap, size: int) -> None:
    """Populate the page tables now so the first write runs at full speed (no-op if unsupported:
    the pages of a named segment are reserved by ``posix_fallocate`` already)."""
    with contextlib.suppress(OSError, ValueError):
        pages.populate(_address(mm), size)


def _mapped_views(
    schema: Schema, capacity: int, layout: Mapping[str, Any], mm: mmap.mmap
) -> tuple[Nested, dict[Key, torch.Tensor], dict[Key, np.ndarray], np.ndarray]:
    """The columns and generation stamps of ``layout`` (see :func:`_layout`) as views of ``mm``."""
    offsets = {k: c["offset"] for k, c in layout["columns"].items()}

    def view(field: Field, shape: tuple[int, ...], numel: int) -> torch.Tensor:
        if numel == 0:  # frombuffer refuses count=0; an empty column needs no memory
            return torch.empty(shape, dtype=field.dtype)
        offset = offsets[key_str(field.key)]
        return torch.frombuffer(mm, dtype=field.dtype, count=numel, offset=offset).view(shape)

    nested, columns, arrays = _views(schema, capacity, view)
    gen = layout["generations"]["offset"]
    return nested, columns, arrays, np.frombuffer(mm, np.int64, count=capacity, offset=gen)


def _available_memory() -> int | None:
    """MemAvailable + SwapFree from /proc/meminfo, in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            info = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)}
        return info["MemAvailable"] + info.get("SwapFree", 0)
    except (OSError, KeyError, ValueError):
        return None


def check_capacity(capacity: object) -> None:
    if not isinstance(capacity, int) or capacity < 1:
        raise SegmentError(f"capacity must be a positive int, got {capacity!r}")


def read_manifest(name: str, storage_dir: str | Path | None = None) -> tuple[Path, dict[str, Any]]:
    """The folder and manifest of segment ``name``, checked for what every kind shares (its
    format version, a schema and a data file name); a segment still being made, or whose maker
    died, has no manifest yet."""
    path = segment_path(name, storage_dir)
    _check_default_root(storage_dir)
    try:
        found = path.is_dir()
    except PermissionError:
        raise _not_yours(name, path, os.R_OK | os.X_OK) from None
    if not found:
        raise SegmentNotFoundError(f"no segment {name!r} at {path}")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except PermissionError:
        raise _not_yours(name, path / MANIFEST, os.R_OK) from None
    except FileNotFoundError:
        raise SegmentError(
            f"segment {name!r} at {path} has no {MANIFEST}: still being created, or its "
            "creator died (unlink it)"
        ) from None
    except (OSError, ValueError) as e:
        raise SegmentError(f"segment {name!r}: unreadable manifest {path / MANIFEST}: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise SegmentError(
            f"segment {name!r} at {path}: format_version {version!r}, this code reads "
            f"{FORMAT_VERSION}"
        )
    return path, manifest


def map_data(name: str, path: Path, manifest: Mapping[str, Any]) -> mmap.mmap:
    """``manifest["size"]`` bytes of the segment's data file, mapped shared (its layout
    checked by the caller first)."""
    try:
        size = int(manifest["size"])
        data = path / validate_name(manifest["data_file"])
    except (KeyError, TypeError, ValueError) as e:
        raise SegmentError(f"segment {name!r}: malformed manifest {path / MANIFEST}: {e}") from e
    try:
        fd = os.open(data, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            if os.fstat(fd).st_size < size:  # a short file would SIGBUS on access
                raise SegmentError(f"segment {name!r}: {data} is shorter than {size} bytes")
            return mmap.mmap(fd, size, mmap.MAP_SHARED)
        finally:
            os.close(fd)
    except PermissionError:
        raise _not_yours(name, data, os.R_OK | os.W_OK) from None
    except OSError as e:
        raise SegmentError(f"segment {name!r}: cannot map {data}: {e}") from e


def _not_yours(name: str, path: Path, need: int) -> PermissionDeniedError:
    """A segment this process may not map, and whose permissions say so."""
    why = access_refusal(path, need) or f"{path}: permission denied"
    return PermissionDeniedError(
        f"segment {name!r} is another user's to map: {why}; only its owner, or members of "
        "the group its daemon was started with (--group), may map it"
    )


class _Columns:
    """What :class:`Segment` and :class:`LocalSegment` share: the views and their lifetime."""

    schema: Schema
    capacity: int
    _nested: Nested  # the columns as a tree of dicts, nested keys as in the schema
    _data: TensorDict | None = None
    columns: dict[Key, torch.Tensor]  # the same tensors, flat (no TensorDict overhead)
    arrays: dict[Key, np.ndarray]  # the same memory for np.copyto; bfloat16 as uint16 bits
    generations: np.ndarray  # int64 [capacity]: a stamp per row, bumped on overwrite
    _nbytes: int
    #: Where the columns live: "cpu", or "cuda:N" for a
    #: :class:`~shmbuffer.storage.cuda_segment.CudaSegment` (whose ``arrays`` is empty: numpy
    #: cannot see device memory). Stamps are always on the host.
    device: str = "cpu"

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def data(self) -> TensorDict:
        """The columns as one TensorDict of batch size ``[capacity]``, made on first use:
        importing tensordict costs a process seconds of CPU (it loads torch._dynamo),
        which the daemon and the command line, working on ``columns`` and ``arrays``, never need."""
        if self._data is None:
            from tensordict import TensorDict

            self._data = TensorDict(self._nested, batch_size=[self.capacity])
        return self._data

    def settle(self) -> None:
        """Wait until the work this process queued on the columns has run: before a lease on
        views of them goes, a GPU kernel still reading them must be done. Host memory has no
        queue (CudaSegment overrides this)."""

    def close(self) -> None:
        """Drop our views; safe twice. Memory is freed once no view of it is left anywhere."""
        self.columns, self.arrays = {}, {}
        self.generations = np.zeros(0, np.int64)
        self._nested, self._data = {}, None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Segment(_Columns):
    """A named, shared TensorDict of ``capacity`` rows; see the module docstring."""

    def __init__(self, path: Path, manifest: dict[str, Any], mm: mmap.mmap, prefault: bool):
        self.name: str = manifest["name"]
        self.path = path
        self.manifest = manifest
        self.schema = Schema.from_spec(manifest["schema"])
        self.capacity: int = manifest["capacity"]
        self._nbytes: int = manifest["size"]
        if prefault:
            _prefault(mm, self._nbytes)
        self._nested, self.columns, self.arrays, self.generations = _mapped_views(
            self.schema, self.capacity, manifest, mm
        )

    @classmethod
    def create(
        cls,
        name: str,
        schema: Schema,
        capacity: int,
        *,
        storage_dir: str | Path | None = None,
        file_mode: int = 0o600,
        group: int | None = None,
        extra: Mapping[str, Any] | None = None,
        prefault: bool = True,
        exist_ok: bool = False,
    ) -> Self:
        check_capacity(capacity)
        return cls._create(
            name,
            schema,
            capacity,
            _layout(schema, capacity),
            lambda path, manifest, mm: cls(path, manifest, mm, prefault),
            storage_dir=storage_dir,
            file_mode=file_mode,
            group=group,
            extra=extra,
            exist_ok=exist_ok,
        )

    @classmethod
    def _create(
        cls,
        name: str,
        schema: Schema,
        capacity: int,
        layout: Mapping[str, Any],
        build: Callable[[Path, dict[str, Any], mmap.mmap], Self],
        *,
        storage_dir: str | Path | None,
        file_mode: int,
        group: int | None,
        extra: Mapping[str, Any] | None,
        exist_ok: bool,
    ) -> Self:
        """Make the folder, a ``data.bin`` of ``layout["size"]`` bytes and, last, the manifest
        (``layout`` merged in) of the segment ``build(path, manifest, mm)`` returns; ``build``
        may add manifest fields (a CUDA segment's IPC handle). Nothing is left on failure."""
        path = segment_path(name, storage_dir)
        size = layout["size"]
        manifest: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "name": name,
            "capacity": capacity,
            "schema": schema.to_spec(),
            **layout,  # columns, generations, size (and a device segment's own fields)
            "data_file": DATA_FILE,
            "created": time.time(),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "extra": dict(extra or {}),
        }
        try:  # fail on an unserialisable `extra` before anything exists on disk
            json.dumps(manifest)
        except (TypeError, ValueError) as e:
            raise SegmentError(f"segment {name!r}: manifest not JSON-serialisable: {e}") from e
        if os.path.lexists(path):
            if not exist_ok:
                raise SegmentError(f"segment {name!r} already exists at {path}")
            cls.unlink(name, storage_dir)
        free = _free_bytes(path)
        if size + ALIGN > free:  # tmpfs would SIGBUS under the mapping instead of failing
            raise OutOfSpaceError(
                f"segment {name!r} needs {size + ALIGN} bytes but {path.parent} has {free} free"
            )
        dir_mode = 0o750 if group is not None else 0o700
        _check_default_root(storage_dir)
        try:
            if not path.parent.exists():
                os.makedirs(path.parent.parent, exist_ok=True)
                with contextlib.suppress(FileExistsError):  # another creator may race us here
                    _make_dir(path.parent, dir_mode, group)
            elif group is not None:
                _open_root_to_group(path.parent, group)
            _make_dir(path, dir_mode, group)
        except FileExistsError:
            raise SegmentError(f"segment {name!r} already exists at {path}") from None
        except OSError as e:  # e.g. a root another user made: name it, not a bare EACCES
            raise SegmentError(f"segment {name!r}: cannot create {path}: {e}") from e
        try:
            fd = _open_new(path / DATA_FILE, file_mode, group)
            try:
                os.posix_fallocate(fd, 0, size)
                mm = mmap.mmap(fd, size, mmap.MAP_SHARED)
            finally:
                os.close(fd)  # the mmap keeps its own reference to the file
            seg = build(path, manifest, mm)
            tmp = path / f".{MANIFEST}.{os.getpid()}.tmp"
            fd = _open_new(tmp, file_mode, group)
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(seg.manifest, indent=2))
            os.replace(tmp, path / MANIFEST)  # atomic: attachers see all or nothing
            return seg
        except OSError as e:
            shutil.rmtree(path, ignore_errors=True)
            if (
                e.errno == errno.ENOSPC
            ):  # ENOSPC from posix_fallocate: the space was taken meanwhile
                raise OutOfSpaceError(f"segment {name!r}: no space for {size} bytes: {e}") from e
            raise SegmentError(f"segment {name!r}: cannot create at {path}: {e}") from e
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise

    @classmethod
    def attach(
        cls, name: str, *, storage_dir: str | Path | None = None, prefault: bool = True
    ) -> Self:
        path, manifest = read_manifest(name, storage_dir)
        if "device" in manifest:
            raise SegmentError(
                f"segment {name!r} at {path} keeps its rows on {manifest['device']}, not in "
                "host memory: open it with shmbuffer.storage.cuda_segment.attach_segment "
                "(Reader and Writer do) in a process with CUDA (docs/cuda.md). Device memory does "
                "not outlive the daemon that allocated it: there is nothing to resume from it"
            )
        try:  # never trust offsets from disk: they must match the layout the schema implies
            layout = _layout(Schema.from_spec(manifest["schema"]), manifest["capacity"])
            ok = all(manifest[k] == v for k, v in layout.items())
        except (KeyError, TypeError, SchemaError) as e:
            raise SegmentError(
                f"segment {name!r}: malformed manifest {path / MANIFEST}: {e}"
            ) from e
        if not ok or manifest["name"] != name:
            raise SegmentError(f"segment {name!r}: manifest {path / MANIFEST} is inconsistent")
        return cls(path, manifest, map_data(name, path, manifest), prefault)

    @staticmethod
    def exists(name: str, storage_dir: str | Path | None = None) -> bool:
        """Whether the name is taken (even by a half-made segment that ``create`` would refuse)."""
        return os.path.lexists(segment_path(name, storage_dir))

    @staticmethod
    def unlink(name: str, storage_dir: str | Path | None = None) -> bool:
        """Remove the files; live mappings elsewhere stay valid until they are dropped."""
        path = segment_path(name, storage_dir)
        if path.is_symlink() or path.is_file():
            path.unlink()
            return True
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            return False
        return True

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, capacity={self.capacity}, {self.schema}, path={self.path})"


class LocalSegment(_Columns):
    """The same attributes as :class:`Segment` in private process memory (no name, no file).

    One anonymous private mapping with the layout of a named segment; it reads as zeros, like
    a fresh shared segment. ``prefault=True`` reserves every page now (the kernel allocates and
    zeroes them: no second zero-fill pass in user space), so the first pass of writes runs at
    full speed and a buffer larger than the free memory is refused here with
    :class:`OutOfSpaceError`; ``False`` leaves the pages to be faulted in on first touch.
    A large prefaulted mapping takes 2 MiB pages where a probe finds them faster to populate on
    this machine (:func:`pages.populate_private`: faster on one VM measured, slower on
    another); ``huge_pages`` says whether it did.
    """

    def __init__(self, schema: Schema, capacity: int, *, prefault: bool = True) -> None:
        check_capacity(capacity)
        self.schema = schema
        self.capacity = capacity
        layout = _layout(schema, capacity)
        size = layout["size"]
        available = _available_memory() if prefault else None
        if available is not None and size > available:
            raise OutOfSpaceError(
                f"buffer needs {size:,} bytes ({capacity:,} rows x {schema.row_nbytes + 8} "
                f"bytes) but this machine has only {available:,} bytes of memory available; "
                "lower the capacity"
            )
        try:
            mm = mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as e:
            raise OutOfSpaceError(f"buffer needs {size:,} bytes of memory: {e}") from e
        self.huge_pages = False
        if prefault:
            try:
                self.huge_pages = pages.populate_private(_address(mm), size)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise OutOfSpaceError(f"buffer needs {size:,} bytes of memory: {e}") from e
                np.frombuffer(mm, np.uint8)[::_PAGE] = 0  # no MADV_POPULATE_WRITE: touch
        self._nested, self.columns, self.arrays, self.generations = _mapped_views(
            schema, capacity, layout, mm
        )
        self._nbytes = sum(t.nbytes for t in self.columns.values())
