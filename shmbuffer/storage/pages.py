"""Reserving a mapping's pages now, with the page size that this machine populates faster.

``madvise`` goes through ctypes: a foreign call releases the GIL for the seconds a large
populate takes (``mmap.madvise`` holds it, and Python 3.11's mmap module lacks the name
``MADV_POPULATE_WRITE``).

Which page size is faster to populate depends on the machine, by a wide margin either way:
in private memory 2 MiB pages populated several times *slower* than 4 KiB ones on one VM and
clearly *faster* on another (figures in ``docs/architecture.md``). So :func:`populate_private`
measures: it populates slices with each page size and gives the rest huge pages unless they
were clearly slower. Huge pages also spare the learner's gathers TLB misses (a small-row
``sample(256)`` got faster with them). Only private memory is probed: tmpfs takes huge
pages only when mounted so (``huge=within_size``), which the kernel decides, not ``madvise``.
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

__all__ = ["POPULATE_WRITE", "madvise", "populate", "populate_private", "prefer_huge"]

POPULATE_WRITE = 23  # MADV_POPULATE_WRITE, Linux >= 5.14
_HUGEPAGE = 14  # MADV_HUGEPAGE
_HUGE = 2 * 2**20
#: Bytes populated with each page size by the probe: a few milliseconds each, yet large
#: enough that the noise stays far below the margin between the two ways.
PROBE_BYTES = 32 * 2**20
#: Mappings smaller than this are populated without a probe (it would be most of the work).
PROBE_MIN_BYTES = 8 * PROBE_BYTES
#: How much slower than small ones huge pages may populate and still be taken: they spare
#: every later read of the rows TLB misses, so a tie goes to them.
HUGE_MARGIN = 1.1
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def madvise(address: int, size: int, advice: int) -> None:
    """``madvise(2)``; OSError with the errno when it fails."""
    if _libc.madvise(address, size, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise({advice}): {os.strerror(err)}")


def populate(address: int, size: int) -> None:
    """Fault every page of ``[address, address + size)`` in for writing. OSError: EINVAL where
    the kernel lacks MADV_POPULATE_WRITE (< 5.14), ENOMEM/EFAULT where a page cannot be had."""
    madvise(address, size, POPULATE_WRITE)


def prefer_huge(small_seconds: float, huge_seconds: float) -> bool:
    """Whether huge pages populated about as fast as small ones in the probe, or faster."""
    return huge_seconds <= small_seconds * HUGE_MARGIN


def populate_private(address: int, size: int) -> bool:
    """Populate a private anonymous mapping, advising huge pages where the probe found them
    no slower to populate here (:func:`prefer_huge`); returns whether it did. Where the kernel
    leaves the choice to ``madvise`` (``transparent_hugepage/enabled`` = madvise) and the
    mapping is large; else a plain :func:`populate`. OSError as :func:`populate`.

    The probe populates four slices of :data:`PROBE_BYTES` at the start, small and huge pages
    in turn, and compares the faster of each pair (one slice alone was once well off its
    usual time); the probed pages are the mapping's own, so the probe costs nothing but a decision.
    """
    if size < PROBE_MIN_BYTES or _thp_setting() != "madvise":
        populate(address, size)
        return False
    aligned = -(-address // _HUGE) * _HUGE
    bounds = [address, *(aligned + k * PROBE_BYTES for k in range(1, 5))]
    small: list[float] = []
    huge: list[float] = []
    for k in range(4):
        start, stop = bounds[k], bounds[k + 1]
        if k % 2:
            madvise(start, stop - start, _HUGEPAGE)
        seconds = _timed_populate(start, stop - start) * PROBE_BYTES / (stop - start)
        (huge if k % 2 else small).append(seconds)
    chosen = prefer_huge(min(small), min(huge))
    rest, end = bounds[4], address + size
    if chosen:
        madvise(rest, end - rest, _HUGEPAGE)
    populate(rest, end - rest)
    return chosen


def _timed_populate(address: int, size: int) -> float:
    start = time.perf_counter()
    populate(address, size)
    return time.perf_counter() - start


def _thp_setting() -> str | None:
    """The bracketed word of ``transparent_hugepage/enabled`` (always, madvise, never)."""
    try:
        text = _THP_SETTING.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None
