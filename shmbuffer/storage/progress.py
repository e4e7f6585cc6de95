"""Progress bars for long copies (checkpoint, restore): rich on a terminal, silent elsewhere.

A bar is only drawn where there is a real measure to draw: bytes copied so far, read from
the copy itself (restore, in the daemon's own process) or from the file it is growing
(checkpoint, which the daemon runs while the command line waits for its reply).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
POLL_S = 0.2


def enabled() -> bool:
    """Whether a bar would be drawn: stderr is a terminal and rich is installed."""
    return _console() is not None


def _stream() -> Any:
    """Where bars go: stderr, looked up at each call (it may be replaced while running)."""
    return sys.stderr


def _console() -> Any:
    """A rich console on stderr when it is a terminal and rich is installed, else None."""
    stream = _stream()
    if not stream.isatty():
        return None
    try:
        from rich.console import Console
    except ImportError:  # the `live` extra: bars are a nicety, never a requirement
        return None
    return Console(file=stream)


def _bar(console: Any, label: str, total: int) -> tuple[Any, Any]:
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    progress = Progress(
        f"[bold]{label}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )
    return progress, progress.add_task(label, total=total)


def copy_progress(label: str, total: int) -> tuple[Callable[[int], None], Callable[[], None]]:
    """``(update, close)`` for a copy of ``total`` bytes done in this process: call
    ``update(done_bytes)`` as it goes and ``close()`` at the end (no-ops off a terminal)."""
    console = _console()
    if console is None or total <= 0:
        return (lambda _done: None), (lambda: None)
    progress, task = _bar(console, label, total)
    progress.start()
    return (lambda done: progress.update(task, completed=done)), progress.stop


def wait_with_progress(
    label: str, total: int, measure: Callable[[], int], work: Callable[[], T]
) -> T:
    """Run ``work`` (a blocking call, e.g. a request another process carries out) while a
    bar shows ``measure()`` (bytes done so far, polled) out of ``total``; off a terminal,
    just run it. ``work``'s result or exception is the caller's."""
    console = _console()
    if console is None or total <= 0:
        return work()
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as exc:  # handed to the caller below
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="shmbuffer-progress-work", daemon=True)
    progress, task = _bar(console, label, total)
    with progress:
        thread.start()
        while thread.is_alive():
            progress.update(task, completed=min(measure(), total))
            thread.join(POLL_S)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]  # type: ignore[no-any-return]
