"""flush() makes writes visible; a killed daemon makes client calls fail fast, never hang."""

from __future__ import annotations

import signal

from shmbuffer import Reader, Writer
from shmbuffer.demo import make_episode
from shmbuffer.errors import DaemonUnavailableError
from tests.e2e._watchdog import run_with_watchdog

LENGTH = 10
OBS = (2, 3)


def test_flush_close_and_dead_daemon(daemon):
    d = daemon(capacity=1000, unit="episode")
    w = Writer(d.name, timeout=2, reserve_timeout=0.5)
    r = Reader(d.name, timeout=2)
    for e in range(15):
        w.add_episode(make_episode(0, e, LENGTH, OBS))
    w.flush()
    assert w.episodes_committed == 15 and w.rows_committed == 15 * LENGTH
    stats = r.stats()
    assert stats["episodes_committed"] == 15 and stats["episodes"] == 15
    assert stats["rows"] == 15 * LENGTH and stats["reservations"] == 0
    w.add_episode(make_episode(0, 15, LENGTH, OBS))
    w.close()  # flushes the last commit
    assert r.stats()["episodes_committed"] == 16
    w2 = Writer(d.name, timeout=2, reserve_timeout=0.5)
    w2.add_episode(make_episode(1, 0, LENGTH, OBS))
    w2.flush()

    d.process.send_signal(signal.SIGKILL)
    d.process.wait(10)

    calls = {
        "reader.stats": r.stats,
        # a small episode waits to share a round trip: the failure shows at the flush
        "writer.add_episode+flush": lambda: (
            w2.add_episode(make_episode(1, 1, LENGTH, OBS)),
            w2.flush(),
        ),
        "new Reader": lambda: Reader(d.name, timeout=2),
    }
    for what, call in calls.items():
        exc, took = run_with_watchdog(call, 10)
        assert isinstance(exc, DaemonUnavailableError), (what, exc)
        assert took < 2 + 1.5, f"{what} took {took:.1f}s"
    exc, took = run_with_watchdog(w2.close, 10)  # closing against a dead daemon must not hang
    assert took < 2 + 1.5
    exc, took = run_with_watchdog(r.close, 10)
    assert exc is None and took < 2 + 1.5
