"""The uniform row draw and the use count, compiled by numba (the optional ``fast`` extra).

Imported only through :func:`shmbuffer.spans.compiled_draws` (``jit.load``). A uniform
``sample(256)`` is a handful of numpy calls of ~2-5 us each, whatever their size: raw words,
their largest (the rejection check), a 64-bit modulo (~4 us of division alone), a search over
the spans, an addition, and ``np.add.at`` for the use counts. Here the draw is one call and the
count another, ~1.5 us each beside the raw words.

* :func:`span_rows`: Lemire's multiply-shift, exact: ``high * w`` as a 128-bit product of 32-bit
  halves, the row position its upper 64 bits, a word rejected when the lower 64 bits fall under
  ``2**64 mod high`` (a share below ``high / 2**64``: the division that threshold needs runs
  only for a lower half under ``high``). The position is mapped through the spans' running
  totals by binary search, as ``LiveSpans`` does with ``searchsorted``. The rows are exactly
  those of ``spans.uniform_integers`` from the same words (a test holds them equal), so a
  process may switch to this loop at any time.
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
    """``out[i]``: the row of position ``floor(words[i] * high / 2**64)`` among ``high`` live
    rows, where span ``k`` holds positions ``[ends[k-1], ends[k])`` and adds ``shift[k]``.
    Returns -1, or the index ``i`` of the first rejected word: ``out[:i]`` is done, the
    caller draws the rejected words of ``words[i:]`` again (``spans.redraw_rejected``) and
    calls again for the rest. ``out`` may be ``words`` itself (each word is read first)."""
    h = np.uint64(high)
    h_lo = h & _LOW
    h_hi = h >> _HALF
    last = ends.size - 1
    for i in range(words.size):
        w = words[i]
        w_lo = w & _LOW
        w_hi = w >> _HALF
        low_low = w_lo * h_lo
        high_low = w_hi * h_lo
        cross = (low_low >> _HALF) + (high_low & _LOW) + w_lo * h_hi
        upper = (high_low >> _HALF) + (cross >> _HALF) + w_hi * h_hi
        lower = (cross << _HALF) | (low_low & _LOW)
        if lower < h and lower < (np.uint64(0) - h) % h:
            return i
        position = np.int64(upper)
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
