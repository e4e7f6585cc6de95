"""Generation stamps: one int64 per row, after the columns (``segment.generations``), that
tell a reader whether a row it copied was handed to a writer meanwhile.

The rule every owner follows when it hands rows to a writer: **one reservation, one stamp**.
Every row of the reservation gets the same value, one above the largest stamp any of them had.
So a row's stamp only ever grows (a copy whose rows still carry the stamps seen before it was
not overwritten during it), and rows that carry the same stamp as a drawn row and lie inside
its episode as the draw saw it were written together with it: a read that reaches past the
drawn row (the frames of a stack before it, the steps of an n-step return after it, a later
goal of the same episode) checks those rows against the drawn row's one stamp, with no stamp
of their own to be sent.

An aborted reservation that touched nothing publishes again the episodes it evicted; the part
of such an episode it had stamped moved, the rest did not. :func:`restamp_restored` gives each
such episode (its tail row too) one stamp again, its largest: the rows' bytes did not change,
and a reader holding an older stamp of them only copies them again.

A rewrite of committed rows in place (the daemon's ``rewrite``) gives the whole episodes those
rows lie in (their tail rows too) one new stamp, above every old stamp of them, *before* the
bytes change: a reader that copied any of them under the old stamp copies them again, and the
rows of one episode keep one stamp between them (:func:`stamp_reservation` of their ranges).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["restamp_restored", "stamp_reservation"]


def stamp_reservation(generations: npt.NDArray[np.int64], ranges: Sequence[tuple[int, int]]) -> int:
    """Give every row of ``ranges`` (a reservation's physical ranges) one new stamp, above the
    old stamp of each, and return it."""
    top = max((int(generations[s:e].max()) for s, e in ranges if e > s), default=0)
    stamp = top + 1
    for start, stop in ranges:
        generations[start:stop] = stamp
    return stamp


def restamp_restored(
    generations: npt.NDArray[np.int64], episodes: Sequence[tuple[int, int]], tail: int = 0
) -> None:
    """One stamp again for each episode ``(start, end)`` an abort published again, and its
    ``tail`` rows after it (where the ring's end wraps them to row 0)."""
    capacity = len(generations)
    for start, end in episodes:
        rows = np.arange(start, end + tail) % capacity
        generations[rows] = generations[rows].max()
