"""``export``: a live daemon's episodes, or a checkpoint folder's, to Parquet or Minari.

A live buffer is exported from a checkpoint the daemon writes for it into a spool folder,
removed afterwards. Why a checkpoint and not a Reader's leased episode reads: the checkpoint
is the consistent cut (exactly the rows committed at one instant, taken in about a
millisecond of the loop) and its copy never pauses writers: the loop saves, copy-on-write,
only the rows a reservation is about to hand out before the copy reached them. Leasing
episodes instead would hold back every writer about to lap a leased episode for as long as
the export takes to reach it, and would still not be a cut: episodes committed or evicted
meanwhile would be in or out by chance. The spool goes, by default, beside the buffer's own
segment (tmpfs: the copy is a memory copy, and the disk is written once, by the export),
else (not room for the rows there) beside the destination; ``spool=`` chooses.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from shmbuffer.errors import ConfigError
from shmbuffer.offline.cut import Batch, CheckpointEpisodes
from shmbuffer.offline.follow import FollowedCheckpoint
from shmbuffer.storage import progress as bars

T = TypeVar("T")
KINDS = ("parquet", "minari")
SPOOL_PREFIX = "shmbuffer-export-"


def parse_target(spec: str, flag: str = "--to") -> tuple[str, str]:
    """``parquet:DIR`` or ``minari:DATASET_ID`` as ``(kind, where)``; ConfigError otherwise."""
    kind, sep, where = spec.partition(":")
    if not sep or kind not in KINDS or not where:
        raise ConfigError(f"{flag} {spec!r}: expected parquet:DIR or minari:DATASET_ID")
    return kind, where


def export_checkpoint(
    path: str | Path, to: str, *, source: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Export the complete checkpoint at ``path`` to ``to`` (:func:`parse_target`), a batch
    of episodes at a time, with a progress bar on a terminal; what was written."""
    kind, where = parse_target(to)
    t0 = time.perf_counter()
    with CheckpointEpisodes(path) as cut:
        return _convert(cut, kind, where, dict(source or {}), t0)


def _convert(
    cut: CheckpointEpisodes,
    kind: str,
    where: str,
    source: dict[str, Any],
    t0: float,
    finish: Callable[[], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """``cut``'s episodes written as ``kind`` to ``where``; ``finish`` is called after the
    last batch is read, and what it returns joins the dataset's ``source`` record."""
    info = {
        "checkpoint": str(cut.folder),
        "capacity": cut.capacity,
        "unit": cut.unit,
        "mode": cut.mode,
        "created": cut.state.get("created"),
        **source,
    }

    def batches() -> Iterator[Batch]:
        # Parquet takes the rows as views of the chunk files; Minari, joined per episode.
        yield from cut.batches(joined=kind != "parquet")
        if finish is not None:
            info.update(finish())  # before the writer's close, which records ``info``

    update, close = bars.copy_progress(f"export to {kind}", cut.nbytes)
    try:
        if kind == "parquet":
            from shmbuffer.offline.parquet import write_parquet

            out = str(
                write_parquet(
                    read_ahead(batches()), where, cut.schema, cut.meta_kinds, info, update
                )
            )
        else:
            from shmbuffer.offline.minari import write_minari

            out = write_minari(
                read_ahead(batches()), where, cut.schema, cut.meta_kinds, info, update
            )
    finally:
        close()
    return {
        "to": out,
        "kind": kind,
        "episodes": len(cut.episodes),
        "bytes": cut.nbytes,
        "seconds": time.perf_counter() - t0,
    }


def export_live(
    name: str,
    to: str,
    *,
    spool: str | Path | None = None,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Export the buffer a daemon serves as ``name``: a checkpoint into a spool folder (the
    cut; writers go on), each chunk file converted as soon as the copy has written it
    (:class:`~shmbuffer.offline.follow.FollowedCheckpoint`); the spool is removed either
    way. ``seconds`` counts both."""
    from shmbuffer.clients.admin import checkpoint

    kind, where = parse_target(to)
    t0 = time.perf_counter()
    segment, total = _segment_of(name, timeout)
    parent = Path(spool) if spool is not None else _spool_parent(segment, total, kind, where)
    parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=SPOOL_PREFIX, dir=parent))
    try:
        # The pool's exit waits for the checkpoint, also after a failed conversion: the
        # spool is removed only once the daemon has stopped writing into it.
        with ThreadPoolExecutor(1, thread_name_prefix="shmbuffer-export-cut") as pool:
            pending = pool.submit(checkpoint, name, folder, timeout=timeout)

            def finish() -> dict[str, Any]:
                return {"cut_pause_ms": pending.result()["max_pause_ms"]}

            with FollowedCheckpoint(folder, pending, timeout) as cut:
                result = _convert(cut, kind, where, {"name": name}, t0, finish)
            reply = pending.result()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result["cut_seconds"] = reply["seconds"]
    result["seconds"] = time.perf_counter() - t0
    return result


def read_ahead(batches: Iterator[T]) -> Iterator[T]:
    """``batches``, the next one read on a thread while the caller writes this one: the
    reads (``preadv``) and Parquet's writes both release the GIL, so on two cores the
    export takes about the longer of the two instead of their sum. At most two batches are
    in memory."""
    with ThreadPoolExecutor(1, thread_name_prefix="shmbuffer-export-read") as pool:
        ahead = pool.submit(next, batches, None)
        while (batch := ahead.result()) is not None:
            ahead = pool.submit(next, batches, None)
            yield batch


def _segment_of(name: str, timeout: float) -> tuple[Path | None, int]:
    """The folder of the daemon's segment and its rows' bytes (0 where unknown)."""
    from shmbuffer.clients.connection import Connection

    conn = Connection(name, "admin", timeout=min(timeout, 10.0))
    try:
        segment = conn.call("stats")["stats"].get("segment") or {}
    finally:
        conn.close()
    path = segment.get("path")
    try:
        total = sum(p.stat().st_size for p in Path(path).glob("data.bin")) if path else 0
    except OSError:
        total = 0
    return (Path(path) if path else None), total


def _spool_parent(segment: Path | None, total: int, kind: str, where: str) -> Path:
    """Beside the segment where its file system has room for the rows again (and a tenth),
    else beside the destination (a Parquet folder's parent; Minari's datasets folder)."""
    if segment is not None:
        root = segment.parent
        try:
            st = os.statvfs(root)
            if st.f_bavail * st.f_frsize > total * 1.1:
                return root
        except OSError:
            pass
    if kind == "parquet":
        return Path(where).expanduser().absolute().parent
    return Path(tempfile.gettempdir())


def describe(result: dict[str, Any]) -> str:
    """The line the command line prints for ``result``."""
    rate = result["bytes"] / max(result["seconds"], 1e-9) / 1e9
    return (
        f"exported {result['episodes']} episodes ({result['bytes'] / 1e6:.1f} MB of rows) to "
        f"{result['kind']} {result['to']} in {result['seconds']:.2f}s ({rate:.2f} GB/s)"
    )
