"""Two pieces of the registry's uniform row draws (``intervals.py``'s docstring says why):
:class:`LiveSpans`, the runs of adjacent live rows a position maps through, and
:func:`uniform_integers`, exact uniform draws from raw generator words.

Where numba is installed (the ``fast`` extra) a draw over the spans is one compiled call
(``_draw_jit.py``, loaded by :func:`compiled_draws` once a process has drawn :data:`LOAD_AFTER`
times), a fraction of the numpy draw's time (``docs/sampling.md``). Both ways turn the same raw
words into the same rows by the same rule (a modulo, rejecting the words past the last whole
multiple: :func:`uniform_integers`), so which one runs never changes a seeded draw: the compiled one
can be loaded whenever it is ready.

Thread safety: not thread-safe; the registry's owner serialises calls.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from types import ModuleType

import numpy as np
import numpy.typing as npt

from shmbuffer import jit

I64 = npt.NDArray[np.int64]

log = logging.getLogger(__name__)


#: Draws a process makes with numpy before it loads the compiled loop. The load's CPU (numba and
#: LLVM) is repaid after its cost over the time it saves a draw (the figures in ``docs/sampling.md``
#: put that near this count): loading once this many were made (the rent-or-buy rule) never costs
#: more than twice the best choice in hindsight. A process that samples a little (a test, a short
#: benchmark) never pays it; a training run pays it once, in the draw that crosses this count, or on
#: a thread (:func:`load_on_a_thread`). ``load_compiled_draws`` loads at once.
LOAD_AFTER = 50_000


class _Draws:
    """This process's way of drawing (see :func:`compiled_draws`)."""

    kernels: ModuleType | None = None
    calls = 0
    tried = False
    on_a_thread = False


def load_on_a_thread() -> None:
    """Load the compiled draws on a thread of their own when the time comes, not in the draw
    that crosses :data:`LOAD_AFTER`: for a server whose loop must not pause for the load (the
    daemon; its draws stay on numpy until the loops are ready, with the same results). Not
    for a process that may fork: a fork while the thread imports can leave the child's import
    locks held."""
    _Draws.on_a_thread = True


def compiled_draws() -> ModuleType | None:
    """The compiled draw and use count (``_draw_jit.py``) once loaded, else None. Counts the
    draws (each call) and loads the loops at the :data:`LOAD_AFTER`-th; the results are the
    same either way."""
    kernels = _Draws.kernels
    if kernels is None and not _Draws.tried:
        _Draws.calls += 1
        if _Draws.calls >= LOAD_AFTER:
            if _Draws.on_a_thread:
                _Draws.tried = True
                threading.Thread(target=_load, name="shmbuffer-draws-jit", daemon=True).start()
            else:
                kernels = load_compiled_draws()
    return kernels


def loaded_draws() -> ModuleType | None:
    """The compiled loops if this process has loaded them (counts nothing, loads nothing)."""
    return _Draws.kernels


def load_compiled_draws() -> ModuleType | None:
    """Load and run the compiled loops now (once per process), or None: numba is not
    installed, ``SHMBUFFER_JIT=0``, or they cannot be built here (logged once)."""
    if _Draws.tried:
        return _Draws.kernels
    _Draws.tried = True
    return _load()


def _load() -> ModuleType | None:
    kernels = jit.load("shmbuffer.registry._draw_jit")
    if kernels is None:
        return None
    began = time.perf_counter()
    try:  # the argument types the hot paths pass, so the cached machine code is the one used
        out = np.empty(2, dtype=np.int64)
        words = np.array([1, 1 << 63], dtype=np.uint64)
        one = np.zeros(1, dtype=np.int64)
        kernels.span_rows(words, 3, one + 3, one, out)
        kernels.add_one(np.zeros(3, dtype=np.int32), out)
    except Exception as exc:  # an LLVM that cannot build the loops: numpy it is
        log.warning("compiled draws unavailable, sampling with numpy: %s", exc)
        return None
    log.info("compiled draws loaded in %.2f s", time.perf_counter() - began)
    _Draws.kernels = kernels  # last: another thread uses them from here on
    return kernels


def uniform_integers(rng: np.random.Generator, high: int, n: int) -> I64:
    """``n`` integers drawn uniformly from ``[0, high)``, exactly (``1 <= high < 2**63``).

    ``rng.integers`` does the same, but much of its time goes to argument handling (a Python
    ``np.prod`` of the size); this skips it: raw 64-bit words modulo ``high``, where
    the few words at or above the largest multiple of ``high`` (a share below
    ``high / 2**64``) are drawn again (:func:`redraw_rejected`), so every residue is equally
    likely. The compiled loop (``_draw_jit.span_rows``) gives the same values from the same
    words.
    """
    words = rng.bit_generator.random_raw(n)
    if n and int(np.maximum.reduce(words)) >= _limit(high):
        redraw_rejected(rng, words, high)
    out: I64 = (words % np.uint64(high)).view(np.int64)
    return out


def _limit(high: int) -> int:
    """The largest multiple of ``high`` up to ``2**64``: words from it on are drawn again."""
    return (1 << 64) // high * high


def redraw_rejected(rng: np.random.Generator, words: npt.NDArray[np.uint64], high: int) -> None:
    """Draw again, in place and in index order, each word at or above :func:`_limit`, until
    none is left: the one rejection rule of both ways of drawing."""
    limit = _limit(high)
    if limit == 1 << 64:
        return
    bad = np.flatnonzero(words >= limit)
    while bad.size:
        words[bad] = rng.bit_generator.random_raw(bad.size)
        bad = bad[words[bad] >= limit]


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

    def draw(self, rng: np.random.Generator, high: int, n: int) -> I64:
        """``n`` rows drawn uniformly, with replacement, from the ``high`` live rows (the
        spans' total): compiled where :func:`compiled_draws` loads, else numpy."""
        kernels = compiled_draws()
        if kernels is None and self.count == 1:  # no arrays to build: one addition
            pos = uniform_integers(rng, high, n)
            pos += self.first
            return pos
        ends, shift = self.arrays()
        return draw_over(rng, high, ends, shift, n, kernels)

    def runs(self) -> tuple[list[int], list[int]]:
        """``(starts, ends)`` of the spans in row order (the starts are the spans' own list:
        read it, never change it; both are stale after the next change)."""
        starts = self._starts
        end_of = self._end_of
        return starts, [end_of[s] for s in starts]

    def arrays(self) -> tuple[I64, I64]:
        """``(ends, shift)``: running totals of the span lengths, and per span what turns a
        position counted in its running total into a row (its start minus the rows before)."""
        if self._arrays is None:
            starts = np.array(self._starts, dtype=np.int64)
            ends = np.array([self._end_of[s] for s in self._starts], dtype=np.int64)
            total = np.cumsum(ends - starts)
            self._arrays = total, starts - (total - (ends - starts))
        return self._arrays


def draw_over(
    rng: np.random.Generator,
    high: int,
    ends: I64,
    shift: I64,
    n: int,
    kernels: ModuleType | None = None,
) -> I64:
    """``n`` rows drawn uniformly from ``high`` live rows held by spans given as
    :meth:`LiveSpans.arrays` gives them (``ends``: running totals of their lengths, the last
    one ``high``; ``shift``: what turns a position into a row). ``kernels``: the compiled
    loops (:func:`compiled_draws`), or None for numpy; the same rows from the same words
    either way. The registry draws through it, and so does a reader drawing over the spans a
    daemon publishes (``shared_spans.py``)."""
    if kernels is not None:
        words = rng.bit_generator.random_raw(n)
        out = words.view(np.int64)  # in place: a word is read before its row is written
        stop, done = kernels.span_rows(words, high, ends, shift, out), 0
        while stop >= 0:  # a rejected word (a share < high / 2**64): the rest drawn again
            done += stop
            redraw_rejected(rng, words[done:], high)
            stop = kernels.span_rows(words[done:], high, ends, shift, out[done:])
        return out
    pos = uniform_integers(rng, high, n)
    if ends.size == 1:
        pos += int(shift[0])
        return pos
    pos += shift.take(ends.searchsorted(pos, side="right"))
    return pos
