"""One checkpoint being written: the cut taken in the loop, the copy on a thread of its own, and
the copy-on-write step the loop runs before it grants rows (see ``checkpoint.py`` for the
design and the folder layout).

Locking contract. Every piece is PENDING (still as at the cut, in the segment), SAVED (the loop
copied it into ``side`` before granting its rows) or DONE (its bytes are safe: written, or in
the thread's hands). States only move forward, and change, with ``side`` and ``finished``,
only under ``lock``, which nobody holds for longer than one piece's memory copy. The loop
(:meth:`protect`) never waits for the thread and never writes to a file system; the thread
never waits for the loop. The thread reads a PENDING piece *without* the lock, then looks
again: still PENDING means no row of it was granted meanwhile (granting saves it first), so
its read is the cut's bytes; SAVED means a writer may have torn the read, and the loop's copy
is used instead. So the loop cannot be held up by a thread the scheduler left waiting (a
priority inversion a claim-and-wait scheme has on a machine short of cores). Once the job has
finished, successfully or not, :meth:`protect` returns at once.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from shmbuffer.daemon import checkpoint as ck
from shmbuffer.daemon.checkpoint_layout import ChunkLayout, write_views
from shmbuffer.errors import CheckpointError
from shmbuffer.storage.segment import MANIFEST

if TYPE_CHECKING:
    from shmbuffer.storage.segment import Segment

log = logging.getLogger("shmbuffer.daemon")

PENDING, SAVED, DONE = 0, 1, 2
#: Most bytes of pieces the loop holds in memory for the thread; beyond it, a reservation of
#: rows not yet saved waits (the writers outrun the disk).
SIDE_LIMIT = 256 << 20
FSYNCS_IN_FLIGHT = 4
#: Pieces the copy thread reads in one go (a read per column each time): it takes the GIL a
#: few times per 16 MB, not per MB, so a busy loop thread cannot starve it.
RUN_PIECES = 16
FREE_MAX = 64  # piece buffers kept for reuse
#: Tests only: seconds the copy thread sleeps before each piece (a slow disk, in a few MB).
ENV_TEST_SLEEP = "SHMBUFFER_TEST_CHECKPOINT_SLEEP_S"


@dataclass
class Cut:
    """What the checkpoint holds, taken in the loop (O(metadata))."""

    state: dict[str, Any]  # DaemonState.persistent_state() and the buffer's name
    use_counts: np.ndarray  # a copy
    pointer: int  # the ring's write cursor: the copy starts there
    open_ranges: list[tuple[int, int]]  # rows of the reservations open at the cut
    lineage: str  # the segment's lineage (see checkpoint.py)


class Cancelled(Exception):
    pass


class CheckpointJob:
    def __init__(self, segment: Segment, cut: Cut, dest: Path, lock_fd: int) -> None:
        self.dest, self.cut = dest, cut
        self.layout = ChunkLayout.of(segment.manifest)
        self.manifest = dict(segment.manifest)
        self.segment_path = segment.path
        self.base = ck.read_base(segment, self.layout)
        self._lock_fd = lock_fd
        self._data_fd = os.open(
            segment.path / segment.manifest["data_file"], os.O_RDONLY | os.O_CLOEXEC
        )
        self._gens = segment.generations
        self.lock = threading.Lock()
        self.state = np.zeros(self.layout.num_pieces, dtype=np.int8)
        self.side: dict[int, bytearray] = {}
        self.side_bytes = 0
        #: Piece buffers the thread has written, for the loop to fill again (a fresh 1 MB
        #: buffer costs its page faults, a large share of the copy's time).
        self._free: list[bytearray] = []
        self._piece_nbytes = self.layout.piece_nbytes(0)
        self.finished = False
        self._cancel = False
        self.result: dict[str, Any] | None = None
        self.error: CheckpointError | None = None
        self.copied_bytes = self.linked_bytes = self.saved_bytes = 0
        self.cut_seconds = 0.0  # how long taking the cut paused the loop (set by its taker)
        self.max_protect = 0.0  # the longest protect() call
        self.deferred = 0  # reservations told to wait (the in-memory copies were full)
        self._sleep = float(os.environ.get(ENV_TEST_SLEEP) or 0.0)
        self._t0 = time.perf_counter()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shmbuffer-checkpoint", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- the loop's side --------------------------------------------------------------------

    def protect(self, ranges: list[tuple[int, int]]) -> bool:
        """Before the loop grants ``ranges``: save every piece of them the copy has not taken
        yet (module docstring). False when the in-memory copies are full: the reservation must
        wait (what was saved stays saved)."""
        if self.finished:
            return True
        t0 = time.perf_counter()
        try:
            with self.lock:
                for start, stop in ranges:
                    for piece in self.layout.pieces_overlapping(start, stop):
                        if not self._save(piece):
                            self.deferred += 1
                            return False
            return True
        finally:
            self.max_protect = max(self.max_protect, time.perf_counter() - t0)

    def _save(self, piece: int) -> bool:
        if self.finished or self.state[piece] != PENDING:
            return True
        size = self.layout.piece_nbytes(piece)
        if self.side_bytes + size > SIDE_LIMIT:
            return False
        buf = self._free.pop() if self._free and size == self._piece_nbytes else bytearray(size)
        self.layout.read_piece(self._data_fd, piece, memoryview(buf))
        self.side[piece] = buf
        self.side_bytes += size
        self.saved_bytes += size
        self.state[piece] = SAVED
        return True

    @property
    def done(self) -> bool:
        """Finished and cleaned up (its lock released): the reply may go."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def cancel(self, timeout: float = 30.0) -> None:
        """Stop the copy (the daemon is stopping): its temp folder goes, the previous
        checkpoint stays."""
        self._cancel = True
        if self._thread.is_alive():
            self._thread.join(timeout)

    def reply(self) -> dict[str, Any]:
        """The ``checkpoint`` reply; raises the job's CheckpointError if it failed."""
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result

    def progress(self) -> str:
        done = self.copied_bytes + self.linked_bytes
        return f"{done / 1e6:.0f} of {self.layout.nbytes / 1e6:.0f} MB saved"

    # -- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        tmp: Path | None = None
        try:
            for stale in self.dest.glob(".tmp-*"):  # left by a daemon killed mid-checkpoint
                ck.remove_folder(stale)
            tmp = self.dest / f".tmp-{uuid.uuid4().hex}"
            tmp.mkdir(mode=0o700)
            path = self._write(tmp)
            tmp = None  # published
            seconds = time.perf_counter() - self._t0
            self.result = {
                "path": str(path),
                "bytes": self.layout.nbytes,
                "seconds": seconds,
                "copied_bytes": self.copied_bytes,
                "linked_bytes": self.linked_bytes,
                "max_pause_ms": max(self.cut_seconds, self.max_protect) * 1e3,
            }
            log.warning(
                "checkpoint %s: %.1f MB copied, %.1f MB linked, in %.2fs; the cut paused the "
                "loop %.1f ms, saving %.1f MB ahead of writers at most %.1f ms (%d waits)",
                path,
                self.copied_bytes / 1e6,
                self.linked_bytes / 1e6,
                seconds,
                self.cut_seconds * 1e3,
                self.saved_bytes / 1e6,
                self.max_protect * 1e3,
                self.deferred,
            )
        except Cancelled:
            self.error = CheckpointError("checkpoint cancelled: the daemon is stopping")
        except CheckpointError as exc:
            self.error = exc
        except OSError as exc:
            self.error = CheckpointError(f"checkpoint to {self.dest} failed: {exc}")
        except Exception as exc:  # a bug must not leave the loop waiting: report it
            log.exception("checkpoint thread failed")
            self.error = CheckpointError(f"checkpoint to {self.dest} failed: internal: {exc!r}")
        finally:
            with self.lock:
                self.finished = True
                self.side.clear()
                self._free.clear()
                self.side_bytes = 0
            if tmp is not None:
                ck.remove_folder(tmp)
            os.close(self._data_fd)
            os.close(self._lock_fd)  # releases the flock
            self.cut = None  # type: ignore[assignment]  # the state and use counts copies
            self._done.set()

    def _write(self, tmp: Path) -> Path:
        cut, layout = self.cut, self.layout
        sums = {MANIFEST: ck.write_json(tmp / MANIFEST, self.manifest)}
        # The cut's state goes first and ``chunks/`` is made after it: a reader may follow the
        # copy (an export converts each chunk file once it has its full size), and a
        # ``chunks/`` folder means the manifest and the state are whole.
        state = {**cut.state, "checkpoint_format": ck.CHECKPOINT_FORMAT, "created": time.time()}
        sums[ck.STATE] = ck.write_json(tmp / ck.STATE, state)
        (tmp / ck.CHUNKS).mkdir(mode=0o700)
        prev = ck.previous_table(self.dest, layout)
        dirty = {
            chunk
            for start, stop in cut.open_ranges
            for chunk in range(layout.chunk_of_row(start), layout.chunk_of_row(stop - 1) + 1)
        }
        first = layout.chunk_of_row(cut.pointer)
        names: list[str] = [""] * layout.num_chunks
        namespaces: list[str | None] = [None] * layout.num_chunks
        checksums: list[int] = [0] * layout.num_chunks
        bounce = memoryview(bytearray(max(layout.piece_nbytes(0), 1) * RUN_PIECES))
        with concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="shmbuffer-fsync"
        ) as syncer:
            # Chunk files are fsynced (and closed) behind the copy, a few at a time: the disk
            # writes one while the next is copied, and the open files stay few.
            fsyncs: collections.deque[concurrent.futures.Future[None]] = collections.deque()
            try:
                for i in range(layout.num_chunks):
                    chunk = (first + i) % layout.num_chunks
                    fd, names[chunk], namespaces[chunk], checksums[chunk] = self._chunk(
                        chunk, chunk in dirty, prev, tmp, bounce
                    )
                    if fd is not None:
                        fsyncs.append(syncer.submit(_fsync_close, fd))
                    while len(fsyncs) > FSYNCS_IN_FLIGHT:
                        fsyncs.popleft().result()  # an fsync's OSError fails the checkpoint
            finally:
                while fsyncs:  # every file closed, even on the way out of a failure
                    with contextlib.suppress(OSError):
                        fsyncs.popleft().result()
        with open(tmp / ck.USE_COUNTS, "wb") as f:
            summing = ck.Summing(f)
            np.save(summing, cut.use_counts)  # a write() is all it needs
            f.flush()
            os.fsync(f.fileno())
        sums[ck.USE_COUNTS] = summing.crc
        table = {
            **layout.to_json(),
            "lineage": cut.lineage,
            "chunks": names,
            "namespaces": namespaces,
            "checksum": "crc32",
            "checksums": checksums,
        }
        sums[ck.TABLE] = ck.write_json(tmp / ck.TABLE, table)
        summary = {
            "bytes": layout.nbytes,
            "copied_bytes": self.copied_bytes,
            "linked_bytes": self.linked_bytes,
            "episodes": len(state["registry"]["episodes"]),
            "checksums": sums,  # of the small files; the chunks' are in the table
        }
        ck.write_json(tmp / ck.COMPLETE, summary)
        ck.fsync_dir(tmp / ck.CHUNKS)
        ck.fsync_dir(tmp)
        return ck.publish(tmp, self.dest)

    def _chunk(
        self,
        chunk: int,
        dirty: bool,
        prev: tuple[Path, dict[str, Any]] | None,
        tmp: Path,
        bounce: memoryview,
    ) -> tuple[int | None, str, str | None, int]:
        """Save one chunk: linked from ``prev`` when its identity is unchanged (its checksum
        taken from ``prev``'s table, the file not read), else copied (the checksum taken over
        the bytes as they are written). ``(fd to fsync or None, file name, identity lineage,
        CRC-32 of the file)``."""
        if self._cancel:
            raise Cancelled
        name, namespace = self._identity(chunk, dirty)
        pieces = list(self.layout.pieces_of(chunk))
        if prev is not None and namespace is not None and prev[1]["chunks"][chunk] == name:
            try:
                os.link(prev[0] / ck.CHUNKS / name, tmp / ck.CHUNKS / name)
            except OSError as exc:  # a file gone, or links refused: copy it instead
                log.warning("checkpoint: cannot link chunk %s (%s); copying it", name, exc)
            else:
                with self.lock:  # the same bytes are on disk already: nothing to keep
                    self._recycle([self._drop(piece) for piece in pieces])
                self.linked_bytes += self.layout.chunk_nbytes(chunk)
                return None, name, namespace, int(prev[1]["checksums"][chunk])
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        fd = os.open(tmp / ck.CHUNKS / name, flags, 0o600)
        crc = 0
        try:
            i = 0
            while i < len(pieces):
                if self._cancel:
                    raise Cancelled
                views, count, used = self._take(pieces, i, bounce)
                if self._sleep:
                    time.sleep(self._sleep * count)
                for view in views:  # in file order: pieces are written back to back
                    crc = zlib.crc32(view, crc)
                self.copied_bytes += write_views(fd, views, self.layout.offset_in_chunk(pieces[i]))
                i += count
                del views
                with self.lock:  # written: the loop may fill them again
                    self._recycle(used)
        except BaseException:
            os.close(fd)
            raise
        return fd, name, namespace, crc

    def _identity(self, chunk: int, dirty: bool) -> tuple[str, str | None]:
        """The chunk's file name and the lineage its identity is in (None: a name nothing
        matches, for a chunk holding rows of a reservation open at the cut)."""
        if dirty:
            return f"{chunk:06d}-open-{uuid.uuid4().hex[:24]}.bin", None
        layout, lineage = self.layout, self.cut.lineage
        base = self.base
        base_ns = base["namespaces"][chunk] if base is not None else None
        mine = layout.identity(lineage, chunk)
        theirs = layout.identity(base_ns, chunk) if base_ns is not None else None
        for piece in layout.pieces_of(chunk):
            with self.lock:  # a PENDING piece cannot change while the lock is held
                if self.state[piece] == SAVED:
                    stamps = bytes(layout.stamps_in(piece, memoryview(self.side[piece])))
                else:
                    start, stop = layout.piece_rows_of(piece)
                    stamps = self._gens[start:stop].tobytes()
            mine.update(stamps)
            if theirs is not None:
                theirs.update(stamps)
        if theirs is not None and base is not None:
            restored = base["chunks"][chunk]
            if layout.file_name(chunk, theirs) == restored:  # unchanged since the restore
                return restored, base_ns
        return layout.file_name(chunk, mine), lineage

    def _take(
        self, pieces: list[int], i: int, bounce: memoryview
    ) -> tuple[list[memoryview], int, list[bytearray | None]]:
        """The bytes, as at the cut, of ``pieces[i]`` and of the PENDING ones after it (up to
        ``RUN_PIECES``): the loop's copies, or read now in one go (module docstring);
        ``(views in chunk-file order, how many pieces, the loop's buffers among them)``."""
        with self.lock:
            count = 1
            if self.state[pieces[i]] == PENDING:
                while (
                    count < RUN_PIECES
                    and i + count < len(pieces)
                    and self.state[pieces[i + count]] == PENDING
                ):
                    count += 1
                saved = False
            else:
                saved = True
        run = pieces[i : i + count]
        parts = (
            [[] for _ in run]
            if saved
            else self.layout.read_run(self._data_fd, run[0], count, bounce)
        )
        used: list[bytearray | None] = []
        with self.lock:
            for k, piece in enumerate(run):
                buf = self._drop(piece)
                if buf is not None:  # saved before or during the read: the loop's copy
                    parts[k] = [memoryview(buf)]
                    used.append(buf)
        return [view for part in parts for view in part], count, used

    def _drop(self, piece: int) -> bytearray | None:
        """Mark ``piece`` DONE; its in-memory copy, if the loop made one (under ``lock``)."""
        buf = self.side.pop(piece, None)
        if buf is not None:
            self.side_bytes -= len(buf)
        self.state[piece] = DONE
        return buf

    def _recycle(self, buffers: list[bytearray | None]) -> None:
        """Keep full-size piece buffers nobody reads any more for :meth:`_save` (under
        ``lock``)."""
        for buf in buffers:
            if buf is not None and len(buf) == self._piece_nbytes and len(self._free) < FREE_MAX:
                self._free.append(buf)


def _fsync_close(fd: int) -> None:
    """fsync a chunk file, then drop its pages from the page cache (a disk's: nobody reads a
    checkpoint soon, and the daemon's host keeps its memory), and close it."""
    try:
        os.fsync(fd)
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
