"""A watchdog for client calls that must fail fast, never hang."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest


def run_with_watchdog(fn: Any, limit: float) -> tuple[BaseException | None, float]:
    """Run ``fn`` in a thread; fail the test if it still blocks after ``limit`` seconds.
    Returns what it raised (or None) and how long it took."""
    box: dict[str, BaseException] = {}

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            box["exc"] = exc

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        pytest.fail(f"a client call still blocked after {limit}s")
    return box.get("exc"), time.monotonic() - start
