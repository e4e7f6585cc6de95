"""Episodes to and from Parquet, laid out as Hugging Face ``datasets`` loads it.

A dataset is a folder::

    data/chunk-000000.parquet   one file per batch of episodes (about 64 MB of rows), in order
    shmbuffer.json              the schema, the files and every episode's metadata

Each file has the columns ``episode_index`` (the episode's place in the dataset, from 0),
``frame_index`` (the step within its episode, from 0) and one column per flattened key of the
buffer's schema (``obs.pos``): a scalar key is a plain column, a vector (one dimension) a
fixed-size list, which ``datasets.load_dataset("parquet", data_files=...)`` sees as a
``Sequence``; a key of two dimensions or more (an image) each row's raw bytes
(``fixed_size_binary``; ``np.frombuffer(row, dtype).reshape(shape)`` with the dtype and shape
of ``shmbuffer.json``), since Parquet's nested lists cost a level per value. The bytes come
back unchanged either way. Files are written uncompressed and without
dictionaries or statistics: an export runs at the disk's speed, and a reader compresses if
it wants to. Every file is fsynced before ``shmbuffer.json`` is written, last: a folder
without it is not a dataset.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from shmbuffer.errors import ConfigError
from shmbuffer.offline.cut import Episode, array_dtype
from shmbuffer.storage.schema import Schema, key_str

META_FILE = "shmbuffer.json"
#: Keys of this many dimensions or more (images) are stored as each row's raw bytes: Parquet
#: writes a nested list with a repetition level per value, 4x the bytes and 10x slower for
#: u8[4,84,84] rows than the bytes as they are (``docs/offline.md``).
DATA = "data"
FORMAT = "shmbuffer-parquet"
VERSION = 1
RAW_FROM_DIMS = 2


def _pyarrow() -> Any:
    try:
        import pyarrow as pa
        import pyarrow.parquet
    except ImportError as exc:
        raise ConfigError(
            "Parquet export and import need pyarrow: pip install 'shmbuffer[offline]'"
        ) from exc
    return pa


def _column(pa: Any, values: np.ndarray) -> Any:
    """An arrow column of ``values`` (rows first): a plain column for scalars, fixed-size
    lists for one dimension, each row's raw bytes for more (:data:`RAW_FROM_DIMS`)."""
    values = np.ascontiguousarray(values)
    if values.ndim - 1 >= RAW_FROM_DIMS:
        width = (
            values[0].nbytes if len(values) else int(np.prod(values.shape[1:])) * values.itemsize
        )
        return pa.FixedSizeBinaryArray.from_buffers(
            pa.binary(width), len(values), [None, pa.py_buffer(values)]
        )
    flat = pa.array(values.reshape(-1))
    for size in reversed(values.shape[1:]):
        flat = pa.FixedSizeListArray.from_arrays(flat, size)
    return flat


def _chunked(pa: Any, parts: list[np.ndarray], shape: tuple[int, ...], dtype: Any) -> Any:
    """A column of ``parts`` (each rows first): raw bytes (:data:`RAW_FROM_DIMS`) as one
    array per part built on its buffer, copied nowhere before Parquet's own write; smaller
    keys joined first (a few bytes a row)."""
    if len(shape) < RAW_FROM_DIMS or not parts:  # no rows: one empty array of the type
        return _column(pa, np.concatenate(parts) if parts else np.empty((0, *shape), dtype))
    return pa.chunked_array([_column(pa, part) for part in parts])


def _array(column: Any, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
    """A column read back as an array of ``shape`` rows of ``dtype``."""
    column = column.combine_chunks() if hasattr(column, "combine_chunks") else column
    if len(shape) >= RAW_FROM_DIMS:
        width = column.type.byte_width
        raw = np.frombuffer(
            column.buffers()[1], np.uint8, count=len(column) * width, offset=column.offset * width
        )
        return raw.view(dtype).reshape(-1, *shape)
    for _ in shape:
        column = column.flatten()
    values = column.to_numpy(zero_copy_only=False)
    return np.asarray(values, dtype=dtype).reshape(-1, *shape)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ParquetWriter:
    """Write episodes to the folder ``path`` (created; refused if it holds a dataset)."""

    def __init__(self, path: str | Path, schema: Schema, source: dict[str, Any]) -> None:
        self.pa = _pyarrow()
        self.path = Path(path).expanduser().absolute()
        if (self.path / META_FILE).exists():
            raise ConfigError(f"{self.path} holds a dataset already ({META_FILE}); pick another")
        (self.path / DATA).mkdir(parents=True, exist_ok=True)
        self.schema, self.source = schema, source
        self.files: list[dict[str, Any]] = []
        self.episodes: list[dict[str, Any]] = []
        self._syncer = ThreadPoolExecutor(1, thread_name_prefix="shmbuffer-export-fsync")
        self._syncs: list[Future[None]] = []

    def _synced(self, path: Path) -> None:
        self._syncs.append(self._syncer.submit(_fsync, path))

    def write(self, batch: list[Episode]) -> int:
        """One file of ``batch``'s episodes; the bytes of rows written."""
        pa = self.pa
        first = len(self.episodes)
        lengths = np.array([ep.length for ep in batch], dtype=np.int64)
        index = np.repeat(np.arange(first, first + len(batch), dtype=np.int64), lengths)
        starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
        frame = np.arange(int(lengths.sum()), dtype=np.int64) - starts
        columns = {"episode_index": pa.array(index), "frame_index": pa.array(frame)}
        parts = getattr(batch, "parts", None)  # a Batch's pieces, views of its chunk files
        for f in self.schema:
            key = key_str(f.key)
            if parts is not None:
                columns[key] = _chunked(pa, parts[key], f.shape, array_dtype(f))
                continue
            joined = getattr(batch, "columns", {}).get(key)  # a Batch read in one piece
            if joined is None:
                joined = np.concatenate([ep.columns[key] for ep in batch])
            columns[key] = _column(pa, joined)
        table = pa.table(columns)
        name = f"{DATA}/chunk-{len(self.files):06d}.parquet"
        pa.parquet.write_table(
            table,
            str(self.path / name),
            compression="none",
            use_dictionary=False,
            write_statistics=False,
        )
        self._synced(self.path / name)
        self.files.append(
            {"path": name, "episodes": [first, first + len(batch)], "rows": int(lengths.sum())}
        )
        for k, ep in enumerate(batch):
            self.episodes.append({"episode_index": first + k, **ep.meta})
        return int(lengths.sum()) * self.schema.row_nbytes

    def close(self, meta_kinds: dict[str, str]) -> Path:
        """Write ``shmbuffer.json`` (the schema, the files, each episode's metadata)."""
        for f in self._syncs:
            f.result()
        self._syncer.shutdown()
        info = {
            "format": FORMAT,
            "version": VERSION,
            "schema": self.schema.to_spec(),
            "meta_kinds": meta_kinds,
            "source": self.source,
            "files": self.files,
            "episodes": self.episodes,
        }
        tmp = self.path / f".{META_FILE}.tmp"
        with open(tmp, "w", encoding="utf-8") as out:
            json.dump(info, out, indent=1)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.path / META_FILE)
        return self.path


class ParquetDataset:
    """A dataset folder written by :class:`ParquetWriter`, read a file at a time."""

    def __init__(self, path: str | Path) -> None:
        self.pa = _pyarrow()
        self.path = Path(path).expanduser().absolute()
        try:
            info = json.loads((self.path / META_FILE).read_text())
        except FileNotFoundError:
            raise ConfigError(
                f"{self.path} is not a shmbuffer Parquet dataset: no {META_FILE} (the schema "
                "and episode metadata an export writes beside the files)"
            ) from None
        except ValueError as exc:
            raise ConfigError(f"{self.path / META_FILE}: {exc}") from exc
        if info.get("format") != FORMAT or info.get("version") != VERSION:
            raise ConfigError(
                f"{self.path / META_FILE}: format {info.get('format')!r} version "
                f"{info.get('version')!r}, this version reads {FORMAT!r} version {VERSION}"
            )
        self.info = info
        self.schema = Schema.from_spec(info["schema"])
        self.meta_kinds: dict[str, str] = dict(info.get("meta_kinds") or {})

    @property
    def num_episodes(self) -> int:
        return len(self.info["episodes"])

    @property
    def nbytes(self) -> int:
        return sum(int(f["rows"]) for f in self.info["files"]) * self.schema.row_nbytes

    def batches(self) -> Iterator[list[Episode]]:
        """The episodes of one file at a time, in order, with their metadata."""
        metas = self.info["episodes"]
        for entry in self.info["files"]:
            path = self.path / entry["path"]
            try:
                table = self.pa.parquet.read_table(path)
            except (OSError, self.pa.ArrowException) as exc:
                raise ConfigError(f"{path}: {exc}") from exc
            missing = [
                key_str(f.key) for f in self.schema if key_str(f.key) not in table.column_names
            ]
            if missing:
                raise ConfigError(f"{path}: no column {missing[0]!r} of the dataset's schema")
            index = _array(table.column("episode_index"), (), np.dtype(np.int64))
            columns = {
                key_str(f.key): _array(table.column(key_str(f.key)), f.shape, array_dtype(f))
                for f in self.schema
            }
            cuts = np.flatnonzero(np.diff(index)) + 1
            bounds = zip(np.r_[0, cuts], np.r_[cuts, len(index)], strict=True)
            batch = []
            for start, stop in bounds:
                meta = metas[int(index[start])] if len(index) else {}
                batch.append(
                    Episode(
                        [(0, int(stop - start))],
                        {k: v for k, v in meta.items() if k != "episode_index"},
                        {k: v[start:stop] for k, v in columns.items()},
                    )
                )
            yield batch


def write_parquet(
    episodes: Iterator[list[Episode]],
    path: str | Path,
    schema: Schema,
    meta_kinds: dict[str, str],
    source: dict[str, Any],
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Write every batch of ``episodes`` to a dataset folder at ``path``; the folder."""
    writer = ParquetWriter(path, schema, source)
    done = 0
    for batch in episodes:
        done += writer.write(batch)
        if progress is not None:
            progress(done)
    return writer.close(meta_kinds)
