"""The streaming copy's loop, compiled by numba (the optional ``fast`` extra).

Imported only through :func:`shmbuffer.streamcopy.kernels`, on the first copy large enough
to use it: numba costs ~0.4 s and ~50 MB to import, which a writer of small rows never pays.

:func:`stream` copies 32 bytes at a time with non-temporal stores (``!nontemporal`` on an
aligned vector store: ``vmovntps`` on x86-64). They go to memory through write-combining
buffers instead of reading each destination line into the cache first and evicting it later:
about a third less memory traffic for a copy into rows that nobody reads soon (a ring's rows
are read laps later), and the caches keep the writer's own working set. The stores are weakly
ordered, so the loop ends with a full fence: rows are in memory before the commit that
publishes them is sent.

Direction: a load from ``src + x`` that follows a store to ``dst + y`` with the same address
bits 11..0 waits on it (4K aliasing). Copying forward with ``dst - src`` a little above a
multiple of 4096 makes every load alias the store just before it (3.5 GB/s here, against
6-7 GB/s for the same copy backward), so such a copy runs backward; glibc's ``memmove`` makes
the same choice.

Thread safety: a pure function of its arguments; it releases the GIL.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

#: Bytes one store moves; the destination must be aligned to it.
BLOCK = 32
_VECTOR = ir.VectorType(ir.IntType(64), BLOCK // 8)


def _block_typer(typingctx: Any, dst: Any, src: Any, index: Any) -> Any:  # pragma: no cover
    """Copy bytes ``[index * 32, index * 32 + 32)`` of ``src`` to ``dst`` (uint8 arrays),
    the load unaligned, the store aligned and non-temporal."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        dst_ty, src_ty, _ = signature.args
        dst_arr = context.make_array(dst_ty)(context, builder, args[0])
        src_arr = context.make_array(src_ty)(context, builder, args[1])
        offset = builder.mul(args[2], ir.Constant(args[2].type, BLOCK))
        source = builder.bitcast(builder.gep(src_arr.data, [offset]), _VECTOR.as_pointer())
        target = builder.bitcast(builder.gep(dst_arr.data, [offset]), _VECTOR.as_pointer())
        store = builder.store(builder.load(source, align=1), target, align=BLOCK)
        store.set_metadata(
            "nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        )
        return context.get_dummy_value()

    return types.void(dst, src, index), codegen


def _fence_typer(typingctx: Any) -> Any:  # pragma: no cover
    """A full memory fence (``mfence``): the streaming stores before it are globally visible
    before any store after it."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


# Typed as Any: numba's intrinsic wrapper declares the typer's signature, not the call's.
_copy_block: Any = intrinsic(_block_typer)
_fence: Any = intrinsic(_fence_typer)


@numba.njit(cache=True, nogil=True)
def stream(dst: np.ndarray, src: np.ndarray, backward: bool) -> None:  # pragma: no cover
    """Copy ``src`` into ``dst``: uint8 arrays of one size, a multiple of :data:`BLOCK`,
    ``dst`` aligned to it, not overlapping."""
    blocks = dst.size // BLOCK
    if backward:
        for i in range(blocks - 1, -1, -1):
            _copy_block(dst, src, i)
    else:
        for i in range(blocks):
            _copy_block(dst, src, i)
    _fence()
