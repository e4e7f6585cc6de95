"""A client never closed ends as a closed one does: a Writer stores what it was given (when it
is collected and at interpreter exit, within its timeout, warning about the rows it could
not store), and a Writer or Reader says goodbye, so the daemon forgets it.

The interpreter-exit cases run a fresh interpreter with a timeout (a hang fails the test).
"""

from __future__ import annotations

import json
import sys
import textwrap
import time
from typing import Any

import numpy as np
import pytest

from shmbuffer import Reader, UnstoredWritesWarning, Writer
from tests.e2e.conftest import run_in_session

SUBPROCESS_TIMEOUT_S = 60.0


def run_script(code: str, env: dict[str, str]) -> tuple[int, str, str]:
    argv = [sys.executable, "-c", textwrap.dedent(code)]
    return run_in_session(argv, env, SUBPROCESS_TIMEOUT_S)


def _rows(n: int, writer: int) -> dict[str, np.ndarray]:
    return {"x": np.zeros(n, np.float32), "w": np.full(n, writer, np.int64)}


def test_the_one_liner_of_a_never_closed_writer_stores_its_episode(daemon, e2e_env):
    d = daemon(capacity=1000, unit="transition")
    code = f"""
        import shmbuffer, numpy as np
        w = shmbuffer.Writer({d.name!r})
        w.add_episode({{"x": np.zeros(5, np.float32)}})
    """
    rc, _out, err = run_script(code, e2e_env.environ)
    assert rc == 0, err
    assert "Warning" not in err, err
    stats = d.stats()
    assert stats["rows_committed"] == 5 and stats["episodes_committed"] == 1


UNCLOSED_SCRIPT = """
    import gc, sys
    import numpy as np
    from shmbuffer import Writer

    name = sys.argv[1]

    def rows(n, writer):
        return {"x": np.zeros(n, np.float32), "w": np.full(n, writer, np.int64)}

    alive = Writer(name)  # left for the interpreter's exit, a small write still gathered
    alive.add_episode(rows(5, 0))
    long = Writer(name, commit_delay=60)  # a 900-row episode, its commit not sent
    long.add_episode(rows(900, 1))
    dropped = Writer(name, commit_delay=60)  # collected at once by `del`
    dropped.add_episode(rows(7, 2))
    del dropped
    cycle = Writer(name, commit_delay=60)  # collected by the cycle collector
    cycle.add_episode(rows(11, 3))
    cycle.me = cycle
    del cycle
    gc.collect()
    left = Writer(name, commit_delay=60)  # in a cycle still uncollected at exit
    left.add_episode(rows(13, 4))
    left.me = left
    del left
    streamed = Writer(name, batch_bytes=0)  # a stream that reserved its next writes ahead
    for _ in range(20):
        streamed.add_episode(rows(30, 5))
"""


def test_writers_never_closed_store_everything_they_were_given(daemon, e2e_env):
    d = daemon(capacity=10_000, unit="transition")
    rc, _out, err = run_script(
        f"import sys; sys.argv[1:] = [{d.name!r}]\n" + textwrap.dedent(UNCLOSED_SCRIPT),
        e2e_env.environ,
    )
    assert rc == 0, err
    assert "Warning" not in err, err
    stats = d.stats()
    assert stats["rows_committed"] == 5 + 900 + 7 + 11 + 13 + 20 * 30
    assert stats["episodes_committed"] == 5 + 20
    assert stats["reservations"] == 0  # nothing reserved ahead was left open
    assert stats["clients"] == [] or all(c["role"] == "admin" for c in stats["clients"])


DEAD_DAEMON_SCRIPT = """
    import json, os, signal, sys, time, warnings
    import numpy as np
    from shmbuffer import Writer

    name, daemon_pid, lane = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    os.environ["SHMBUFFER_LANE"] = lane

    def rows(n):
        return {"x": np.zeros(n, np.float32), "w": np.zeros(n, np.int64)}

    at_exit = Writer(name, timeout=1.0, commit_delay=60)
    at_exit.add_episode(rows(5))
    dropped = Writer(name, timeout=1.0, commit_delay=60)
    dropped.add_episode(rows(7))
    os.kill(daemon_pid, signal.SIGKILL)
    time.sleep(0.2)
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del dropped
    took = time.monotonic() - start
    print(json.dumps({
        "took": took,
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
        "exit_from": time.monotonic(),
    }))
"""


@pytest.mark.parametrize("lane", ["1", "0"])
def test_a_never_closed_writer_whose_daemon_is_gone_warns_within_its_timeout(daemon, e2e_env, lane):
    d = daemon(capacity=1000, unit="transition")
    head = f"import sys; sys.argv[1:] = [{d.name!r}, {str(d.pid)!r}, {lane!r}]\n"
    rc, out, err = run_script(head + textwrap.dedent(DEAD_DAEMON_SCRIPT), e2e_env.environ)
    ended = time.monotonic()
    assert rc == 0, err
    report: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    assert report["took"] < 2.0, report  # the Writer's timeout (1 s), not a hang
    assert len(report["warnings"]) == 1, report
    assert "7 rows" in report["warnings"][0] and "close()" in report["warnings"][0], report
    # at exit: the other writer's rows are named on stderr, and the exit is not held up
    assert "5 rows" in err and "Warning" in err, err
    assert ended - report["exit_from"] < 1.0 + 4.0, (ended, report)  # timeout + teardown


def _config(tmp_path: Any, max_clients: int) -> str:
    path = tmp_path / "daemon.toml"
    path.write_text(f"max_clients = {max_clients}\n")
    return str(path)


@pytest.mark.parametrize("lane", ["1", "0"])
def test_dropped_clients_say_goodbye(daemon, tmp_path, monkeypatch, lane):
    """Many more Readers and Writers than ``max_clients``, each dropped unclosed, one after
    another: each said goodbye, so none was refused for too many clients."""
    monkeypatch.setenv("SHMBUFFER_LANE", lane)
    limit = 8
    d = daemon(capacity=10_000, unit="transition", args=["--config", _config(tmp_path, limit)])
    with Writer(d.name, timeout=5) as w:
        w.add_episode(_rows(3, -1))
    for i in range(3 * limit):
        Writer(d.name, timeout=5).add_episode(_rows(3, i))
        Reader(d.name, timeout=5).sample(1)
    stats = d.stats()
    assert stats["rows_committed"] == 3 * (3 * limit + 1)  # each dropped Writer stored its rows
    assert [c for c in stats["clients"] if c["role"] != "admin"] == []


EXIT_SCRIPT = """
    import os, sys
    import numpy as np
    from shmbuffer import Reader, Writer

    os.environ["SHMBUFFER_LANE"] = "0"  # ZeroMQ: only a goodbye tells the daemon
    writer = Writer(sys.argv[1])
    writer.add_episode({"x": np.zeros(3, np.float32), "w": np.zeros(3, np.int64)})
    reader = Reader(sys.argv[1])
    reader.sample(1)
"""


def test_clients_left_at_interpreter_exit_say_goodbye(daemon, e2e_env):
    d = daemon(capacity=1000, unit="transition")
    with Writer(d.name, timeout=5) as w:
        w.add_episode(_rows(3, -1))
    rc, _out, err = run_script(
        f"import sys; sys.argv[1:] = [{d.name!r}]\n" + textwrap.dedent(EXIT_SCRIPT),
        e2e_env.environ,
    )
    assert rc == 0, err
    stats = d.stats()  # at once: no reaping of a dead pid could have run yet
    assert stats["rows_committed"] == 6
    assert [c for c in stats["clients"] if c["role"] != "admin"] == [], stats["clients"]


def test_a_dropped_writer_held_back_by_the_daemon_gives_up_within_its_timeout(daemon):
    """The daemon is alive but holds the write back (the rate limiter: nothing sampled): the
    finaliser waits no longer than the Writer's timeout, names the rows, and says goodbye,
    so the daemon forgets the writer and the write it held back."""
    d = daemon(
        capacity=1000,
        unit="transition",
        args=[
            "--rate-limiter",
            "sample-to-insert",
            "--samples-per-insert",
            "1",
            "--error-buffer",
            "1",
        ],
    )
    with Writer(d.name, timeout=5) as w:
        w.add_episode(_rows(2, 0))
    dropped = Writer(d.name, timeout=1.0, commit_delay=60)
    dropped.add_episode(_rows(3, 1))  # staged: its reserve is sent by the finaliser
    start = time.monotonic()
    with pytest.warns(UnstoredWritesWarning, match=r"last 3 rows \(1 episode\)"):
        del dropped
    assert time.monotonic() - start < 2.0
    stats = d.stats()
    assert stats["rows_committed"] == 2 and stats["reservations"] == 0
    assert [c for c in stats["clients"] if c["role"] != "admin"] == []


TICKER_GC_SCRIPT = """
    import gc, json, sys, threading, time
    import numpy as np
    from shmbuffer import Writer

    gc.disable()  # the cycle below is collected only where the script says
    writer = Writer(sys.argv[1], timeout=5, commit_delay=0.05)
    pipe = writer._pipe
    on_ticker = threading.Event()
    copy = pipe._write_rows

    def write_rows(*args):  # a collection that happens to run on the ticker thread, mid-copy
        if pipe._ticker is not None and pipe._ticker.is_current() and not on_ticker.is_set():
            on_ticker.set()
            gc.collect()
        copy(*args)

    pipe._write_rows = write_rows
    writer.add_episode({"x": np.zeros(5, np.float32), "w": np.zeros(5, np.int64)})  # staged
    writer.cycle = writer
    del writer
    deadline = time.monotonic() + 10
    while not pipe.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    print(json.dumps({"on_ticker": on_ticker.is_set(), "closed": pipe.closed}))
"""


def test_a_writer_collected_on_its_own_ticker_thread_is_finalised_after_the_tick(daemon, e2e_env):
    """A flush from inside the tick would close the segment under the copy in progress."""
    d = daemon(capacity=10_000, unit="transition")
    rc, out, err = run_script(
        f"import sys; sys.argv[1:] = [{d.name!r}]\n" + textwrap.dedent(TICKER_GC_SCRIPT),
        e2e_env.environ,
    )
    assert rc == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == {"on_ticker": True, "closed": True}
    assert "Warning" not in err, err
    stats = d.stats()
    assert stats["rows_committed"] == 5
    assert [c for c in stats["clients"] if c["role"] != "admin"] == []
