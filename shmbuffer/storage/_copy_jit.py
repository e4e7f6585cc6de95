"""The streaming copy's loop, compiled by numba (the optional ``fast`` extra).

Imported only through :func:`~shmbuffer.storage.streamcopy.kernels`, where a Writer or Buffer of
large rows attaches: numba is costly to import (CPU and memory), which a writer of small rows never
pays.

:func:`stream` copies a cache line (64 bytes) a step with non-temporal stores (``!nontemporal``
on two aligned vector stores: ``vmovntps`` on x86-64). They go to memory through
write-combining buffers instead of reading each destination line into the cache first and
evicting it later: less memory traffic for a copy into rows that nobody reads soon (a ring's
rows are read laps later). The source is prefetched :data:`AHEAD` bytes ahead with no temporal
locality (``prefetchnta``), so it passes through the caches without evicting the rest: a small
request sent right after an image episode's copy then runs on warm caches, and the copy
itself is faster than without the prefetch and than ``np.copyto`` (figures in
``docs/architecture.md``). The stores
are weakly ordered, so the loop ends with a full fence: rows are in memory before the commit
that publishes them is sent.

Direction: a load from ``src + x`` that follows a store to ``dst + y`` with the same address
bits 11..0 waits on it (4K aliasing). Copying forward with ``dst - src`` a little above a
multiple of 4096 makes every load alias the store just before it (about half the speed of
the same copy backward), so such a copy runs backward; glibc's ``memmove`` makes
the same choice.

Thread safety: a pure function of its arguments; it releases the GIL.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

#: Bytes one step moves: a cache line, in two vector stores; the destination is aligned to it.
BLOCK = 64
#: How far ahead of the copy (bytes) the source is prefetched, non-temporally.
AHEAD = 1024
_PAGE = 4096  # the span of the address bits that 4K aliasing compares
_HALF = ir.VectorType(ir.IntType(64), 4)  # 32 bytes
_I8P = ir.IntType(8).as_pointer()
_I32 = ir.IntType(32)
_insert_function: Any = cgutils.get_or_insert_function  # untyped in numba


def _line_typer(
    typingctx: Any, dst: Any, src: Any, index: Any, prefetch: Any
) -> Any:  # pragma: no cover
    """Copy line ``index`` (bytes ``[index * 64, index * 64 + 64)``) of ``src`` to ``dst``
    (uint8 arrays): unaligned loads, aligned non-temporal stores, and a non-temporal prefetch
    of the source ``prefetch`` bytes away (0: none; it must stay inside ``src``)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        dst_ty, src_ty, _, _ = signature.args
        dst_arr = context.make_array(dst_ty)(context, builder, args[0])
        src_arr = context.make_array(src_ty)(context, builder, args[1])
        offset = builder.mul(args[2], ir.Constant(args[2].type, BLOCK))
        nontemporal = builder.module.add_metadata([ir.Constant(_I32, 1)])
        with builder.if_then(builder.icmp_signed("!=", args[3], ir.Constant(args[3].type, 0))):
            ahead = builder.gep(src_arr.data, [builder.add(offset, args[3])])
            prefetch = _insert_function(
                builder.module,
                ir.FunctionType(ir.VoidType(), [_I8P, _I32, _I32, _I32]),
                "llvm.prefetch.p0",
            )
            # read, no temporal locality (prefetchnta), data cache
            builder.call(prefetch, [builder.bitcast(ahead, _I8P), *map(_int32, (0, 0, 1))])
        for half in (0, 32):
            at = builder.add(offset, ir.Constant(offset.type, half))
            source = builder.bitcast(builder.gep(src_arr.data, [at]), _HALF.as_pointer())
            target = builder.bitcast(builder.gep(dst_arr.data, [at]), _HALF.as_pointer())
            store = builder.store(builder.load(source, align=1), target, align=32)
            store.set_metadata("nontemporal", nontemporal)
        return context.get_dummy_value()

    return types.void(dst, src, index, prefetch), codegen


def _int32(value: int) -> ir.Constant:
    return ir.Constant(_I32, value)


def _fence_typer(typingctx: Any) -> Any:  # pragma: no cover
    """A full memory fence (``mfence``): the streaming stores before it are globally visible
    before any store after it."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


# Typed as Any: numba's intrinsic wrapper declares the typer's signature, not the call's.
_copy_line: Any = intrinsic(_line_typer)
_fence: Any = intrinsic(_fence_typer)


@numba.njit(cache=True, nogil=True)
def stream(dst: np.ndarray, src: np.ndarray, backward: bool) -> None:  # pragma: no cover
    """Copy ``src`` into ``dst``: uint8 arrays of one size, a multiple of :data:`BLOCK`,
    ``dst`` aligned to it, not overlapping. The last :data:`AHEAD` bytes go unprefetched."""
    _lines(dst, src, backward)
    _fence()


@numba.njit(cache=True, nogil=True)
def gather(
    dst: np.ndarray, src: np.ndarray, rows: np.ndarray, row_bytes: int, dst_at: int, src_at: int
) -> int:  # pragma: no cover
    """Copy row ``rows[k]`` of ``src`` into row ``k`` of ``dst`` (uint8, rows of ``row_bytes``
    each, not overlapping), each row as :func:`stream` copies: the bytes up to the
    destination's next :data:`BLOCK` boundary and the short tail one by one, the lines between
    streamed, backward where forward would 4K-alias. ``dst_at``/``src_at``: the arrays'
    addresses. One fence after the last row. Returns -1, or the first ``k`` whose row is out of
    range (nothing from it on is copied: numba does not check bounds, so this loop does)."""
    held = src.size // row_bytes
    for k in range(rows.size):
        if rows[k] < 0 or rows[k] >= held:
            _fence()
            return k
        d0 = k * row_bytes
        s0 = rows[k] * row_bytes
        head = min((BLOCK - (dst_at + d0) % BLOCK) % BLOCK, row_bytes)
        for j in range(head):
            dst[d0 + j] = src[s0 + j]
        body = (row_bytes - head) // BLOCK * BLOCK
        a, b = d0 + head, s0 + head
        delta = (dst_at + a - src_at - b) % _PAGE
        _lines(dst[a : a + body], src[b : b + body], 0 < delta < _PAGE // 2)
        for j in range(head + body, row_bytes):
            dst[d0 + j] = src[s0 + j]
    _fence()
    return -1


@numba.njit(inline="always")
def _lines(dst: np.ndarray, src: np.ndarray, backward: bool) -> None:  # pragma: no cover
    """The streamed lines of one copy (see :func:`stream`), without the fence."""
    lines = dst.size // BLOCK
    lead = min(lines, AHEAD // BLOCK)
    if backward:
        for i in range(lines - 1, lead - 1, -1):
            _copy_line(dst, src, i, -AHEAD)
        for i in range(lead - 1, -1, -1):
            _copy_line(dst, src, i, 0)
    else:
        for i in range(lines - lead):
            _copy_line(dst, src, i, AHEAD)
        for i in range(lines - lead, lines):
            _copy_line(dst, src, i, 0)
