"""A local client's side of compressed columns (``docs/compression.md``): the Writer
compresses each episode's values of such a column into one chunk before it reserves, the
daemon says where the chunks go in ``bytes.bin``, the writer copies them there and the rows'
chunk references into the rows, then commits; a Reader copies the chunks its gathered rows
name out of ``bytes.bin`` before it checks the rows' stamps, and decompresses them after.

Why the chunks are copied before the stamp check and decompressed after: the daemon moves the
stamps of an episode's rows before it hands that episode's bytes to another writer, so a chunk
copied while it was overwritten fails its rows' check like a torn row; decompressing first
would spend the work on bytes that may be garbage (and raise on them instead of resampling).
A read that redoes rows (their stamps moved) fetches their chunks again with them: each row is
decompressed from the copy taken with its own gather (:class:`PackedReads`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from shmbuffer.clients.pipeline import reserve_fields
from shmbuffer.errors import InvalidArgumentError, SchemaError
from shmbuffer.storage import packed
from shmbuffer.storage.schema import Key, Schema, key_str
from shmbuffer.wire.protocol import decode_i64, encode_i64

if TYPE_CHECKING:
    from tensordict import TensorDict

    from shmbuffer.clients.pipeline import WritePipeline


def refuse_remote(schema: Schema, who: str) -> None:
    """SchemaError for a remote client of a buffer with compressed columns."""
    names = [key_str(f.key) for f in packed.packed_fields(schema)]
    if names:
        raise SchemaError(
            f"column {', '.join(map(repr, names))} is stored compressed in bytes.bin beside "
            f"the rows, which only a local {who} maps: a remote one cannot {who[:-2]}e it"
        )


class PackedWrites:
    """A Writer's compressed columns: their chunks made, copied, and their references."""

    def __init__(self, schema: Schema, folder: Path) -> None:
        from shmbuffer.storage.rows import numpy_dtype

        self.fields = packed.packed_fields(schema)
        self.compress = {f.key: packed.codec(f)[0] for f in self.fields}
        self.dtypes = {f.key: numpy_dtype(f.dtype) for f in self.fields}
        self.store = packed.ByteStore.attach(folder)

    def chunks(
        self, leaves: Mapping[Key, Any], first_row: int, lengths: Sequence[int]
    ) -> list[list[bytes]]:
        """Per episode, per compressed column: its chunk (before anything is reserved)."""
        return packed.write_chunks(self.fields, self.compress, leaves, first_row, lengths)

    @staticmethod
    def sizes(chunks: list[list[bytes]]) -> np.ndarray:
        return np.array([len(c) for per in chunks for c in per], np.int64)

    def copy(
        self,
        chunks: list[list[bytes]],
        offsets: np.ndarray,
        leaves: Mapping[Key, Any],
        first_row: int,
        lengths: Sequence[int],
    ) -> dict[Key, Any]:
        """Copy the chunks into ``bytes.bin`` at ``offsets`` (the reserve's reply) and return
        ``leaves`` with each compressed column replaced by its rows' chunk references."""
        total = sum(lengths)
        refs = {f.key: np.zeros((first_row + total, 3), np.int64) for f in self.fields}
        at, row = 0, first_row
        for length, per_field in zip(lengths, chunks, strict=True):
            for f, chunk in zip(self.fields, per_field, strict=True):
                offset = int(offsets[at])
                self.store.write(offset, [chunk])
                ref = refs[f.key][row : row + length]
                ref[:, packed.OFFSET], ref[:, packed.LENGTH] = offset, len(chunk)
                ref[:, packed.ROW] = np.arange(length)
                at += 1
            row += length
        return {**leaves, **refs}

    def close(self) -> None:
        self.store.array = np.zeros(0, np.uint8)  # the mapping goes with its last reference


class PackedReads:
    """A Reader's compressed columns: chunks copied with each gather, decompressed once the
    rows they came with passed their stamp check."""

    def __init__(self, schema: Schema, folder: Path) -> None:
        from shmbuffer.storage.rows import numpy_dtype

        self.fields = packed.packed_fields(schema)
        self.names = ", ".join(repr(key_str(f.key)) for f in self.fields)
        self.decompress = {f.key: packed.codec(f)[1] for f in self.fields}
        self.dtypes = {f.key: numpy_dtype(f.dtype) for f in self.fields}
        self.store = packed.ByteStore.attach(folder)
        #: Per gather of the read in progress: the places it filled and its chunks' copies.
        self._log: list[tuple[np.ndarray, dict[Key, dict[int, bytes]]]] = []
        self.decompress_s = 0.0
        self.decompressed = 0  # bytes

    def begin(self) -> None:
        """A new read: forget the chunks of the last one."""
        self._log = []

    def fetch(self, data: TensorDict, at: np.ndarray | None = None) -> None:
        """Copy the chunks ``data``'s rows (gathered just now into the read's places ``at``;
        None: all of them) name, before their stamps are checked."""
        n = int(data.batch_size[0]) if data.batch_size else 0
        copies = {}
        for f in self.fields:
            refs = data.get(f.key).numpy().reshape(-1, 3)
            copies[f.key] = packed.fetch(refs, self.store.array)
        self._log.append((np.arange(n) if at is None else np.asarray(at), copies))

    def expand(self, data: TensorDict, skip: np.ndarray | None = None) -> TensorDict:
        """``data`` with each compressed column's references replaced by its values, each row
        from the chunks copied with its own gather; rows in ``skip`` (moved: not checked
        good) are left zero."""
        import torch

        began = time.perf_counter()
        n = int(data.batch_size[0]) if data.batch_size else 0
        source = np.full(n, -1, np.int64)
        for k, (at, _) in enumerate(self._log):
            source[at] = k
        if skip is not None:
            source[skip] = -1
        for f in self.fields:
            refs = data.get(f.key).numpy().reshape(-1, 3)
            out = np.zeros((n, *f.shape), self.dtypes[f.key])
            for k, (_, copies) in enumerate(self._log):
                rows = np.flatnonzero(source == k)
                if rows.size == 0:
                    continue
                mine = refs[rows]
                wanted = {int(o) for o in np.unique(mine[:, packed.OFFSET])}
                chunks = {o: c for o, c in copies[f.key].items() if o in wanted}
                out[rows] = packed.expand(
                    f, self.decompress[f.key], mine, chunks, self.dtypes[f.key]
                )
            self.decompressed += out.nbytes
            data.set(f.key, torch.from_numpy(out), inplace=False)
        self.decompress_s += time.perf_counter() - began
        self._log = []
        return data

    def refuse_out(self) -> None:
        raise InvalidArgumentError(
            f"out=: column {self.names} is stored compressed, so its episodes come back as "
            "new tensors, never as views or into out (docs/compression.md)"
        )

    def stats(self) -> dict[str, Any]:
        return {"decompress_s": self.decompress_s, "decompressed_bytes": self.decompressed}


def write_packed(
    pipe: WritePipeline,
    packer: PackedWrites,
    leaves: Mapping[Key, Any],
    first_row: int,
    lengths: list[int],
    priority: float | bytes | None = None,
    meta: dict[str, Any] | None = None,
    tables: list[str] | None = None,
) -> None:
    """A local write of a buffer with compressed columns: compress, reserve (the chunk
    sizes with the rows, the pending commits carried), copy the chunks at the offsets the
    reply gives, then the rows with their chunk references; the commit rides on the next
    reserve as for any write. Never reserved ahead: its chunks are not known before."""
    from shmbuffer.storage import rows

    assert pipe.segment is not None
    chunks = packer.chunks(leaves, first_row, lengths)
    num_rows = sum(lengths)
    fields = reserve_fields(list(lengths), pipe.reserve_timeout, priority, tables)
    fields["chunks"] = encode_i64(packer.sizes(chunks))
    pipe.carry_commits(fields)
    reply = pipe.conn.call("reserve", timeout=pipe.reserve_timeout + pipe.conn.timeout, **fields)
    pipe.count_carried()
    reservation = reply["reservation"]
    ranges = [(int(s), int(e)) for s, e in reply["ranges"]]
    if pipe.placed is not None:
        pipe.placed.extend(ranges)

    def abort(touched: int) -> None:  # nothing it evicted comes back (daemon/packing.py)
        pipe.conn.send("abort", reservation=reservation)

    with rows.Progress(abort) as progress:
        offsets = decode_i64(reply["offsets"])
        stored = packer.copy(chunks, offsets, leaves, first_row, lengths)
        rows.write(pipe.segment.columns, pipe.segment.arrays, ranges, stored, first_row, progress)
    pipe.copied(reservation, (num_rows, len(lengths)), meta)
