"""Where a checkpoint keeps the rows: fixed row ranges (*chunks*, one file each) cut into
*pieces*, the unit one copy handles. The one module that knows both the segment's data file
(each column back to back, then one int64 stamp per row) and a chunk file's layout.

A chunk file is its pieces back to back; a piece is, for its rows, each column's bytes in
schema order, then the rows' stamps. So a piece is one contiguous read per column from the data
file and one contiguous write to the chunk file, and a chunk file grows from its start (the
command line's progress bar counts its bytes).

Sizes: a piece is about ``PIECE_BYTES`` (what the loop copies at most per piece before a
reservation may overwrite it: a fraction of a millisecond), a chunk at most ``CHUNK_BYTES``
(the unit an incremental checkpoint keeps or copies again). A small buffer still gets at least
``MIN_PIECES`` pieces and ``MIN_CHUNKS`` chunks, so a few-MB test buffer behaves like a big
one.

A chunk's *identity* names its file: a hash of the segment lineage it was written from, its
rows and their stamps. A reservation bumps its rows' stamps before any writer touches them, so
the same lineage and stamps mean the same bytes; a later checkpoint whose chunk has the same
identity hard-links the earlier file instead of copying it. The name says which bytes a chunk
should hold, not that the file still holds them: its CRC-32 is kept in the chunk table and
checked on restore (``checkpoint.py``).
"""

from __future__ import annotations

import hashlib
import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shmbuffer.errors import CheckpointError
from shmbuffer.storage.schema import Schema, key_str

PIECE_BYTES = 1 << 20
CHUNK_BYTES = 64 << 20
MIN_PIECES = 256
MIN_CHUNKS = 16
STAMP_BYTES = 8
IOV_BATCH = 512  # buffers per pwritev (Linux takes up to 1024)


def copy_range(src: int, dst: int, count: int, src_offset: int, dst_offset: int) -> None:
    """Copy ``count`` bytes between two files at their own offsets (kernel-side where the
    file systems allow it); CheckpointError if the source ends first."""
    while count > 0:
        try:
            n = os.copy_file_range(src, dst, count, src_offset, dst_offset)
        except OSError:  # cross-device on older kernels, or a file system that refuses it
            n = os.pwrite(dst, os.pread(src, min(count, PIECE_BYTES * 8), src_offset), dst_offset)
        if n <= 0:
            raise CheckpointError(f"a chunk file ended {count} bytes early")
        count, src_offset, dst_offset = count - n, src_offset + n, dst_offset + n


def read_exactly(fd: int, buf: memoryview, offset: int) -> None:
    """Fill ``buf`` from ``fd`` at ``offset`` (preadv releases the GIL)."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise CheckpointError(f"a file ended at byte {offset + done}, before its end")
        done += n


def write_exactly(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        done += os.pwrite(fd, buf[done:], offset + done)


def write_views(fd: int, views: list[memoryview], offset: int) -> int:
    """Write ``views`` back to back at ``offset``, a batch per ``pwritev`` (one release of the
    GIL for many pieces); the bytes written."""
    views = [v for v in views if len(v)]
    start = offset
    for i in range(0, len(views), IOV_BATCH):
        batch = views[i : i + IOV_BATCH]
        done = os.pwritev(fd, batch, offset)
        offset += done
        for view in batch:  # a short write (rare): the rest one by one
            if done >= len(view):
                done -= len(view)
                continue
            write_exactly(fd, view[done:], offset)
            offset += len(view) - done
            done = 0
    return offset - start


@dataclass(frozen=True)
class ChunkLayout:
    capacity: int
    #: (dotted key, offset in the data file, bytes per row) of each column, in schema order
    columns: tuple[tuple[str, int, int], ...]
    stamps_offset: int
    piece_rows: int
    chunk_rows: int

    @classmethod
    def of(cls, manifest: Mapping[str, Any], saved: Mapping[str, Any] | None = None) -> ChunkLayout:
        """The layout of the segment ``manifest`` describes: piece and chunk sizes from
        ``saved`` (a checkpoint's ``chunks.json``: restore must cut as it was cut), else
        chosen here."""
        capacity = int(manifest["capacity"])
        offsets = manifest["columns"]
        columns = tuple(
            (key_str(f.key), int(offsets[key_str(f.key)]["offset"]), f.row_nbytes)
            for f in Schema.from_spec(manifest["schema"])
        )
        stamps = int(manifest["generations"]["offset"])
        if saved is not None:
            return cls(
                capacity, columns, stamps, int(saved["piece_rows"]), int(saved["chunk_rows"])
            )
        row = sum(c[2] for c in columns) + STAMP_BYTES
        piece_rows = max(1, min(PIECE_BYTES // row, capacity // MIN_PIECES))
        pieces = -(-capacity // piece_rows)
        per_chunk = max(1, min(CHUNK_BYTES // (piece_rows * row), -(-pieces // MIN_CHUNKS)))
        return cls(capacity, columns, stamps, piece_rows, piece_rows * per_chunk)

    def to_json(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity,
            "columns": [[key, row] for key, _, row in self.columns],
            "piece_rows": self.piece_rows,
            "chunk_rows": self.chunk_rows,
        }

    def same_cut(self, saved: Mapping[str, Any]) -> bool:
        """Whether a saved table (``to_json``) cuts the rows as this layout does."""
        try:
            return bool(self.to_json() == {k: saved[k] for k in self.to_json()})
        except KeyError:
            return False

    # -- geometry ---------------------------------------------------------------------------

    @property
    def row_nbytes(self) -> int:
        return sum(c[2] for c in self.columns) + STAMP_BYTES

    @property
    def num_pieces(self) -> int:
        return -(-self.capacity // self.piece_rows)

    @property
    def num_chunks(self) -> int:
        return -(-self.capacity // self.chunk_rows)

    @property
    def nbytes(self) -> int:
        return self.capacity * self.row_nbytes

    def piece_rows_of(self, piece: int) -> tuple[int, int]:
        start = piece * self.piece_rows
        return start, min(start + self.piece_rows, self.capacity)

    def chunk_rows_of(self, chunk: int) -> tuple[int, int]:
        start = chunk * self.chunk_rows
        return start, min(start + self.chunk_rows, self.capacity)

    def pieces_of(self, chunk: int) -> range:
        per = self.chunk_rows // self.piece_rows
        return range(chunk * per, min((chunk + 1) * per, self.num_pieces))

    def pieces_overlapping(self, start: int, stop: int) -> range:
        return range(start // self.piece_rows, -(-stop // self.piece_rows))

    def chunk_of_row(self, row: int) -> int:
        return (row % self.capacity) // self.chunk_rows

    def piece_nbytes(self, piece: int) -> int:
        start, stop = self.piece_rows_of(piece)
        return (stop - start) * self.row_nbytes

    def chunk_nbytes(self, chunk: int) -> int:
        start, stop = self.chunk_rows_of(chunk)
        return (stop - start) * self.row_nbytes

    def offset_in_chunk(self, piece: int) -> int:
        """Where ``piece`` starts in its chunk's file (every piece before it is whole)."""
        start, _ = self.piece_rows_of(piece)
        return (start - start // self.chunk_rows * self.chunk_rows) * self.row_nbytes

    # -- bytes ------------------------------------------------------------------------------

    def read_piece(self, data_fd: int, piece: int, out: memoryview) -> memoryview:
        """``piece`` read from the data file into ``out`` (chunk-file layout); the part used."""
        start, stop = self.piece_rows_of(piece)
        pos = 0
        for _, offset, row in self.columns:
            n = (stop - start) * row
            if n:
                read_exactly(data_fd, out[pos : pos + n], offset + start * row)
            pos += n
        n = (stop - start) * STAMP_BYTES
        read_exactly(data_fd, out[pos : pos + n], self.stamps_offset + start * STAMP_BYTES)
        return out[: pos + n]

    def read_run(
        self, data_fd: int, first: int, count: int, out: memoryview
    ) -> list[list[memoryview]]:
        """Pieces ``first .. first+count-1`` read into ``out`` with one read per column (the
        copy thread's unit: few GIL releases for many bytes); their parts in chunk-file order,
        ``count`` lists of them (each piece's columns, then its stamps)."""
        start, _ = self.piece_rows_of(first)
        _, stop = self.piece_rows_of(first + count - 1)
        bounds = [self.piece_rows_of(first + k) for k in range(count)]
        parts: list[list[memoryview]] = [[] for _ in range(count)]
        pos = 0
        for _, offset, row in (*self.columns, ("", self.stamps_offset, STAMP_BYTES)):
            size = (stop - start) * row
            if size:
                read_exactly(data_fd, out[pos : pos + size], offset + start * row)
                for k, (a, b) in enumerate(bounds):
                    parts[k].append(out[pos + (a - start) * row : pos + (b - start) * row])
            pos += size
        return parts

    def stamps_in(self, piece: int, data: memoryview) -> memoryview:
        """The stamps part of a piece read by :meth:`read_piece`."""
        start, stop = self.piece_rows_of(piece)
        return data[len(data) - (stop - start) * STAMP_BYTES :]

    def restore_chunk(self, chunk_fd: int, data_fd: int, chunk: int, bounce: memoryview) -> int:
        """Copy one chunk file's rows and stamps back to their places in the data file,
        piece by piece through ``bounce`` (a piece's bytes at least); the CRC-32 of the chunk
        file, taken on the way (so a restore reads every byte once)."""
        crc = 0
        for piece in self.pieces_of(chunk):
            start, stop = self.piece_rows_of(piece)
            data = bounce[: self.piece_nbytes(piece)]
            read_exactly(chunk_fd, data, self.offset_in_chunk(piece))
            crc = zlib.crc32(data, crc)
            pos = 0
            for _, offset, row in (*self.columns, ("", self.stamps_offset, STAMP_BYTES)):
                n = (stop - start) * row
                if n:
                    write_exactly(data_fd, data[pos : pos + n], offset + start * row)
                pos += n
        return crc

    # -- identity ---------------------------------------------------------------------------

    def identity(self, lineage: str, chunk: int) -> Any:
        """A hash to feed a chunk's stamps, piece by piece, then :meth:`file_name`."""
        start, stop = self.chunk_rows_of(chunk)
        h = hashlib.blake2b(digest_size=12)
        h.update(f"{lineage}:{start}:{stop}:{self.row_nbytes}:".encode())
        return h

    @staticmethod
    def file_name(chunk: int, identity: Any) -> str:
        return f"{chunk:06d}-{identity.hexdigest()}.bin"
