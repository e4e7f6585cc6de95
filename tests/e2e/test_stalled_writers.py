"""A stalled writer is as real as a dead one: rows a local writer may still be copying into are
never handed to another writer while its process lives — not past ``--reservation-ttl``, not
after its connection closed, not across a daemon SIGKILL and ``--resume`` — and a writer that
must wait is told whose rows they are. A lane client whose connection is gone is forgotten.

Each test freezes a real writer process (SIGSTOP) right after its reservation is granted, lets
a second writer try to lap it, lets the first go on (SIGCONT) and then checks every byte of
the second writer's acknowledged episodes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from shmbuffer import Reader, Writer
from shmbuffer.cli.demo_loops import check_episode, make_episode
from shmbuffer.clients.connection import Connection
from shmbuffer.errors import ShmBufferError
from tests.e2e.conftest import wait_for
from tests.e2e.test_lane import _lane_socket, _replies, _send

LENGTH = 50
RING = 4  # episodes of LENGTH rows
OBS = (16,)
TTL = "0.3"
STALLED = 1  # make_episode's writer id for the stalled writer's rows
LAPPING = 2  # and for the writer that laps it

# Reserves the whole ring, says which rows it got, waits for a line on stdin (the test stops
# it before that), then writes its episode into them and commits: on the connection it had,
# or, when that one is gone (its daemon died), on a new one of the same process.
STALLED_WRITER = """
import json, sys
from shmbuffer.clients.connection import Connection
from shmbuffer.cli.demo_loops import make_episode
from shmbuffer.errors import ShmBufferError
from shmbuffer.storage.segment import Segment
name, rows, obs = sys.argv[1], int(sys.argv[2]), tuple(json.loads(sys.argv[3]))
conn = Connection(name, "writer", timeout=10)
info = conn.buffer["segment"]
seg = Segment.attach(info["name"], storage_dir=info["storage_dir"])
reply = conn.call("reserve", rows=rows)
print(json.dumps({"reservation": reply["reservation"], "ranges": reply["ranges"]}), flush=True)
sys.stdin.readline()
ep = make_episode(STALLED, 0, rows, obs)
(start, stop), = reply["ranges"]
for key, array in seg.arrays.items():
    array[start:stop] = ep[key[0]]
try:
    done = conn.call("commit", reservation=reply["reservation"])
    how = "same connection"
except ShmBufferError:
    conn.close()
    conn = Connection(name, "writer", timeout=10)
    done = conn.call("commit", reservation=reply["reservation"])
    how = "new connection"
print(json.dumps({"committed": done["episodes"], "how": how}), flush=True)
conn.close()
""".replace("STALLED", str(STALLED))


@contextlib.contextmanager
def stalled_writer(name: str) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", STALLED_WRITER, name, str(LENGTH * RING), json.dumps(OBS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )
    try:
        assert proc.stdout is not None
        granted = json.loads(proc.stdout.readline())
        proc.send_signal(signal.SIGSTOP)  # frozen right after its reservation was granted
        yield proc, granted
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def go_on(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """SIGCONT the stalled writer and let it copy and commit; its report."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.send_signal(signal.SIGCONT)
    proc.stdin.write("go\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    assert line, f"the stalled writer failed (rc {proc.wait(10)})"
    assert proc.wait(10) == 0
    return dict(json.loads(line))


def write(name: str, first: int, count: int, timeout: float) -> None:
    with Writer(name, timeout=5, reserve_timeout=timeout) as w:
        for e in range(first, first + count):
            w.add_episode(make_episode(LAPPING, e, LENGTH, OBS))
        w.flush()


def every_byte_checked(name: str, episodes: set[int]) -> None:
    """The ring holds exactly the lapping writer's ``episodes``, each one whole."""
    with Reader(name, timeout=5) as r, r.sample_episodes(200) as sampled:
        found = set()
        for ep in sampled:
            check_episode(ep)
            assert int(ep["writer"][0]) == LAPPING
            found.add(int(ep["episode"][0]))
    assert found == episodes


def start(daemon: Any, *args: str, name: str | None = None) -> Any:
    return daemon(
        name=name,
        capacity=LENGTH * RING,
        unit="episode",
        args=["--reservation-ttl", TTL, *args],
    )


def test_a_stalled_writer_keeps_its_rows_past_the_ttl(daemon, e2e_env):
    d = start(daemon)
    write(d.name, 0, 1, timeout=5)  # the schema
    with stalled_writer(d.name) as (proc, granted):
        time.sleep(4 * float(TTL))  # well past its TTL, stopped
        stalled = wait_for(lambda: d.stats()["stalled_writers"], 5, what="a stalled writer")
        assert [(s["pid"], s["reservation"], s["connected"]) for s in stalled] == [
            (proc.pid, granted["reservation"], True)
        ]
        status = e2e_env.cli("status", "--name", d.name).stdout
        assert f"stalled     writer pid {proc.pid} holds {LENGTH * RING} rows" in status
        with pytest.raises(ShmBufferError, match=f"writer pid {proc.pid}"):
            write(d.name, 1, RING, timeout=1.0)  # would lap it: waits, and is told whose
        report = go_on(proc)
    assert report["how"] == "same connection"  # a late commit is still a commit
    write(d.name, 1, RING, timeout=5)
    every_byte_checked(d.name, set(range(1, 1 + RING)))
    assert d.stats()["stalled_writers"] == []


@pytest.mark.parametrize("then", ["continues", "is killed"])
def test_a_stalled_writer_keeps_its_rows_across_a_daemon_crash(daemon, then):
    d = start(daemon)
    write(d.name, 0, 1, timeout=5)
    with stalled_writer(d.name) as (proc, granted):
        d.process.send_signal(signal.SIGKILL)
        d.process.wait(10)
        resumed = start(daemon, "--resume", name=d.name)
        assert "pinned to pid" in resumed.log()
        stalled = resumed.stats()["stalled_writers"]
        assert [(s["pid"], s["reservation"], s["connected"]) for s in stalled] == [
            (proc.pid, granted["reservation"], False)
        ]
        with pytest.raises(ShmBufferError, match=f"writer pid {proc.pid}"):
            write(d.name, 1, RING, timeout=1.0)
        if then == "continues":
            report = go_on(proc)
            assert report["how"] == "new connection"  # its process takes its rows back
        else:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            wait_for(lambda: not resumed.stats()["stalled_writers"], 5, what="pin dropped")
    write(d.name, 1, RING, timeout=5)
    every_byte_checked(d.name, set(range(1, 1 + RING)))


def test_a_writer_whose_connection_closed_keeps_its_rows_while_it_lives(daemon):
    """The connection goes, the process stays: its rows stay pinned to it, and another
    connection of the same process may commit them; another process may not."""
    d = start(daemon)
    write(d.name, 0, 1, timeout=5)
    first = Connection(d.name, "writer", timeout=5)
    reservation = first.call("reserve", rows=LENGTH)["reservation"]
    first._finalizer.detach()  # no bye: the connection just drops, as a broken one does
    assert first._lane is not None
    first._lane.close()
    stalled = wait_for(lambda: d.stats()["stalled_writers"], 5, what="an orphaned pin")
    assert stalled[0]["pid"] == os.getpid() and not stalled[0]["connected"]
    second = Connection(d.name, "writer", timeout=5)
    try:
        second.call("abort", reservation=reservation)  # its own process: allowed
        assert d.stats()["reservations"] == 0
    finally:
        second.close()


def test_clients_whose_lane_connection_closed_are_forgotten(daemon):
    """More hellos than ``max_clients`` from connections that hang up without a ``bye``: each
    one is forgotten when its connection closes, so the daemon stays open to everyone."""
    d = daemon(capacity=100)
    for seq in range(1100):
        sock = _lane_socket(d.endpoint)
        _send(sock, "hello", seq, role="reader", pid=os.getpid(), host="h", remote=False)
        (reply,) = _replies(sock, 1)
        assert reply["ok"], reply
        sock.close()
    clients = wait_for(lambda: d.stats()["clients"], 5, what="stats")
    assert len(clients) <= 2  # the stats call's own, and maybe one not yet noticed closed
    with Reader(d.name, timeout=5):
        pass
