"""Checkpoints: the whole buffer (rows, registry, sampler, counters) in a folder on disk,
written while writers and readers go on.

**The cut.** ``checkpoint`` takes, inside the daemon's loop and in O(metadata) time, the
container's state (ring, registry, sampler, rate limiter, generator), the counters, a copy of
the use counts, the ring's write cursor and the rows of the reservations open at that moment.
The checkpoint holds exactly the rows committed at the cut. A committed row is only ever
written again through a new reservation the daemon grants (``reserve``, or a remote ``write``,
which reserves), so the cut's rows stay as they were until the loop grants them again.

**The copy** (:mod:`~shmbuffer.daemon.checkpoint_job`) runs on a thread of its own, chunk by
chunk from the write cursor round the ring (the rows writers reach first go first), in pieces
within a chunk (:mod:`~shmbuffer.daemon.checkpoint_layout`), up to 16 read at once. Before the
loop grants rows the copy has not taken yet, it copies those rows' pieces into memory itself
(copy-on-write: a piece is about 1 MB, a fraction of a millisecond), and the thread writes them
from there. The loop never waits for the thread: a piece the thread happens to be reading is
copied by the loop all the same, and the thread, seeing it saved, uses the loop's copy. So no
row of the cut is overwritten before it is saved, and a writer never waits for the whole copy.
Rows of reservations open at the cut may be torn in the copy; they are not in the saved
registry and are never published after a restore. The request is answered when the copy and
its fsyncs are done; the daemon serves everyone else meanwhile. If the in-memory copies pass
``checkpoint_job.SIDE_LIMIT`` (writers outrunning the copy), reservations of rows not yet saved
wait in the daemon (parked, like any reservation) until the thread catches up. ``clear``
during a checkpoint is allowed: it changes metadata only, and the checkpoint keeps the cut.

**Incremental.** Each chunk file is named by its identity: the lineage of the segment its
bytes came from (a uuid in the segment manifest, new for every segment created, so two buffers
never match), its rows and their generation stamps. A reservation bumps its rows' stamps before
a writer touches them, so an unchanged identity means unchanged bytes: the chunk of the
previous complete checkpoint in the same folder is hard-linked (``os.link``) instead of copied,
and an unchanged buffer re-checkpoints in about the time of its metadata. A chunk holding rows
of a reservation open at the cut gets a name no identity matches (its bytes may be torn), so the
next checkpoint copies it again. A daemon restored from a checkpoint keeps that checkpoint's
chunk table beside its segment (``BASE_FILE``): a chunk whose stamps are still the restored ones
keeps the restored chunk's identity, so the first checkpoint after ``--restore`` links too.
Nothing is ever modified in place: the previous checkpoint stays whole until the new one is.

Layout of ``<dest>/checkpoint/`` (format 3)::

    manifest.json   the segment's manifest (schema, capacity, layout)
    chunks/         one file per chunk, named <index>-<identity>.bin (see checkpoint_layout)
    chunks.json     the chunk table: layout, file names, identity lineages, this checkpoint's
                    lineage, and each chunk file's CRC-32 (``checksums``)
    use_counts.npy  per-row read counters at the cut (with several tables, one row per table)
    state.json      saved_state.container_state at the cut: ring, registry, counters, and the
                    sampler (kind, settings, state), rate limiter (kind, settings, counts) and
                    generator state of Container.state
    COMPLETE        written last; a folder without it is never restored. It holds the CRC-32
                    of manifest.json, state.json, chunks.json and use_counts.npy

**Checksums.** A chunk's name says which rows and stamps it holds, not that its bytes are still
those: a flipped bit on disk would be restored and served as a valid row. So the copy thread
takes the CRC-32 of every chunk file as it writes it (``zlib.crc32`` releases the GIL and runs
at memory speed; never in the loop), a linked chunk carries its checksum over from the table
it is linked from without being read again, and ``COMPLETE`` covers the small files, the chunk
table with its checksums included. Restore checks each file as it copies it (one pass: read,
checksum, write) and, on a mismatch, refuses the whole checkpoint naming the file, before the
daemon serves anything; the fresh segment is removed. Checkpoints without checksums (formats 1
and 2, written by earlier versions) still restore, with a warning that their rows are not
verified (refusing them would strand every checkpoint taken before); a checkpoint taken after
such a restore copies every chunk again, since a chunk without a checksum is never linked.

Format 2 (the same without checksums) and format 1 (one ``data.bin``, a copy of the segment's
data file, written by earlier versions inside the loop) are still restored.

Order in the temporary folder: ``manifest.json`` and ``state.json`` (the cut's) first, then
``chunks/`` is made and the chunk files written one after another in copy order, each growing
from its start to its full size, then the rest: a reader may follow the copy
(``offline/follow.py``: a live export converts each chunk file as soon as it is whole).

Crash safety: everything is written under ``<dest>/.tmp-<uuid>/``; then the previous checkpoint
is renamed to ``checkpoint.prev``, the new one to ``checkpoint``, and ``checkpoint.prev`` is
removed (the new one's links keep the chunks they share). A crash at any point leaves a
complete ``checkpoint`` or (between the two renames) a complete ``checkpoint.prev``, which
:func:`resolve_checkpoint` falls back to. A daemon stopped during a checkpoint drops its temp
folder; one killed leaves it, and the next checkpoint to that folder removes it (a ``flock`` on
``<dest>/.lock`` keeps two writers apart).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shmbuffer.daemon.checkpoint_layout import ChunkLayout, copy_range, read_exactly
from shmbuffer.errors import CheckpointError, NotFoundError
from shmbuffer.storage.segment import DATA_FILE, MANIFEST

if TYPE_CHECKING:
    from shmbuffer.storage.segment import Segment

CURRENT = "checkpoint"
PREVIOUS = "checkpoint.prev"
COMPLETE = "COMPLETE"
STATE = "state.json"
USE_COUNTS = "use_counts.npy"
CHUNKS = "chunks"
TABLE = "chunks.json"
#: Beside a restored segment: the chunk table of the checkpoint it was restored from.
BASE_FILE = "checkpoint_base.json"
CHUNK = 64 << 20  # bytes per copy call of a format-1 data file
CHECKPOINT_FORMAT = 3
READS_FORMATS = (1, 2, 3)
#: The first format whose files carry checksums (module docstring).
CHECKSUMS_SINCE = 3
#: The small files ``COMPLETE`` holds the checksums of.
SUMMED_FILES = (MANIFEST, STATE, TABLE, USE_COUNTS)
READ_BLOCK = 8 << 20  # bytes per read when a file is checksummed on its own

log = logging.getLogger("shmbuffer.daemon")


# -- folders ----------------------------------------------------------------------------------


def write_json(path: Path, value: Any) -> int:
    """Write ``value`` to a new file ``path`` and fsync it; the CRC-32 of the file."""
    data = json.dumps(value, separators=(",", ":")).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return zlib.crc32(data)


class Summing:
    """A file's ``write`` that also keeps the CRC-32 of what went through it (for writers,
    such as ``np.save``, that take a file object)."""

    def __init__(self, f: Any) -> None:
        self.f, self.crc = f, 0

    def write(self, data: Any) -> int:
        self.crc = zlib.crc32(data, self.crc)
        return int(self.f.write(data))


def file_crc(path: Path) -> int:
    """The CRC-32 of the file at ``path``, read in blocks."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(READ_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_folder(path: Path) -> None:
    """Remove a checkpoint folder, its COMPLETE marker first (a half-removed folder must never
    look complete)."""
    with contextlib.suppress(FileNotFoundError):
        (path / COMPLETE).unlink()
    shutil.rmtree(path, ignore_errors=True)


def open_destination(to: str | Path) -> tuple[Path, int]:
    """``(folder, fd)``: ``to`` as an absolute folder (created if missing) and an open file
    holding its ``flock`` (close it to release). CheckpointError when it cannot be created or
    another checkpoint is being written there."""
    dest = Path(to).expanduser().absolute()
    try:
        dest.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(dest / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise CheckpointError(f"cannot create checkpoint folder {dest}: {exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CheckpointError(f"another checkpoint is being written to {dest}") from None
    return dest, fd


def publish(tmp: Path, dest: Path) -> Path:
    """Put the complete folder ``tmp`` in place as ``<dest>/checkpoint`` (module docstring)."""
    current, previous = dest / CURRENT, dest / PREVIOUS
    if (current / COMPLETE).is_file():
        remove_folder(previous)
        os.replace(current, previous)
    elif current.exists():  # not complete (cannot happen with this code): drop it
        remove_folder(current)
    os.replace(tmp, current)
    fsync_dir(dest)
    remove_folder(previous)
    return current


def previous_table(dest: Path, layout: ChunkLayout) -> tuple[Path, dict[str, Any]] | None:
    """The complete checkpoint in ``dest`` with its chunk table, if it carries checksums and
    is cut like ``layout`` (else nothing can be linked from it: a linked chunk takes its
    checksum from this table)."""
    try:
        folder = resolve_checkpoint(dest)
        table = json.loads((folder / TABLE).read_text())
    except (NotFoundError, OSError, ValueError):
        return None
    if not isinstance(table, dict) or not layout.same_cut(table):
        return None
    if len(table.get("chunks") or ()) != layout.num_chunks:
        return None
    if chunk_checksums(table, layout.num_chunks) is None:
        return None
    return folder, table


def chunk_checksums(table: dict[str, Any], num_chunks: int) -> list[int] | None:
    """A chunk table's checksums, one per chunk; None if it has none (or not of that kind)."""
    sums = table.get("checksums")
    if table.get("checksum") != "crc32" or not isinstance(sums, list) or len(sums) != num_chunks:
        return None
    if not all(type(s) is int for s in sums):
        return None
    return sums


def read_base(segment: Segment, layout: ChunkLayout) -> dict[str, Any] | None:
    """The chunk table of the checkpoint ``segment`` was restored from, if cut like ``layout``."""
    try:
        table = json.loads((segment.path / BASE_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(table, dict) or not layout.same_cut(table):
        return None
    sizes = {len(table.get("chunks") or ()), len(table.get("namespaces") or ())}
    return table if sizes == {layout.num_chunks} else None


def write_base(segment: Segment, table: dict[str, Any]) -> None:
    """Keep ``table`` (a restored checkpoint's) beside ``segment``, atomically."""
    tmp = segment.path / f".{BASE_FILE}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    write_json(tmp, table)
    os.replace(tmp, segment.path / BASE_FILE)


# -- reading ----------------------------------------------------------------------------------


def resolve_checkpoint(path: str | Path) -> Path:
    """The complete checkpoint folder that ``path`` names: itself, its ``checkpoint``, or (when
    a crash fell between the two renames) its ``checkpoint.prev``."""
    path = Path(path).expanduser().absolute()
    for candidate in (path, path / CURRENT, path / PREVIOUS):
        if (candidate / COMPLETE).is_file():
            return candidate
    raise NotFoundError(f"no complete checkpoint in {path} (no {COMPLETE} marker)")


def checkpoint_format(state: dict[str, Any]) -> int:
    return int(state.get("checkpoint_format", 1))


def corrupt(folder: Path, what: str, got: int, want: int) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {folder} is corrupt: {what} does not match its checksum (crc32 "
        f"{got:08x}, recorded {want:08x}); nothing was restored. Restore another copy of it (a "
        "backup, or an earlier checkpoint), or take a new checkpoint from a running daemon"
    )


def _file_sums(folder: Path) -> dict[str, int] | None:
    """The checksums ``COMPLETE`` holds (format 3 on), None for an earlier checkpoint's."""
    try:
        summary = json.loads((folder / COMPLETE).read_text() or "{}")
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {folder}: unreadable {COMPLETE}: {exc}") from exc
    sums = summary.get("checksums") if isinstance(summary, dict) else None
    if sums is None:
        return None
    if not isinstance(sums, dict) or any(type(sums.get(n)) is not int for n in SUMMED_FILES):
        raise CheckpointError(f"checkpoint {folder}: {COMPLETE} has unreadable checksums")
    return sums


def _read_summed(folder: Path, name: str, sums: dict[str, int] | None) -> bytes:
    """The bytes of ``folder/name``, checked against ``sums`` when there are any."""
    data = (folder / name).read_bytes()
    if sums is not None and zlib.crc32(data) != sums[name]:
        raise corrupt(folder, f"file {folder / name}", zlib.crc32(data), sums[name])
    return data


def read_checkpoint(path: str | Path) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """``(folder, manifest, state)`` of the complete checkpoint at ``path``; CheckpointError
    naming what is missing, corrupt (the small files are checked against their checksums
    here, the chunks by :func:`restore_rows`) or of an unknown format."""
    folder = resolve_checkpoint(path)
    sums = _file_sums(folder)
    try:
        manifest = json.loads(_read_summed(folder, MANIFEST, sums))
        state = json.loads(_read_summed(folder, STATE, sums))
        fmt = checkpoint_format(state)
    except (OSError, ValueError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {folder} is unreadable: {exc}") from exc
    if fmt not in READS_FORMATS:
        raise CheckpointError(
            f"checkpoint {folder}: checkpoint_format {fmt}, this version reads {READS_FORMATS}"
        )
    if fmt >= CHECKSUMS_SINCE and sums is None:
        raise CheckpointError(f"checkpoint {folder}: {COMPLETE} has no checksums")
    if sums is not None:
        try:
            got = file_crc(folder / USE_COUNTS)
        except OSError as exc:
            raise CheckpointError(f"checkpoint {folder}: {exc}") from exc
        if got != sums[USE_COUNTS]:
            raise corrupt(folder, f"file {folder / USE_COUNTS}", got, sums[USE_COUNTS])
    if fmt == 1:
        size = (folder / DATA_FILE).stat().st_size
        if size < manifest["size"]:
            raise CheckpointError(
                f"{folder / DATA_FILE}: {size} bytes, expected {manifest['size']}"
            )
        return folder, manifest, state
    table = read_table(folder, manifest, sums)
    layout = ChunkLayout.of(manifest, table)
    if fmt >= CHECKSUMS_SINCE and chunk_checksums(table, layout.num_chunks) is None:
        raise CheckpointError(f"checkpoint {folder}: {TABLE} has no checksums for its chunks")
    for chunk, name in enumerate(table["chunks"]):
        file = folder / CHUNKS / name
        try:
            size = file.stat().st_size
        except OSError as exc:
            raise CheckpointError(f"checkpoint {folder}: chunk {chunk}: {exc}") from exc
        if size != layout.chunk_nbytes(chunk):
            raise CheckpointError(f"{file}: {size} bytes, expected {layout.chunk_nbytes(chunk)}")
    return folder, manifest, state


def read_table(
    folder: Path, manifest: dict[str, Any], sums: dict[str, int] | None = None
) -> dict[str, Any]:
    try:
        table = json.loads(_read_summed(folder, TABLE, sums))
        layout = ChunkLayout.of(manifest, table)
        ok = layout.same_cut(table) and len(table["chunks"]) == layout.num_chunks
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {folder}: unreadable {TABLE}: {exc}") from exc
    if not ok:
        raise CheckpointError(f"checkpoint {folder}: {TABLE} does not fit its manifest")
    return dict(table)


# -- restore ----------------------------------------------------------------------------------


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
            for offset in range(0, size, CHUNK):
                copy_range(src, dst, min(CHUNK, size - offset), offset, offset)
                if progress is not None:
                    progress(min(offset + CHUNK, size))
            os.fsync(dst)
        finally:
            os.close(dst)
    finally:
        os.close(src)


def restore_rows(
    folder: Path,
    manifest: dict[str, Any],
    state: dict[str, Any],
    segment: Segment,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Copy a checkpoint's rows and stamps into ``segment`` (fresh, of the same layout); the
    bytes copied. Each chunk file is checked against its checksum as it is copied: a mismatch
    raises CheckpointError naming the file (the caller drops the segment). Formats 2 and 3
    leave the checkpoint's chunk table beside the segment (:data:`BASE_FILE`) so the next
    checkpoint can link what is still unchanged."""
    data_path = segment.path / segment.manifest["data_file"]
    fmt = checkpoint_format(state)
    if fmt < CHECKSUMS_SINCE:
        log.warning(
            "checkpoint %s (format %d, written by an earlier version) has no checksums: its "
            "rows are restored unverified; the next checkpoint of this daemon carries them",
            folder,
            fmt,
        )
    if fmt == 1:
        copy_data(folder / DATA_FILE, data_path, segment.nbytes, progress)
        return segment.nbytes
    table = read_table(folder, manifest, _file_sums(folder))
    layout = ChunkLayout.of(segment.manifest, table)
    sums = chunk_checksums(table, layout.num_chunks)
    bounce = memoryview(bytearray(max(layout.piece_nbytes(0), 1)))
    done = 0
    data_fd = os.open(data_path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        for chunk, name in enumerate(table["chunks"]):
            chunk_fd = os.open(folder / CHUNKS / name, os.O_RDONLY | os.O_CLOEXEC)
            try:
                got = layout.restore_chunk(chunk_fd, data_fd, chunk, bounce)
            finally:
                os.close(chunk_fd)
            if sums is not None and got != sums[chunk]:
                start, stop = layout.chunk_rows_of(chunk)
                what = f"chunk file {folder / CHUNKS / name} (rows {start} to {stop - 1})"
                raise corrupt(folder, what, got, sums[chunk])
            done += layout.chunk_nbytes(chunk)
            if progress is not None:
                progress(done)
        os.fsync(data_fd)
    finally:
        os.close(data_fd)
    write_base(segment, table)
    return done


def verify(path: str | Path) -> int:
    """Check every file of the checkpoint at ``path`` against its checksum without restoring
    it (what a restore adds to the copy); the bytes of rows read. CheckpointError as
    :func:`read_checkpoint` and :func:`restore_rows`, and for a checkpoint without checksums."""
    folder, manifest, state = read_checkpoint(path)
    if checkpoint_format(state) < CHECKSUMS_SINCE:
        raise CheckpointError(f"checkpoint {folder} has no checksums (an earlier format)")
    table = read_table(folder, manifest, _file_sums(folder))
    layout = ChunkLayout.of(manifest, table)
    sums = chunk_checksums(table, layout.num_chunks)
    assert sums is not None  # read_checkpoint refuses a format-3 table without them
    block = memoryview(bytearray(READ_BLOCK))
    for chunk, name in enumerate(table["chunks"]):
        got, size = 0, layout.chunk_nbytes(chunk)
        fd = os.open(folder / CHUNKS / name, os.O_RDONLY | os.O_CLOEXEC)
        try:
            for offset in range(0, size, READ_BLOCK):
                view = block[: min(READ_BLOCK, size - offset)]
                read_exactly(fd, view, offset)
                got = zlib.crc32(view, got)
        finally:
            os.close(fd)
        if got != sums[chunk]:
            raise corrupt(folder, f"chunk file {folder / CHUNKS / name}", got, sums[chunk])
    return layout.nbytes
