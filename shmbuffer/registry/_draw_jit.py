"""The uniform row draw and the use count, compiled by numba (the optional ``fast`` extra).

Imported only through :func:`shmbuffer.registry.spans.compiled_draws` (``jit.load``). A uniform
``sample(256)`` is a handful of numpy calls, each with a fixed cost whatever their size: raw
words, their largest (the rejection check), a 64-bit modulo (mostly division), a search over the
spans, an addition, and ``np.add.at`` for the use counts. Here the draw is one call and the
count another, each a fraction of those calls (figures in ``docs/sampling.md``).

* :func:`span_rows`: ``w mod high`` for each raw word ``w``, the words at or above the largest
  multiple of ``high`` below ``2**64`` rejected (a share below ``high / 2**64``), exactly as
  ``spans.uniform_integers`` does with numpy, so both give the same rows from the same words
  and a process may switch to this loop at any time. The modulo is a multiplication: the
  quotient from the upper half of ``w * floor((2**64 - 1) / high)`` (a 128-bit product of
  32-bit halves) is at most two short, so the remainder needs at most two subtractions (a
  hardware 64-bit division was most of the loop's time; this a fraction of it). The row is
  then mapped through the spans' running totals by binary search, as ``LiveSpans`` does with
  ``searchsorted``.
* :func:`add_one`: ``counts[rows] += 1`` with repeats counted, as ``np.add.at``, bounds checked.

Thread safety: pure functions of their arguments; the registry's owner serialises calls.
"""

from __future__ import annotations

import numba
import numpy as np

_LOW = np.uint64(0xFFFFFFFF)
_HALF = np.uint64(32)


@numba.njit(cache=True, nogil=True)
def span_rows(
    words: np.ndarray, high: int, ends: np.ndarray, shift: np.ndarray, out: np.ndarray
) -> int:  # pragma: no cover - compiled; tested through LiveSpans.draw
    """``out[i]``: the row of position ``words[i] mod high`` among ``high`` live rows, where
    span ``k`` holds positions ``[ends[k-1], ends[k])`` and adds ``shift[k]``. Returns -1, or
    the index ``i`` of the first word rejected: ``out[:i]`` is done, the caller draws the
    rejected words of ``words[i:]`` again (``spans.redraw_rejected``) and calls again for the
    rest. ``out`` may be ``words`` itself (each word is read first). (The two constants are
    worked out here: passed from Python as numbers above ``2**63``, each call spent time
    making them numpy scalars, and far more typing them as plain ints.)"""
    h = np.uint64(high)
    ones = np.uint64(0xFFFFFFFFFFFFFFFF)
    magic = ones // h  # floor((2**64 - 1) / high)
    # the largest word kept: the last whole multiple of high up to 2**64, less one
    last_ok = ones if ones - magic * h == h - np.uint64(1) else magic * h - np.uint64(1)
    m_lo = magic & _LOW
    m_hi = magic >> _HALF
    last = ends.size - 1
    for i in range(words.size):
        w = words[i]
        if w > last_ok:
            return i
        w_lo = w & _LOW
        w_hi = w >> _HALF
        low_low = w_lo * m_lo
        high_low = w_hi * m_lo
        cross = (low_low >> _HALF) + (high_low & _LOW) + w_lo * m_hi
        remainder = w - ((high_low >> _HALF) + (cross >> _HALF) + w_hi * m_hi) * h
        while remainder >= h:
            remainder -= h
        position = np.int64(remainder)
        lo = 0
        hi = last
        while lo < hi:
            mid = (lo + hi) >> 1
            if ends[mid] <= position:
                lo = mid + 1
            else:
                hi = mid
        out[i] = position + shift[lo]
    return -1


@numba.njit(cache=True, nogil=True)
def add_one(counts: np.ndarray, rows: np.ndarray) -> int:  # pragma: no cover - compiled
    """``counts[rows[i]] += 1`` for every ``i``, repeats included. Returns -1, or the index of
    the first row outside ``[0, counts.size)`` (nothing from it on is counted: numba does not
    check bounds, so this loop does)."""
    size = counts.size
    for i in range(rows.size):
        row = rows[i]
        if row < 0 or row >= size:
            return i
        counts[row] += 1
    return -1
