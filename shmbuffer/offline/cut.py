"""The episodes of a checkpoint folder, read a batch at a time: what every export converts.

A checkpoint is the consistent cut of a live buffer (``daemon/checkpoint.py``): exactly the
rows committed at the cut, copied while writers went on. This module reads it back as
episodes, never the whole buffer at once: :meth:`CheckpointEpisodes.batches` hands out the
episodes of about ``max_bytes`` of rows at a time, each a ``{dotted key: array}`` of its rows
and its metadata.

Episodes are the registry's entries in id order (the order they were committed), except that
an entry the ring split at its end (one episode written across the wrap) is joined again with
the next entry, which goes on at row 0 (``Ring.wrap_split``, saved with the state). The oldest
entry of a circular transition buffer may be the tail of an episode whose head was
overwritten: it is exported as the buffer holds it, with its own length.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shmbuffer.daemon.checkpoint import CHUNKS, checkpoint_format, read_checkpoint, read_table
from shmbuffer.daemon.checkpoint_layout import ChunkLayout, read_exactly
from shmbuffer.errors import CheckpointError
from shmbuffer.ring.container import Container
from shmbuffer.storage.rows import numpy_dtype
from shmbuffer.storage.schema import Field, Schema, key_str

#: Rows per batch, in bytes: a Parquet file's worth (one file per batch of episodes).
BATCH_BYTES = 64 << 20
#: The metadata every episode has, recorded by the buffer itself (``api/metadata.py``).
BUILTIN = ("id", "length", "commit_time", "writer")


def array_dtype(f: Field) -> np.dtype[Any]:
    """The numpy dtype a column's rows are read as: its own, or ``uint16`` for bfloat16,
    which numpy (and Arrow) lack; the schema beside the data says what the bits are."""
    if f.dtype == torch.bfloat16:
        return np.dtype(np.uint16)
    return numpy_dtype(f.dtype)


@dataclass
class Episode:
    """One episode of the cut: its row ranges in the ring (two across the wrap), its length
    and its metadata (the buffer's own names and the writer's)."""

    ranges: list[tuple[int, int]]
    meta: dict[str, Any]
    columns: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return sum(stop - start for start, stop in self.ranges)


class Batch(list[Episode]):
    """Episodes read together: ``columns`` holds each key's rows for all of them, in order."""

    columns: dict[str, np.ndarray]
    #: Each key's rows as pieces, views of the chunk files (``batches(joined=False)``).
    parts: dict[str, list[np.ndarray]] | None = None


class CheckpointEpisodes:
    """A complete checkpoint folder's episodes (``path``: the folder, or where a checkpoint
    was written to). CheckpointError for a folder that is not a complete checkpoint of a
    format with chunk files (2 and on)."""

    def __init__(self, path: str | Path) -> None:
        folder, manifest, state = read_checkpoint(path)
        if checkpoint_format(state) < 2:
            raise CheckpointError(
                f"checkpoint {folder}: format 1 (one data file, an early version's) "
                "cannot be exported; restore it and checkpoint it again"
            )
        self.table = read_table(folder, manifest)
        self._open(folder, manifest, state, ChunkLayout.of(manifest, self.table))

    def _open(
        self, folder: Path, manifest: dict[str, Any], state: dict[str, Any], layout: ChunkLayout
    ) -> None:
        self.folder, self.manifest, self.state = folder, manifest, state
        self.schema = Schema.from_spec(self.manifest["schema"])
        self.layout = layout
        try:
            container = Container.from_state(self.state)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {self.folder}: state.json: {exc}") from exc
        self.capacity = container.capacity
        self.unit, self.mode = container.ring.unit, container.ring.mode
        self.meta_kinds: dict[str, str] = {}
        self.episodes = self._episodes(container)
        self._fds: dict[int, int] = {}
        self._maps: dict[int, np.ndarray] = {}

    def _episodes(self, container: Container) -> list[Episode]:
        meta = container.meta
        if meta is None:  # a state saved before metadata was kept: the registry's own
            eps = [
                Episode([(ep.start, ep.end)], {"id": ep.id, "length": ep.end - ep.start})
                for ep in container.ring.registry
            ]
        else:
            self.meta_kinds = {k: v for k, v in meta.kinds.items() if k not in BUILTIN}
            records = meta.select()
            _, starts, ends = meta.bounds(None)
            eps = [
                Episode([(int(s), int(e))], _plain(rec))
                for rec, s, e in zip(records.rows(), starts, ends, strict=True)
            ]
        split = container.ring.wrap_split
        joined: list[Episode] = []
        for ep in eps:
            last = joined[-1] if joined else None
            if (
                last is not None
                and last.meta["id"] == split
                and ep.meta["id"] == split + 1
                and last.ranges[-1][1] == self.capacity
                and ep.ranges[0][0] == 0
            ):
                last.ranges.append(ep.ranges[0])
                last.meta["length"] = last.length
                continue
            joined.append(ep)
        return joined

    @property
    def row_nbytes(self) -> int:
        return self.schema.row_nbytes

    @property
    def nbytes(self) -> int:
        """The bytes of every exported row (the progress bar's total)."""
        return sum(ep.length for ep in self.episodes) * self.row_nbytes

    def batches(self, max_bytes: int = BATCH_BYTES, *, joined: bool = True) -> Iterator[Batch]:
        """The episodes, about ``max_bytes`` of rows at a time (an episode larger than that
        alone), each with its ``columns`` read; a batch's arrays are dropped by the next.
        ``joined=False``: each batch's ``parts`` instead (:meth:`column_parts`), and no
        ``columns``."""
        batch: list[Episode] = []
        size = 0
        for ep in self.episodes:
            nbytes = ep.length * self.row_nbytes
            if batch and size + nbytes > max_bytes:
                yield self._read(batch, joined)
                batch, size = [], 0
            batch.append(ep)
            size += nbytes
        if batch:
            yield self._read(batch, joined)

    def _read(self, batch: list[Episode], joined: bool = True) -> Batch:
        """``batch`` with its columns read, one array per key for the whole batch (the
        episodes' columns are views of it)."""
        ranges = [r for ep in batch for r in ep.ranges]
        out = Batch()
        if not joined:
            out.columns = {}
            out.parts = {
                key_str(f.key): self.column_parts(i, ranges) for i, f in enumerate(self.schema)
            }
            out.extend(Episode(ep.ranges, ep.meta) for ep in batch)
            # Maps of earlier batches' chunks go once their views do: a few chunks mapped.
            used = {
                piece * self.layout.piece_rows // self.layout.chunk_rows
                for start, stop in ranges
                for piece in self.layout.pieces_overlapping(start, stop)
            }
            self._maps = {c: m for c, m in self._maps.items() if c in used}
            return out
        out.columns = {key_str(f.key): self.column(i, ranges) for i, f in enumerate(self.schema)}
        at = 0
        for ep in batch:
            views = {k: v[at : at + ep.length] for k, v in out.columns.items()}
            out.append(Episode(ep.ranges, ep.meta, views))
            at += ep.length
        return out

    def column(self, index: int, ranges: list[tuple[int, int]]) -> np.ndarray:
        """Column ``index`` (schema order) of the rows ``ranges``, read from the chunk files
        piece by piece (a piece holds each column's rows back to back)."""
        f = self.schema.fields[index]
        length = sum(stop - start for start, stop in ranges)
        out = np.empty((length, *f.shape), dtype=array_dtype(f))
        view = out.reshape(-1).view(np.uint8).data
        pos = 0
        for piece, offset, rows in self._pieces(index, ranges):
            n = rows * f.row_nbytes
            read_exactly(self._fd(piece), view[pos : pos + n], offset)
            pos += n
        return out

    def column_parts(self, index: int, ranges: list[tuple[int, int]]) -> list[np.ndarray]:
        """Column ``index`` of the rows ``ranges`` as views of the chunk files mapped in
        memory, one array per piece they cross: nothing is copied (the map shares the file's
        pages: a spool on tmpfs is memory already), where :meth:`column` copies every byte
        once more."""
        f = self.schema.fields[index]
        dtype, row = array_dtype(f), f.row_nbytes
        parts = []
        for piece, offset, rows in self._pieces(index, ranges):
            raw = self._mapped(piece)[offset : offset + rows * row]
            parts.append(raw.view(dtype).reshape(rows, *f.shape))
        return parts

    def _pieces(self, index: int, ranges: list[tuple[int, int]]) -> Iterator[tuple[int, int, int]]:
        """Where column ``index`` of the rows ``ranges`` lies: ``(piece, offset in its chunk
        file, rows)`` for each piece they cross, in order (a piece holds each column's rows
        back to back)."""
        row = self.schema.fields[index].row_nbytes
        before = sum(c[2] for c in self.layout.columns[:index])
        for start, stop in ranges:
            for piece in self.layout.pieces_overlapping(start, stop):
                first, last = self.layout.piece_rows_of(piece)
                a, b = max(first, start), min(last, stop)
                offset = (
                    self.layout.offset_in_chunk(piece) + (last - first) * before + (a - first) * row
                )
                yield piece, offset, b - a

    def _mapped(self, piece: int) -> np.ndarray:
        """The bytes of ``piece``'s chunk file, mapped read-only (pages populated at once)."""
        chunk = piece * self.layout.piece_rows // self.layout.chunk_rows
        arr = self._maps.get(chunk)
        if arr is None:
            fd = self._fd(piece)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapped = mmap.mmap(fd, 0, flags=flags, prot=mmap.PROT_READ)
            arr = self._maps[chunk] = np.frombuffer(mapped, np.uint8)
        return arr

    def _fd(self, piece: int) -> int:
        chunk = piece * self.layout.piece_rows // self.layout.chunk_rows
        fd = self._fds.get(chunk)
        if fd is None:
            fd = self._fds[chunk] = self._open_chunk(chunk)
        return fd

    def _open_chunk(self, chunk: int) -> int:
        """A read-only descriptor of chunk file ``chunk``, whole."""
        path = self.folder / CHUNKS / self.table["chunks"][chunk]
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._maps.clear()  # each map goes with the last array viewing it

    def __enter__(self) -> CheckpointEpisodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _plain(record: dict[str, Any]) -> dict[str, Any]:
    """A metadata record with plain Python values (numpy scalars and masked values out)."""
    out: dict[str, Any] = {}
    for name, value in record.items():
        if value is np.ma.masked or value is None:
            out[name] = None
        elif isinstance(value, np.generic):
            out[name] = value.item()
        else:
            out[name] = value
    return out
