"""A reader's own uniform row draws: ``sample(n)`` of a uniform table without a round trip.

Where the daemon publishes its live runs (``hello``'s ``buffer.local_draws``; a CPU buffer) and
says a reader may draw over them now (a uniform sampler that changes nothing on a draw, no rate
limiter or a min-size one that is met: ``ring/publisher.py``), the reader draws its rows itself
(:class:`~shmbuffer.registry.shared_spans.SpansView`), then gathers and checks their stamps
exactly as after a daemon's draw. Anything else asks the daemon, as before.

What the daemon counts of a sample (use counts, the sampled figures, ``samples`` and
``rows_sampled``) reaches it in bulk, in a ``drawn`` report sent without waiting for its reply:
once :data:`REPORT_ROWS` rows were drawn since the last report, at the first draw
:data:`REPORT_S` seconds after it, before the reader's next request through the daemon (a
sample, ``stats``) and at ``close``. Draws of a reader killed before its report are not counted.
The replies are taken at the next report; one that has not come after the reader's ``timeout``
raises :class:`~shmbuffer.errors.DaemonUnavailableError` from ``sample``, so a learner notices a
dead or hung daemon much as when each sample asked it.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

import numpy as np
import numpy.typing as npt

from shmbuffer.clients.connection import Connection
from shmbuffer.errors import DaemonUnavailableError
from shmbuffer.registry.shared_spans import SpansView
from shmbuffer.registry.spans import loaded_draws
from shmbuffer.wire.protocol import MAX_SAMPLE_ROWS

I64 = npt.NDArray[np.int64]

#: Rows drawn that make a report due (1 MiB of payload). A report is a message the daemon
#: wakes for, whatever its size: a learner sampling in a loop sends about ``1 / REPORT_S`` a
#: second, not one request per batch.
REPORT_ROWS = 1 << 16
#: Seconds after the last report at which a draw makes the next one due.
REPORT_S = 0.1


class LocalDraws:
    """Draws over the runs published at ``view`` for the reader on ``conn``, whose stamps
    are ``stamps``, and the reports of what it drew. ``seed``: the daemon's word (nil: the
    generator is seeded from the OS), mixed with this client's id."""

    def __init__(self, conn: Connection, view: SpansView, stamps: I64, seed: int | None) -> None:
        self.conn = conn
        self.view = view
        self.stamps = stamps
        self.rng = np.random.default_rng(None if seed is None else [seed, conn.client_id])
        payload = int(conn.buffer.get("max_payload_bytes", MAX_SAMPLE_ROWS * 16))
        #: Larger draws ask the daemon, which refuses what its reply could not carry; a
        #: report holds at most this many rows too (16 bytes each, as a reply's).
        self.max_rows = min(MAX_SAMPLE_ROWS, payload // 16)
        self._rows: list[I64] = []
        self._gens: list[I64] = []
        self._pending = 0  # rows drawn and not reported
        self._calls = 0  # the sample calls they came from
        self._last = 0.0  # monotonic time of the last report (0: the first draw reports)
        self._sent: deque[tuple[int, float]] = deque()  # (seq, sent at) of reports unanswered

    def draw(self, n: int) -> tuple[I64, I64, int] | None:
        """``(rows, generations, live rows)`` of ``n`` rows drawn here, or None: ask the
        daemon (see :meth:`SpansView.draw`)."""
        if n > self.max_rows:
            return None
        return self.view.draw(self.rng, n, self.stamps, loaded_draws())

    def redraw(self, n: int) -> tuple[I64, I64, int] | None:
        """:meth:`draw` of ``n`` rows in place of rows of a sample that were overwritten
        during its copy, counted as drawn (the sample itself already was)."""
        drawn = self.draw(n)
        if drawn is not None:
            self.count(drawn[0], drawn[1], calls=0)
        return drawn

    def count(self, rows: I64, generations: I64, calls: int = 1) -> None:
        """Note a sample's draw (copies of ``rows`` and their stamps then) for the next
        report; send it when one is due. ``calls``: the sample calls it stands for."""
        self._rows.append(rows.copy())
        self._gens.append(generations.copy())
        self._pending += rows.size
        self._calls += calls
        now = time.monotonic()
        if self._pending >= REPORT_ROWS or now - self._last >= REPORT_S:
            self.report(now)
        elif self._sent and now - self._sent[0][1] > self.conn.timeout:
            self._collect(now)

    def report(self, now: float | None = None) -> None:
        """Take the replies of earlier reports that came, then send what was drawn since the
        last one (its reply is taken later)."""
        now = time.monotonic() if now is None else now
        self._collect(now)
        self._last = now
        if not self._pending:
            return
        rows = np.concatenate(self._rows) if len(self._rows) > 1 else self._rows[0]
        gens = np.concatenate(self._gens) if len(self._gens) > 1 else self._gens[0]
        calls = self._calls
        self._rows, self._gens, self._pending, self._calls = [], [], 0, 0
        step = max(1, self.max_rows)
        for first in range(0, rows.size, step):  # within the daemon's max_payload_bytes
            part = slice(first, first + step)
            frames = [rows[part].astype("<i8", copy=False), gens[part].astype("<i8", copy=False)]
            seq = self.conn.send(
                "drawn", frames, rows=len(frames[0]), samples=calls if first == 0 else 0
            )
            self._sent.append((seq, now))

    def _collect(self, now: float) -> None:
        """Take the replies that came (a daemon error raises); DaemonUnavailableError when
        the oldest has been awaited longer than the connection's timeout."""
        conn = self.conn
        while self._sent:
            seq, sent = self._sent[0]
            if not conn.ready(seq):
                if now - sent <= conn.timeout:
                    return
                raise DaemonUnavailableError(
                    f"the daemon at {conn.endpoint} has not answered this reader for "
                    f"{now - sent:.1f}s (timeout {conn.timeout:.1f}s): is it running? "
                    "`shmbuffer-daemon status`"
                )
            self._sent.popleft()
            conn.wait(seq)

    def close(self) -> None:
        self.view.close()


def open_local_draws(
    conn: Connection, folder: Path, stamps: I64, info: dict[str, object]
) -> LocalDraws | None:
    """A reader's :class:`LocalDraws` over the file ``info`` names in the segment ``folder``
    (``hello``'s ``buffer.local_draws``), or None where it cannot be mapped."""
    name, seed = info.get("file"), info.get("seed")
    if not isinstance(name, str) or "/" in name or not (seed is None or isinstance(seed, int)):
        return None
    view = SpansView.open(folder / name)
    return None if view is None else LocalDraws(conn, view, stamps, seed)
