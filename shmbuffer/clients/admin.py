"""Admin calls a program makes to a daemon (the command line makes the same ones)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shmbuffer.clients.connection import Connection


def checkpoint(name: str, to: str | Path, *, timeout: float = 600.0) -> dict[str, Any]:
    """Ask the daemon serving ``name`` to checkpoint to ``to`` (a folder the daemon can write);
    returns ``{"path", "bytes", "seconds", "copied_bytes", "linked_bytes", "max_pause_ms"}``
    (bytes copied, and hard-linked unchanged from the previous checkpoint; the daemon loop's
    longest pause for it)."""
    conn = Connection(name, "admin", timeout=min(timeout, 10.0))
    try:
        reply = conn.call("checkpoint", timeout=timeout, to=str(to))
        keys = ("path", "bytes", "seconds", "copied_bytes", "linked_bytes", "max_pause_ms")
        return {k: reply[k] for k in keys}
    finally:
        conn.close()
