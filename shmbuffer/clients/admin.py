"""Admin calls a program makes to a daemon (the command line makes the same ones)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shmbuffer.clients.connection import Connection


def checkpoint(name: str, to: str | Path, *, timeout: float = 600.0) -> dict[str, Any]:
    """Ask the daemon serving ``name`` to checkpoint to ``to`` (a folder the daemon can write);
    returns ``{"path", "bytes", "seconds"}``."""
    conn = Connection(name, "admin", timeout=min(timeout, 10.0))
    try:
        reply = conn.call("checkpoint", timeout=timeout, to=str(to))
        return {k: reply[k] for k in ("path", "bytes", "seconds")}
    finally:
        conn.close()
