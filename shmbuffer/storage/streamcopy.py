"""Copies into the ring that bypass the CPU caches: the writer's one hot loop.

:func:`copy_into` is ``np.copyto(dst, src, casting="unsafe")``, except that a large copy of
one dtype between contiguous arrays goes through streaming (non-temporal) stores when the
``fast`` extra (numba) is installed: see ``_copy_jit.py``. Measured here (2 cores, 4 KB
tmpfs pages): a 5.6 MB image episode into a ring in 0.6-0.85 ms instead of
np.copyto's 1.0-1.2 ms, and the writer's next small steps on warm caches. glibc's ``memcpy``
streams only above a cut-off derived from the cache sizes (above such an episode), and
cannot know that rows written into a ring are read laps later, if at all, from another
process.

Below :data:`STREAM_MIN_BYTES` plain stores win (the destination's lines may still be in the
cache, and the call costs a few microseconds). A learner's batch of large rows streams too
(:func:`gather_into`, :func:`copy_out`): it is read right after, but at 7 MB for 256 image rows
it does not stay in the caches anyway, and streamed it was ready sooner, which a float
conversion right after did not take back (figures in ``docs/architecture.md``).
``SHMBUFFER_JIT=0`` turns every compiled kernel off, this one too.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from types import ModuleType
from typing import Any

import numpy as np

from shmbuffer import jit

__all__ = [
    "GATHER",
    "STREAM_MIN_BYTES",
    "STREAM_ROW_BYTES",
    "GatherTrial",
    "copy_into",
    "copy_out",
    "gather_into",
    "kernels",
    "warm",
]

#: Smallest copy that streams (about 9 image rows of 28 KB).
STREAM_MIN_BYTES = 256 * 1024
#: Rows of at least this size are worth loading the loop for (:func:`warm`): any episode of
#: them is a large copy. Small rows were no faster streamed, within the noise
#: (their staged batches come from a staging area still in the cache).
STREAM_ROW_BYTES = 4096
_PAGE = 4096
_LINE = 64  # a fresh gather's alignment: the loop's aligned stores need 32


class _Loop:
    """The loaded loop, once :func:`warm` ran it: copies stream only from then on; or why it
    could not be compiled here (copies then keep numpy)."""

    compiled: ModuleType | None = None
    failed: str | None = None


@functools.cache
def kernels() -> ModuleType | None:
    """The compiled loop (``_copy_jit.py``), or None: numba is not installed (the ``fast``
    extra), or ``SHMBUFFER_JIT=0`` asks for numpy."""
    return jit.load("shmbuffer.storage._copy_jit")


def warm(row_nbytes: int | None = None) -> bool:
    """Load the compiled loop and run it once, so that :func:`copy_into` streams from now
    on in this process; with ``row_nbytes``, only for rows of :data:`STREAM_ROW_BYTES` or
    more. Writers call it where they attach (a noticeable pause the first time in a process,
    its machine code cached on disk after the first compile), not on their first write.
    Returns whether copies stream."""
    if _Loop.compiled is None and _Loop.failed is None:
        if row_nbytes is not None and row_nbytes < STREAM_ROW_BYTES:
            return False
        compiled = kernels()
        if compiled is not None:  # the first call compiles, or loads the cached code
            source = np.ones(3 * compiled.BLOCK, np.uint8)
            target = np.zeros(3 * compiled.BLOCK, np.uint8)
            rows = np.array([1, 0], dtype=np.int64)
            gathered = np.zeros(2 * compiled.BLOCK + 1, np.uint8)
            try:
                _stream(compiled, target[1:], source[1:])
                _gather(compiled, source.reshape(3, -1), rows, gathered[1:].reshape(2, -1))
            except Exception as exc:  # a numba or LLVM that cannot build it
                _Loop.failed = f"{type(exc).__name__}: {exc}"
                return False
            if not np.array_equal(target[1:], source[1:]) or gathered[1:].sum() != 128:
                _Loop.failed = "the compiled loop copied wrong bytes"
                return False
            _Loop.compiled = compiled
    return _Loop.compiled is not None


def copy_into(dst: np.ndarray, src: Any) -> None:
    """Copy ``src`` into ``dst`` as ``np.copyto(dst, src, casting="unsafe")`` does (the
    caller validated the cast), streaming a large same-dtype contiguous copy once
    :func:`warm` has loaded the loop."""
    compiled = _Loop.compiled
    if (
        compiled is not None
        and type(src) is np.ndarray
        and src.dtype == dst.dtype
        and src.shape == dst.shape
        and dst.nbytes >= STREAM_MIN_BYTES
        and dst.flags.c_contiguous
        and src.flags.c_contiguous
        and not np.may_share_memory(dst, src)
    ):
        _stream(compiled, dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8))
        return
    np.copyto(dst, src, casting="unsafe")


class GatherTrial:
    """Whether a large gather streams in this process, decided from its first
    :data:`TRIAL_CALLS` large gathers, made each way in turn and timed per byte: the faster
    way's median wins (a tie streams). Streamed gathers of image rows beat ``np.take`` on one
    VM and lost to it on another (``docs/architecture.md``), so the trial runs on the
    process's own rows, from memory as they are.
    """

    TRIAL_CALLS = 16

    def __init__(self) -> None:
        self.streams: bool | None = None  # None while the trial runs
        self.seconds_per_byte: tuple[list[float], list[float]] = ([], [])  # take, streamed

    def next_streams(self) -> bool:
        """How the next large gather goes: the decision, or the trial's next way."""
        if self.streams is not None:
            return self.streams
        return len(self.seconds_per_byte[1]) <= len(self.seconds_per_byte[0])

    def record(self, streamed: bool, seconds: float, nbytes: int) -> None:
        timed = self.seconds_per_byte
        timed[streamed].append(seconds / max(nbytes, 1))
        if len(timed[0]) + len(timed[1]) >= self.TRIAL_CALLS:
            take, streamed_ = (statistics.median(t) for t in timed)
            self.streams = streamed_ <= take


#: The trial of this process's gathers (tests set ``streams`` to pin a way).
GATHER = GatherTrial()


def gather_into(src: np.ndarray, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``src.take(rows, 0, out, "clip")`` (``rows``: int64, checked by the caller: ``clip``
    clamps a row out of range), streaming each row when the loop is loaded, the gather is
    large (:func:`_streams`; there a row out of range raises IndexError) and streaming is the
    faster way here (:class:`GatherTrial`). Returns ``out``, or a fresh array (aligned for
    the stores when streamed)."""
    compiled = _Loop.compiled
    if compiled is None or src.strides[0] < STREAM_ROW_BYTES or not _streams(src, rows.size, out):
        return src.take(rows, 0, out, "clip")
    trial = GATHER.streams is None
    streams = GATHER.next_streams()
    start = time.perf_counter() if trial else 0.0
    if not streams:
        out = src.take(rows, 0, out, "clip")
    else:
        if out is None:
            out = _aligned_empty((rows.size, *src.shape[1:]), src.dtype)
        _gather(compiled, src, rows, out)
    if trial:
        GATHER.record(streams, time.perf_counter() - start, out.nbytes)
    return out


def copy_out(src: np.ndarray) -> np.ndarray:
    """``src.copy()``, streamed for a range of large rows read out of the ring, by the rule
    of :func:`gather_into` (rows of :data:`STREAM_ROW_BYTES` or more, :data:`STREAM_MIN_BYTES`
    in all): a range of small rows is read right after and stays in the caches."""
    if (
        _Loop.compiled is None
        or src.ndim == 0
        or src.strides[0] < STREAM_ROW_BYTES
        or src.nbytes < STREAM_MIN_BYTES
        or not src.flags.c_contiguous
    ):
        return src.copy()
    out = _aligned_empty(src.shape, src.dtype)
    copy_into(out, src)
    return out


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
    """An uninitialised array whose first byte is on a cache line (the loop's aligned stores
    then start at its first line, not after an unaligned head)."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + _LINE, np.uint8)
    at = -raw.ctypes.data % _LINE
    return raw[at : at + nbytes].view(dtype).reshape(shape)


def _streams(src: np.ndarray, n: int, out: np.ndarray | None) -> bool:
    """Whether a gather of ``n`` rows of ``src`` into ``out`` streams: rows of
    :data:`STREAM_ROW_BYTES` or more, :data:`STREAM_MIN_BYTES` in all, contiguous arrays of
    one dtype and row shape that do not overlap."""
    row_bytes = src.nbytes // len(src) if len(src) else 0
    if row_bytes < STREAM_ROW_BYTES or n * row_bytes < STREAM_MIN_BYTES:
        return False
    if not src.flags.c_contiguous:
        return False
    return out is None or (
        out.dtype == src.dtype
        and out.shape[1:] == src.shape[1:]
        and len(out) >= n
        and out.flags.c_contiguous
        and not np.may_share_memory(out, src)
    )


def _gather(compiled: ModuleType, src: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    row_bytes = src.nbytes // len(src)
    dst = out.reshape(len(out), -1).view(np.uint8).reshape(-1)
    bad = compiled.gather(
        dst, src.reshape(-1).view(np.uint8), rows, row_bytes, out.ctypes.data, src.ctypes.data
    )
    if bad >= 0:
        raise IndexError(f"row {int(rows[bad])} is out of range for {len(src)} rows")


def _stream(compiled: ModuleType, dst: np.ndarray, src: np.ndarray) -> None:
    """The unaligned head and the short tail with numpy, the aligned body streamed."""
    block = compiled.BLOCK
    dst_at, src_at = dst.ctypes.data, src.ctypes.data
    head = -dst_at % block
    stop = head + (dst.size - head) // block * block
    if head:
        np.copyto(dst[:head], src[:head])
    # backward when each load would otherwise alias the store just before it (_copy_jit.py)
    delta = (dst_at - src_at) % _PAGE
    compiled.stream(dst[head:stop], src[head:stop], 0 < delta < _PAGE // 2)
    if stop < dst.size:
        np.copyto(dst[stop:], src[stop:])
