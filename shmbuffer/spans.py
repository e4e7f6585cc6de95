"""Two pieces of the registry's uniform row draws (``registry.py``'s docstring says why):
:class:`LiveSpans`, the runs of adjacent live rows a position maps through, and
:func:`uniform_integers`, exact uniform draws from raw generator words.

Thread safety: not thread-safe; the registry's owner serialises calls.
"""

from __future__ import annotations

import bisect

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]


def uniform_integers(rng: np.random.Generator, high: int, n: int) -> I64:
    """``n`` integers drawn uniformly from ``[0, high)``, exactly (``1 <= high < 2**63``).

    ``rng.integers`` does the same in ~7.5 us for 256 of them, most of it argument handling
    (a Python ``np.prod`` of the size); this takes ~5: raw 64-bit words modulo ``high``, where
    the few words at or above the largest multiple of ``high`` (a share below
    ``high / 2**64``) are drawn again, so every residue is equally likely.
    """
    limit = (1 << 64) // high * high
    words = rng.bit_generator.random_raw(n)
    if limit < 1 << 64 and n and int(np.maximum.reduce(words)) >= limit:
        bad = np.flatnonzero(words >= limit)
        while bad.size:
            words[bad] = rng.bit_generator.random_raw(bad.size)
            bad = bad[words[bad] >= limit]
    out: I64 = (words % np.uint64(high)).view(np.int64)
    return out


class LiveSpans:
    """The maximal runs of adjacent live rows: intervals ``[start, end)``, kept sorted.

    Adjacent episodes merge into one span; removing rows splits one. A ring whose writers
    keep up is one or two spans (two while it wraps), plus one more per reservation in
    flight, so a uniform row draw maps a position to a row with an addition or one search
    over a handful of spans instead of one over every episode. O(log S + S) per change
    (a list insert), S spans; the search arrays are rebuilt on the first draw after one.
    """

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._end_of: dict[int, int] = {}  # start -> end
        self._start_of: dict[int, int] = {}  # end -> start
        self._arrays: tuple[I64, I64] | None = None

    @property
    def count(self) -> int:
        return len(self._starts)

    @property
    def first(self) -> int:
        return self._starts[0]

    def add(self, start: int, end: int) -> None:
        """Rows ``[start, end)`` (not live before) become live."""
        self._arrays = None
        left = self._start_of.pop(start, None)  # the span ending where this one starts
        right = self._end_of.pop(end, None)  # the end of the span starting where it ends
        if right is not None:
            del self._start_of[right]
            del self._starts[bisect.bisect_left(self._starts, end)]
        lo = start if left is None else left
        hi = end if right is None else right
        if left is None:
            bisect.insort(self._starts, lo)
        self._end_of[lo] = hi
        self._start_of[hi] = lo

    def remove(self, start: int, end: int) -> None:
        """Rows ``[start, end)`` (live, inside one span) are no longer live."""
        self._arrays = None
        i = bisect.bisect_right(self._starts, start) - 1
        lo = self._starts[i]
        hi = self._end_of.pop(lo)
        del self._start_of[hi]
        if lo < start:
            self._end_of[lo] = start
            self._start_of[start] = lo
            i += 1
        else:
            del self._starts[i]
        if end < hi:
            self._starts.insert(i, end)
            self._end_of[end] = hi
            self._start_of[hi] = end

    def arrays(self) -> tuple[I64, I64]:
        """``(ends, shift)``: running totals of the span lengths, and per span what turns a
        position counted in its running total into a row (its start minus the rows before)."""
        if self._arrays is None:
            starts = np.array(self._starts, dtype=np.int64)
            ends = np.array([self._end_of[s] for s in self._starts], dtype=np.int64)
            total = np.cumsum(ends - starts)
            self._arrays = total, starts - (total - (ends - starts))
        return self._arrays
