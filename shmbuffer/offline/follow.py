"""A checkpoint read while the daemon writes it: a live export converts each chunk file as
soon as the copy has finished it, instead of after the whole cut.

The checkpoint job writes, in its temp folder ``<dest>/.tmp-<uuid>/``, the manifest and the
cut's state first, then makes ``chunks/`` and writes the chunk files one after another in copy
order (from the ring's write cursor round: the oldest rows first, the order episodes are
exported in), each file growing from its start to its full size (``checkpoint_layout``). So
the episodes are known once ``chunks/`` exists, and a chunk file of its full size holds its
rows as at the cut. The folder is renamed to ``<dest>/checkpoint`` when complete; descriptors
opened before stay valid, and a file not opened yet is looked for there. The spool is a fresh
folder, so no chunk is hard-linked from an earlier checkpoint.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from shmbuffer.daemon.checkpoint import CHUNKS, COMPLETE, CURRENT, STATE
from shmbuffer.daemon.checkpoint_layout import ChunkLayout
from shmbuffer.errors import CheckpointError
from shmbuffer.offline.cut import CheckpointEpisodes
from shmbuffer.storage.segment import MANIFEST

#: Seconds between looks at the folder while the copy has not reached what is wanted.
POLL_S = 0.002


class FollowedCheckpoint(CheckpointEpisodes):
    """The episodes of the checkpoint being written into ``dest`` (``pending``: the
    ``checkpoint`` request's reply, whose error ends the wait); CheckpointError if the copy
    has not reached a chunk within ``timeout`` seconds of the start."""

    def __init__(self, dest: Path, pending: Future[dict[str, Any]], timeout: float) -> None:
        self.dest, self.pending = dest, pending
        self.deadline = time.monotonic() + timeout
        self._finished_looks = 0
        self.table: dict[str, Any] = {}
        while (found := self._started()) is None:
            self._poll("the cut's state")
        self._open(*found, ChunkLayout.of(found[1]))

    def _started(self) -> tuple[Path, dict[str, Any], dict[str, Any]] | None:
        """The folder being written (or already published), its manifest and its state."""
        candidates = [p for p in self.dest.glob(".tmp-*") if (p / CHUNKS).is_dir()]
        if (self.dest / CURRENT / COMPLETE).is_file():
            candidates.append(self.dest / CURRENT)
        for folder in candidates:
            try:
                manifest = json.loads((folder / MANIFEST).read_text())
                state = json.loads((folder / STATE).read_text())
            except FileNotFoundError:  # published meanwhile: found there next time
                continue
            return folder, manifest, state
        return None

    def _open_chunk(self, chunk: int) -> int:
        """Chunk file ``chunk`` once the copy has written all of it."""
        want = self.layout.chunk_nbytes(chunk)
        fd = None
        try:
            while True:
                if fd is None:
                    fd = self._find(chunk)
                if fd is not None and os.fstat(fd).st_size >= want:
                    found, fd = fd, None
                    return found
                self._poll(f"chunk file {chunk}")
        finally:
            if fd is not None:
                os.close(fd)

    def _find(self, chunk: int) -> int | None:
        for folder in (self.folder, self.dest / CURRENT):
            for path in (folder / CHUNKS).glob(f"{chunk:06d}-*.bin"):
                try:
                    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:  # renamed into place between the look and the open
                    continue
        return None

    def _poll(self, what: str) -> None:
        """Wait a little for the copy; raise its error if it failed, or CheckpointError if
        it finished (looked at once more after) or the time is up without ``what``."""
        if self.pending.done():
            self.pending.result()
            self._finished_looks += 1
            if self._finished_looks > 1:
                raise CheckpointError(f"checkpoint in {self.dest} finished without {what}")
        elif time.monotonic() > self.deadline:
            raise CheckpointError(f"checkpoint in {self.dest}: {what} not written in time")
        time.sleep(POLL_S)
