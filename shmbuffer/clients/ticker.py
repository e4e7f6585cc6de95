"""A client's background thread: calls a method every ``interval`` seconds until stopped.

The Writer's commit ticker and the Reader's lease renewer are both one of these. The method is
held by a weak reference, so an unclosed client is still collected instead of being kept alive
by its own thread.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable


class Ticker:
    def __init__(
        self, interval: float, fn: weakref.WeakMethod[Callable[[], None]], name: str
    ) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(interval, fn), name=name, daemon=True
        )
        self._thread.start()

    def _run(self, interval: float, ref: weakref.WeakMethod[Callable[[], None]]) -> None:
        while not self._stop.wait(interval):
            fn = ref()
            if fn is None:
                return
            fn()
            del fn  # no strong reference while waiting

    def is_current(self) -> bool:
        """Whether the caller runs on this ticker's thread."""
        return self._thread is threading.current_thread()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():  # stopped from its own call
            self._thread.join(timeout)
