"""Scale-out on Ray: one daemon per node, node-local writes through shared memory, learners
that sample across nodes in proportion (``docs/cluster.md``).

Needs the ``ray`` extra (``pip install 'shmbuffer[ray]'``). Names are imported lazily, so
:mod:`shmbuffer.cluster.split` and :mod:`shmbuffer.cluster.supervisor` work without Ray.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shmbuffer.cluster.handle import ShardedBuffer
    from shmbuffer.cluster.reader import ClusterReader, ShardUnavailableWarning

_LAZY = {
    "ShardedBuffer": "shmbuffer.cluster.handle",
    "ClusterReader": "shmbuffer.cluster.reader",
    "ShardUnavailableWarning": "shmbuffer.cluster.reader",
}
__all__ = ["ClusterReader", "ShardUnavailableWarning", "ShardedBuffer"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shmbuffer.cluster' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        if exc.name != "ray":
            raise
        raise ImportError(
            "shmbuffer.cluster needs Ray, which is not installed: pip install 'shmbuffer[ray]'"
        ) from exc
    globals()[name] = value
    return value
