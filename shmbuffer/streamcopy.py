"""Copies into the ring that bypass the CPU caches: the writer's one hot loop.

:func:`copy_into` is ``np.copyto(dst, src, casting="unsafe")``, except that a large copy of
one dtype between contiguous arrays goes through streaming (non-temporal) stores when the
``fast`` extra (numba) is installed: see ``_copy_jit.py``. Measured here (2 cores, 4 KB
tmpfs pages, issue 10): a 5.6 MB image episode into a ring in 0.6-0.85 ms instead of
np.copyto's 1.0-1.2 ms, and the writer's next small steps on warm caches. glibc's ``memcpy``
streams only above a cut-off derived from the cache sizes (above this episode here), and
cannot know that rows written into a ring are read laps later, if at all, from another
process.

Below :data:`STREAM_MIN_BYTES` plain stores win (the destination's lines may still be in the
cache, and the call costs a few microseconds), as they do for a destination that is read right
after (a learner's batch): only rows written into the shared ring come here.
``SHMBUFFER_JIT=0`` turns every compiled kernel off, this one too.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import numpy as np

from shmbuffer import jit

__all__ = ["STREAM_MIN_BYTES", "STREAM_ROW_BYTES", "copy_into", "kernels", "warm"]

#: Smallest copy that streams (about 9 image rows of 28 KB).
STREAM_MIN_BYTES = 256 * 1024
#: Rows of at least this size are worth loading the loop for (:func:`warm`): any episode of
#: them is a large copy. Small rows were no faster streamed, within this machine's noise
#: (their staged batches come from a staging area still in the cache).
STREAM_ROW_BYTES = 4096
_PAGE = 4096


class _Loop:
    """The loaded loop, once :func:`warm` ran it: copies stream only from then on; or why it
    could not be compiled here (copies then keep numpy)."""

    compiled: ModuleType | None = None
    failed: str | None = None


@functools.cache
def kernels() -> ModuleType | None:
    """The compiled loop (``_copy_jit.py``), or None: numba is not installed (the ``fast``
    extra), or ``SHMBUFFER_JIT=0`` asks for numpy."""
    return jit.load("shmbuffer._copy_jit")


def warm(row_nbytes: int | None = None) -> bool:
    """Load the compiled loop and run it once, so that :func:`copy_into` streams from now
    on in this process; with ``row_nbytes``, only for rows of :data:`STREAM_ROW_BYTES` or
    more. Writers call it where they attach (~0.9 s the first time in a process, its machine
    code cached on disk after the first compile), not on their first write. Returns whether
    copies stream."""
    if _Loop.compiled is None and _Loop.failed is None:
        if row_nbytes is not None and row_nbytes < STREAM_ROW_BYTES:
            return False
        compiled = kernels()
        if compiled is not None:  # the first call compiles, or loads the cached code
            source = np.ones(3 * compiled.BLOCK, np.uint8)
            target = np.zeros(3 * compiled.BLOCK, np.uint8)
            try:
                _stream(compiled, target[1:], source[1:])
            except Exception as exc:  # a numba or LLVM that cannot build it
                _Loop.failed = f"{type(exc).__name__}: {exc}"
                return False
            if not np.array_equal(target[1:], source[1:]):
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
