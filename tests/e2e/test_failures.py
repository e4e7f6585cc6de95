"""flush() makes writes visible; a killed daemon makes client calls fail fast, never hang."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

from shmbuffer import Reader, Writer
from shmbuffer.cli.demo_loops import make_episode
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


def test_a_wait_ends_within_timeout_when_another_daemon_answers_in_the_dead_ones_place(
    daemon, e2e_env
):
    """A long wait (a consume-once sample parked in the daemon) pings the daemon so that its
    death shows within ``timeout``. A daemon started in the dead one's place on the same
    endpoint (a host resuming it) answers those pings, but the request died with the old
    one: its answer must end the wait at once, not count as the old daemon being alive
    until ``sample_timeout + timeout`` runs out."""
    port = _free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    args = ["--endpoint", endpoint, "--sampler", "fifo", "--schema", _schema(e2e_env)]
    first = daemon(capacity=100, unit="transition", args=args)
    timeout, sample_timeout = 4.0, 30.0
    reader = Reader(endpoint, timeout=timeout, sample_timeout=sample_timeout)
    try:
        box = {}

        def parked_sample():
            started = time.monotonic()
            try:
                reader.sample(1)  # nothing to consume: parked up to sample_timeout
            except BaseException as exc:
                box["exc"] = exc
            box["took"] = time.monotonic() - started

        thread = threading.Thread(target=parked_sample, daemon=True)
        thread.start()
        time.sleep(0.5)
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(10)
        second = daemon(name=first.name, capacity=100, unit="transition", args=args)
        thread.join(sample_timeout + timeout + 5)
        assert not thread.is_alive(), "the sample still waits"
        assert isinstance(box.get("exc"), DaemonUnavailableError), box
        assert f"pid {second.pid}" in str(box["exc"]) and f"pid {first.pid}" in str(box["exc"])
        assert box["took"] < timeout + 2.0, box
    finally:
        reader.close()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _schema(e2e_env):
    path = e2e_env.runtime_dir / "schema.json"
    path.write_text(json.dumps({"x": {"dtype": "float32", "shape": []}}))
    return str(path)
