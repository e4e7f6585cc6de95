"""Where the optional compiled loops come from (numba, the ``fast`` extra): one loader for
every kernel module (``_copy_jit``, ``_draw_jit``, ``samplers/_jit``).

A kernel module imports numba at its top, so it is imported only through :func:`load`, never at
package import: numba and LLVM cost CPU and private memory even in a process that already
holds torch (``docs/sampling.md``), paid only where a loop is worth it. ``SHMBUFFER_JIT=0``
keeps every loop on its numpy path (the result is the same; tests compare the two).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

__all__ = ["load"]


def load(module: str) -> ModuleType | None:
    """The kernel module ``module`` (a dotted name), or None: numba is not installed, or
    ``SHMBUFFER_JIT=0``. Compiling happens at a kernel's first call, not here."""
    if os.environ.get("SHMBUFFER_JIT", "1") == "0":
        return None
    try:
        return importlib.import_module(module)
    except ImportError:
        return None
