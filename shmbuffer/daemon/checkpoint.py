"""Checkpoints: the whole buffer (rows, registry, sampler, counters) in a folder on disk.

``write_checkpoint(service, dest)`` runs inside the daemon's single-threaded loop, so what it
copies is one consistent moment: the registry cannot change meanwhile, and no writer can touch a
committed row (writers only write rows of their open reservations, which were unpublished when
reserved). Those rows may be torn in the copy, and that does not matter: they are not in the
saved registry and are never published after a restore. The pause is the copy time.

Layout of ``<dest>/checkpoint/``::

    manifest.json   the segment's manifest (schema, capacity, layout)
    data.bin        the segment's data file: every column plus the per-row generation stamps
    use_counts.npy  per-row read counters
    state.json      journal.container_state: ring, registry, counters, and the sampler
                    (kind, settings, state), rate limiter (kind, settings, counts) and
                    generator state of Container.state
    COMPLETE        written last; a folder without it is never restored

Crash safety: everything is written under ``<dest>/.tmp-<uuid>/``; then the previous checkpoint
is renamed to ``checkpoint.prev``, the new one to ``checkpoint``, and ``checkpoint.prev`` is
removed. A crash at any point leaves a complete ``checkpoint`` or (between the two renames) a
complete ``checkpoint.prev``, which :func:`resolve_checkpoint` falls back to. Leftover temp
folders are removed by the next checkpoint to the same folder (a ``flock`` on ``<dest>/.lock``
keeps two writers apart).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from shmbuffer.errors import CheckpointError, NotFoundError
from shmbuffer.segment import DATA_FILE, MANIFEST

if TYPE_CHECKING:
    from shmbuffer.segment import Segment

CURRENT = "checkpoint"
PREVIOUS = "checkpoint.prev"
COMPLETE = "COMPLETE"
STATE = "state.json"
USE_COUNTS = "use_counts.npy"
CHUNK = 64 << 20
CHECKPOINT_FORMAT = 1


# -- writing ----------------------------------------------------------------------------------


def _copy_chunk(src: int, dst: int, offset: int, count: int) -> int:
    """Copy up to ``count`` bytes at ``offset``; the number copied (kernel-side if possible)."""
    try:
        return os.copy_file_range(src, dst, count, offset, offset)
    except OSError:  # cross-device on old kernels, or a file system that refuses it
        data = os.pread(src, count, offset)
        return os.pwrite(dst, data, offset)


def copy_data(
    src_path: Path, dst_path: Path, size: int, progress: Callable[[int], None] | None = None
) -> None:
    """Copy ``size`` bytes of ``src_path`` into ``dst_path`` (created or overwritten in place,
    never truncated: the destination may be a live segment's data file); ``progress`` is
    told the bytes copied so far after each chunk."""
    src = os.open(src_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        dst = os.open(dst_path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            offset = 0
            while offset < size:
                n = _copy_chunk(src, dst, offset, min(CHUNK, size - offset))
                if n <= 0:
                    raise CheckpointError(f"{src_path} ended at {offset} of {size} bytes")
                offset += n
                if progress is not None:
                    progress(offset)
            os.fsync(dst)
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _write_json(path: Path, value: Any) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(value, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Remove a checkpoint folder, its COMPLETE marker first (a half-removed folder must never
    look complete)."""
    with contextlib.suppress(FileNotFoundError):
        (path / COMPLETE).unlink()
    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _locked(dest: Path) -> Iterator[None]:
    fd = os.open(dest / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CheckpointError(f"another checkpoint is being written to {dest}") from None
        yield
    finally:
        os.close(fd)  # releases the lock


def write_checkpoint(
    segment: Segment | None,
    state: dict[str, Any],
    use_counts: np.ndarray,
    to: str | Path,
) -> dict[str, Any]:
    """Write ``segment``'s rows with the daemon's persistent ``state`` (container, counters,
    sampler) and ``use_counts`` to ``<to>/checkpoint`` (see the module docstring); returns
    ``{"path", "bytes", "seconds"}``. CheckpointError (code ``segment``) on any failure, with
    the previous checkpoint untouched."""
    try:
        return _write_checkpoint(segment, state, use_counts, to)
    except OSError as exc:
        raise CheckpointError(f"checkpoint to {to} failed: {exc}") from exc


def _write_checkpoint(
    segment: Segment | None, state: dict[str, Any], use_counts: np.ndarray, to: str | Path
) -> dict[str, Any]:
    t0 = time.perf_counter()
    if segment is None:
        raise CheckpointError("the buffer has no schema yet: nothing to checkpoint")
    dest = Path(to).expanduser().absolute()
    try:
        dest.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create checkpoint folder {dest}: {exc}") from exc
    with _locked(dest):
        for stale in dest.glob(".tmp-*"):  # left by a writer that crashed
            _remove(stale)
        tmp = dest / f".tmp-{uuid.uuid4().hex}"
        tmp.mkdir(mode=0o700)
        try:
            state = {**state, "checkpoint_format": CHECKPOINT_FORMAT, "created": time.time()}
            _write_json(tmp / MANIFEST, segment.manifest)
            copy_data(segment.path / segment.manifest["data_file"], tmp / DATA_FILE, segment.nbytes)
            np.save(tmp / USE_COUNTS, use_counts)
            _write_json(tmp / STATE, state)
            summary = {"bytes": segment.nbytes, "episodes": len(state["registry"]["episodes"])}
            _write_json(tmp / COMPLETE, summary)
            _fsync_dir(tmp)
            current, previous = dest / CURRENT, dest / PREVIOUS
            if (current / COMPLETE).is_file():
                _remove(previous)
                os.replace(current, previous)
            elif current.exists():  # not complete (cannot happen with this code): drop it
                _remove(current)
            os.replace(tmp, current)
            _fsync_dir(dest)
            _remove(previous)
        except BaseException:
            _remove(tmp)
            raise
    seconds = time.perf_counter() - t0
    return {"path": str(dest / CURRENT), "bytes": segment.nbytes, "seconds": seconds}


# -- reading ----------------------------------------------------------------------------------


def resolve_checkpoint(path: str | Path) -> Path:
    """The complete checkpoint folder that ``path`` names: itself, its ``checkpoint``, or (when
    a crash fell between the two renames) its ``checkpoint.prev``."""
    path = Path(path).expanduser().absolute()
    for candidate in (path, path / CURRENT, path / PREVIOUS):
        if (candidate / COMPLETE).is_file():
            return candidate
    raise NotFoundError(f"no complete checkpoint in {path} (no {COMPLETE} marker)")


def read_checkpoint(path: str | Path) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """``(folder, manifest, state)`` of the complete checkpoint at ``path``."""
    folder = resolve_checkpoint(path)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        state = json.loads((folder / STATE).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {folder} is unreadable: {exc}") from exc
    size = (folder / DATA_FILE).stat().st_size
    if size < manifest["size"]:
        raise CheckpointError(f"{folder / DATA_FILE}: {size} bytes, expected {manifest['size']}")
    return folder, manifest, state
