"""The registry's runs of live rows in a small shared file, so that a reader draws uniform rows
itself: the daemon's side (:class:`SpansFile`, which publishes) and a reader's
(:class:`SpansView`, which draws), and the seqlock between them.

The live rows of a ring are a few runs (:class:`~shmbuffer.registry.spans.LiveSpans`: one or two,
plus one per reservation in flight). The daemon writes them to ``spans.bin`` beside the
segment's data after every change of its registry, *before* it bumps the generation stamps of a
reservation's rows and before the reply hands those rows to a writer. A reader copies them,
draws its rows uniformly over them (:func:`~shmbuffer.registry.spans.draw_over`, the registry's
own draw), reads the drawn rows' stamps and checks that no publication began meanwhile; then
it gathers the rows and checks their stamps again, as after a draw of the daemon's. Why that
hands out only whole committed rows is argued in ``docs/architecture.md`` ("Local draws").

Layout: :data:`WORDS` int64 words in the machine's byte order, as the segment's stamps.

=========================  =====================================================================
word                       meaning
=========================  =====================================================================
0                          sequence number: odd while the daemon writes, even when whole
1                          live rows (the runs' total)
2                          1 where a reader may draw rows itself now, else 0 (ask the daemon)
3                          number of runs, at most :data:`MAX_RUNS`
4                          :data:`FORMAT`
5..7                       0
8 .. 8 + MAX_RUNS          first row of each run, in row order
8 + MAX_RUNS .. 8 + 2 MAX  row after the last of each run
=========================  =====================================================================

The file is written in place, never replaced: a reader maps it once, and a daemon resumed on
the same segment publishes into the mapping its readers hold.

Thread safety: one writer (the daemon loop). A view is used by one thread at a time.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

import numpy as np
import numpy.typing as npt

from shmbuffer.registry.spans import draw_over

I64 = npt.NDArray[np.int64]

#: The file's name in the segment's folder.
SPANS_FILE = "spans.bin"
#: Runs the file holds; a registry with more (a ring full of holes) is published closed: its
#: readers ask the daemon, as the registry itself then draws through its episode totals.
MAX_RUNS = 64
FORMAT = 1
_HEADER = 8
WORDS = _HEADER + 2 * MAX_RUNS
SIZE = WORDS * 8
_SEQ, _LIVE, _OPEN, _COUNT, _FORMAT = 0, 1, 2, 3, 4
_STARTS = _HEADER
_ENDS = _HEADER + MAX_RUNS
#: Copies a reader tries while the daemon publishes under it before it asks the daemon.
TRIES = 8


class SpansFile:
    """The daemon's side: ``spans.bin`` at ``path``, created (``file_mode``, chowned to
    ``group``) or opened in place, mapped read-write. OSError where it cannot be."""

    def __init__(self, path: Path, file_mode: int = 0o600, group: int | None = None) -> None:
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = os.open(path, flags, file_mode)
        try:
            os.fchmod(fd, file_mode)
            if group is not None:
                os.fchown(fd, -1, group)
            if os.fstat(fd).st_size < SIZE:
                os.posix_fallocate(fd, 0, SIZE)  # on tmpfs: no SIGBUS under the mapping later
            self._mm = mmap.mmap(fd, SIZE, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.path = path
        # Word stores through a memoryview: a fraction of numpy's cost per scalar store, on
        # a path every reservation and commit takes.
        self._words = memoryview(self._mm).cast("q")

    def publish(self, starts: Sequence[int], ends: Sequence[int], live: int, open_: bool) -> None:
        """Publish the runs ``[starts[i], ends[i])`` holding ``live`` rows; ``open_``: readers
        may draw over them now. More than :data:`MAX_RUNS` runs are published closed. Each
        store below is one aligned word, in program order (what a reader relies on)."""
        words = self._words
        seq = (words[_SEQ] + 1) | 1  # odd, and not the value a reader saw before
        words[_SEQ] = seq
        count = len(starts)
        if count > MAX_RUNS:
            count, open_ = 0, False
        words[_LIVE] = live
        words[_OPEN] = 1 if open_ and live > 0 else 0
        words[_COUNT] = count
        words[_FORMAT] = FORMAT
        for i in range(count):
            words[_STARTS + i] = starts[i]
            words[_ENDS + i] = ends[i]
        words[_SEQ] = seq + 1

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Keep the sequence number odd while the block runs (a rewrite in place: committed
        rows' stamps and bytes change under it): a reader cannot finish a draw meanwhile, so
        none reads a stamp the rows carry while their bytes are half changed. It draws again,
        or asks the daemon, which answers once the block is done. The runs stay as they are."""
        words = self._words
        seq = (words[_SEQ] + 1) | 1
        words[_SEQ] = seq
        try:
            yield
        finally:
            words[_SEQ] = seq + 1

    def close(self) -> None:
        self._words.release()
        self._mm.close()


class SpansView:
    """A reader's side: ``spans.bin`` at ``path`` mapped read-only (OSError where it cannot
    be; None from :meth:`open` where it is not a file of this format)."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            if os.fstat(fd).st_size < SIZE:
                raise OSError(f"{path} is shorter than {SIZE} bytes")
            self._mm = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self._words: I64 = np.frombuffer(self._mm, dtype=np.int64)
        #: ``(seq, live, ends, shift)``: the last publication copied, as a draw maps through
        #: it (:meth:`LiveSpans.arrays`); one tuple, replaced whole.
        self._copy: tuple[int, int, I64, I64] | None = None
        self._closed = -1  # the last publication found closed

    @classmethod
    def open(cls, path: Path) -> SpansView | None:
        try:
            view = cls(path)
        except OSError:
            return None
        return view

    def draw(
        self,
        rng: np.random.Generator,
        n: int,
        stamps: I64,
        kernels: ModuleType | None = None,
    ) -> tuple[I64, I64, int] | None:
        """``n`` rows drawn uniformly from the published live rows, their ``stamps`` (the
        segment's generation stamps) as read while those rows were certainly live, and the
        number of live rows: ``(rows, generations, live)``. None where the reader must ask
        the daemon: the daemon says so (sampler, rate limiter, too many runs), nothing is
        live, or publications kept coming for :data:`TRIES` copies. The caller then gathers
        the rows and compares their stamps with these, as after a daemon's draw."""
        words = self._words
        for _ in range(TRIES):
            seq = int(words[_SEQ])
            if seq & 1:
                continue
            if seq == self._closed:
                return None
            copy = self._copy
            if copy is None or copy[0] != seq:
                copy = self._take(seq)
                if copy is None:
                    if int(words[_SEQ]) == seq:
                        self._closed = seq  # a whole publication that says: ask the daemon
                        return None
                    continue
            _, live, ends, shift = copy
            rows = draw_over(rng, live, ends, shift, n, kernels)
            gens = stamps.take(rows)
            if int(words[_SEQ]) == seq:  # no publication began: every row was live throughout
                return rows, gens, live
        return None

    def _take(self, seq: int) -> tuple[int, int, I64, I64] | None:
        """Copy publication ``seq`` as a draw maps through it, kept for the next draws (a copy
        taken while a publication began is never used: the caller's second read of the
        sequence number sees it, and the number never comes back); None where it is closed
        or empty, or torn."""
        snap = self._words.copy()
        count = int(snap[_COUNT])
        live = int(snap[_LIVE])
        if not snap[_OPEN] or snap[_FORMAT] != FORMAT or not 0 < count <= MAX_RUNS or live <= 0:
            return None
        starts = snap[_STARTS : _STARTS + count]
        lengths = snap[_ENDS : _ENDS + count] - starts
        ends = np.cumsum(lengths)
        if int(ends[-1]) != live or (lengths <= 0).any():
            return None  # torn: a publication began during the copy (the caller reads again)
        copy = (seq, live, ends, starts - (ends - lengths))
        self._copy = copy
        return copy

    def close(self) -> None:
        del self._words
        self._mm.close()
