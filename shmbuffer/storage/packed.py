"""Compressed columns: one chunk per episode in a byte store beside the rows.

A column declared ``compress = "zstd"`` (or ``"lz4"``, optional ``level``) is not stored in
the rows: each episode's values of it are compressed into one chunk, copied into the byte
store (a mapping of its own, its size in bytes set by the user), and each row of the episode
holds a reference to it (:attr:`Field.stored <shmbuffer.storage.schema.Field.stored>`: three
int64, the chunk's offset and length in the store and the row's place in the chunk). A read
copies the references with the rows, like any column, then the chunks they name out of the
store (:func:`fetch`), and decompresses them (:func:`expand`). A reader that checks stamps
checks them after :func:`fetch`: the ring evicts an episode whose chunk a later write needs
through its rows (``ring/packing.py``), so a chunk that changed under a copy moved its rows'
stamps too, and garbage is never decompressed unnoticed.

Why one chunk per episode: the frames of an episode are what compress together (an Atari
episode's frames share their background); a chunk per row would compress each frame alone,
and a chunk across episodes could not be evicted with the first of them. The cost is that a
read decompresses the whole episode of each drawn row (once per episode per read).

The codecs are optional packages (``pip install shmbuffer[compress]``), imported when a
column first uses them. Zero-copy views of such a column cannot exist (its bytes are not
rows); reads return copies.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from shmbuffer.errors import InvalidArgumentError, SchemaError
from shmbuffer.storage.schema import Field, Key, Schema, key_str

Codec = tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]
#: A row's chunk reference: (offset, length) of its chunk in the store, its row in the chunk.
OFFSET, LENGTH, ROW = 0, 1, 2
STORE_FILE = "bytes.bin"


def packed_fields(schema: Schema | None) -> list[Field]:
    """The columns of ``schema`` stored compressed."""
    return [] if schema is None else [f for f in schema if f.compress is not None]


def refuse_packed(schema: Schema, where: str) -> None:
    """SchemaError naming the compressed columns of ``schema``, which ``where`` cannot hold."""
    names = [key_str(f.key) for f in packed_fields(schema)]
    if names:
        raise SchemaError(
            f"column {', '.join(map(repr, names))} is stored compressed, which {where} does "
            "not offer yet: compressed columns are kept by the in-process Buffer"
        )


def codec(field: Field) -> Codec:
    """``(compress, decompress)`` for ``field``'s codec and level; SchemaError naming the
    key and the extra to install when its package is missing."""
    try:
        if field.compress == "zstd":
            import zstandard

            level = 3 if field.level is None else field.level
            return zstandard.ZstdCompressor(level=level).compress, _zstd_decompress(zstandard)
        if field.compress == "lz4":
            import lz4.frame

            level = 0 if field.level is None else field.level
            return (
                lambda data: lz4.frame.compress(data, compression_level=level),
                lz4.frame.decompress,
            )
    except ImportError:
        package = "zstandard" if field.compress == "zstd" else "lz4"
        raise SchemaError(
            f"key {key_str(field.key)!r}: compress={field.compress!r} needs the {package} "
            "package (pip install 'shmbuffer[compress]')"
        ) from None
    raise SchemaError(f"key {key_str(field.key)!r}: no codec {field.compress!r}")


def _zstd_decompress(zstandard: Any) -> Callable[[bytes], bytes]:
    decompressor = zstandard.ZstdDecompressor()
    return decompressor.decompress  # type: ignore[no-any-return]


def compress_episodes(
    field: Field, compress: Callable[[bytes], bytes], values: np.ndarray, lengths: Sequence[int]
) -> list[bytes]:
    """One chunk per episode of ``values`` (its rows, the episodes one after another)."""
    chunks, start = [], 0
    flat = np.ascontiguousarray(values)
    for length in lengths:
        chunks.append(compress(flat[start : start + length].tobytes()))
        start += length
    return chunks


def write_chunks(
    fields: Sequence[Field],
    compressors: Mapping[Key, Callable[[bytes], bytes]],
    leaves: Mapping[Key, Any],
    first_row: int,
    lengths: Sequence[int],
) -> list[list[bytes]]:
    """Per episode of a write (``leaves`` from row ``first_row`` on, episodes of ``lengths``),
    per compressed column of ``fields``: its chunk. What a Writer and a Buffer both make
    before anything is reserved (the chunks' sizes decide what their bytes evict)."""
    from shmbuffer.storage.rows import as_numpy, numpy_dtype

    columns = []
    for f in fields:
        value = leaves[f.key]
        array = as_numpy(value)
        array = np.asarray(value.cpu() if array is None else array, numpy_dtype(f.dtype))
        columns.append(compress_episodes(f, compressors[f.key], array[first_row:], lengths))
    return [list(per_episode) for per_episode in zip(*columns, strict=True)]


def fetch(refs: np.ndarray, store: np.ndarray) -> dict[int, bytes]:
    """The chunks ``refs`` name, copied out of ``store`` by offset: what a reader takes
    before it checks its rows' stamps (a copy, so a later write cannot change it under the
    decompression)."""
    offsets, first = np.unique(refs[:, OFFSET], return_index=True)
    lengths = refs[first, LENGTH]
    return {
        int(o): store[int(o) : int(o) + int(n)].tobytes()
        for o, n in zip(offsets, lengths, strict=True)
    }


def expand(
    field: Field,
    decompress: Callable[[bytes], bytes],
    refs: np.ndarray,
    chunks: Mapping[int, bytes],
    dtype: np.dtype[Any],
) -> np.ndarray:
    """The rows ``refs`` name, ``[len(refs), *field.shape]``, from ``chunks`` (:func:`fetch`);
    each chunk decompressed once. InvalidArgumentError naming the column where a chunk does
    not decompress to whole rows (a chunk read while it was being overwritten)."""
    out = np.empty((len(refs), *field.shape), dtype)
    row_bytes = out[0].nbytes if len(refs) else 0
    for offset, chunk in chunks.items():
        where = np.flatnonzero(refs[:, OFFSET] == offset)
        try:
            raw = decompress(chunk)
        except Exception as exc:  # each codec raises its own error class
            raise InvalidArgumentError(
                f"column {key_str(field.key)!r}: the chunk at byte {offset} does not "
                f"decompress ({exc})"
            ) from None
        if row_bytes == 0 or len(raw) % row_bytes:
            raise InvalidArgumentError(
                f"column {key_str(field.key)!r}: the chunk at byte {offset} holds "
                f"{len(raw)} bytes, not whole rows of {row_bytes}"
            )
        episode = np.frombuffer(raw, dtype).reshape(-1, *field.shape)
        rows = refs[where, ROW]
        if rows.size and int(rows.max()) >= len(episode):
            raise InvalidArgumentError(
                f"column {key_str(field.key)!r}: row {int(rows.max())} of a chunk of {len(episode)}"
            )
        out[where] = episode[rows]
    return out


class ByteStore:
    """The bytes the chunks live in: private memory, or a file beside a named segment's rows
    (``bytes.bin`` in its folder) that other processes map."""

    def __init__(self, nbytes: int, folder: Path | None = None, create: bool = True) -> None:
        if type(nbytes) is not int or nbytes < 1:
            raise InvalidArgumentError(
                f"compressed_bytes must be a positive int (the byte store's size), got {nbytes!r}"
            )
        self.nbytes = nbytes
        self.path = None if folder is None else folder / STORE_FILE
        if self.path is None:
            self.array: np.ndarray = np.zeros(nbytes, np.uint8)
        else:
            mode: Literal["w+", "r+"] = "w+" if create else "r+"
            self.array = np.memmap(self.path, np.uint8, mode, shape=(nbytes,))

    @classmethod
    def attach(cls, folder: Path) -> ByteStore:
        """The byte store a daemon made in ``folder`` (its size is the file's)."""
        return cls((folder / STORE_FILE).stat().st_size, folder, create=False)

    def write(self, offset: int, chunks: Sequence[bytes]) -> list[int]:
        """Copy ``chunks`` in one after another from ``offset``; returns each one's offset."""
        offsets = []
        for chunk in chunks:
            self.array[offset : offset + len(chunk)] = np.frombuffer(chunk, np.uint8)
            offsets.append(offset)
            offset += len(chunk)
        return offsets


def raw_sizes(fields: Sequence[Field]) -> dict[Key, int]:
    """Each compressed column's bytes per row uncompressed."""
    return {f.key: f.raw_nbytes for f in fields}
