"""A client's life ends cleanly however it ends: collected unclosed in a reference cycle (with
the daemon alive or dead), used in a forked child, or used after ``close()``.

The collection and fork checks run in a fresh interpreter with a timeout, so a regression (a
``gc.collect()`` blocked in ``zmq_ctx_term``, a child spinning on the parent's socket) fails
the test instead of hanging the suite.
"""

from __future__ import annotations

import json
import sys
import textwrap
from typing import Any

import pytest

from shmbuffer import Buffer, Reader, Writer
from shmbuffer.cli.demo_loops import check_episode, make_episode
from shmbuffer.errors import ClosedError, ForkedClientError
from tests.e2e.conftest import run_in_session

LENGTH = 10
OBS = (2, 3)
SUBPROCESS_TIMEOUT_S = 60.0


def run_script(code: str, env: dict[str, str], timeout: float = SUBPROCESS_TIMEOUT_S) -> Any:
    """Run ``code`` in a fresh interpreter (its own process group); return the JSON it prints
    last. A script still running after ``timeout`` (a hang) is killed with everything it
    forked, and fails the test."""
    argv = [sys.executable, "-c", textwrap.dedent(code)]
    returncode, out, err = run_in_session(argv, env, timeout)
    assert returncode == 0, f"script failed:\n{out}\n{err}"
    return json.loads(out.strip().splitlines()[-1])


GC_SCRIPT = """
    import gc, json, os, signal, sys, time, weakref
    from shmbuffer import Reader, Writer
    from shmbuffer.cli.demo_loops import make_episode

    name, daemon_pid, kill = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    gc.disable()  # collect exactly when measured, below
    alive = {{}}
    for kind in KINDS:
        if kind == "writer":
            client = Writer(name, timeout=2)
        elif kind == "writer-ticking":  # its commit thread ran and keeps ticking
            client = Writer(name, timeout=2)
            client.add_episode(make_episode(0, 0, {length}, {obs}))
        elif kind == "writer-staged":  # a small write still staged, the commit thread waiting
            client = Writer(name, timeout=2, commit_delay=60)
            client.add_episode(make_episode(0, 1, {length}, {obs}))
        else:
            client = Reader(name, timeout=2)
        if kind == "reader-leased":  # an abandoned block: the lease renewer thread started
            client.block = client.sample_episodes(1)
            client.block.__enter__()
        client.cycle = client  # unreachable but through the collector
        alive[kind] = weakref.ref(client)
        del client
        time.sleep(0.3)  # the threads' first work is done before the next collection
        gc.collect()  # what an earlier kind left is not counted against this one
    if kill == "dead":
        os.kill(daemon_pid, signal.SIGKILL)
        time.sleep(0.2)
    out = {{}}
    for kind in KINDS:
        start = time.monotonic()
        gc.collect()
        out[kind] = {{"took": time.monotonic() - start}}
    time.sleep(0.1)  # a thread that held a client sees its weak reference die
    gc.collect()
    for kind, ref in alive.items():
        out[kind]["collected"] = ref() is None
    print(json.dumps(out))
"""
KINDS = ["writer", "writer-ticking", "writer-staged", "reader", "reader-leased"]


@pytest.mark.parametrize("state", ["alive", "dead"])
def test_collecting_an_unclosed_client_never_hangs(daemon, e2e_env, state):
    """Collecting an unclosed client in a reference cycle returns, daemon alive or dead
    (``gc.collect()`` blocked forever in ``zmq_ctx_term``; a writer's commit thread kept it from
    ever being collected)."""
    d = daemon(capacity=100, unit="episode")
    with Writer(d.name, timeout=5) as w:  # something for the leased reader to sample
        w.add_episode(make_episode(1, 0, LENGTH, OBS))
    code = GC_SCRIPT.format(length=LENGTH, obs=OBS)
    head = f"import sys; sys.argv[1:] = {[d.name, str(d.pid), state]!r}; KINDS = {KINDS!r}\n"
    out = run_script(head + textwrap.dedent(code), e2e_env.environ)
    for kind in KINDS:
        assert out[kind]["took"] < 2.0, (kind, out)  # within the client's timeout
        assert out[kind]["collected"], f"{kind}: a thread of the client kept it alive"
    if state == "alive":  # the daemon is unharmed; a write still staged was stored when its
        assert d.stats()["episodes_committed"] == 3  # writer was collected


FORK_SCRIPT = """
    import json, os, signal, sys, time
    from shmbuffer import Reader, Writer
    from shmbuffer.cli.demo_loops import make_episode
    from shmbuffer.errors import ForkedClientError

    name = sys.argv[1]
    writer = Writer(name, timeout=5)
    reader = Reader(name, timeout=5)
    writer.add_episode(make_episode(0, 0, {length}, {obs}))
    writer.flush()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: every inherited call fails at once with a clear error
        signal.alarm(30)  # and a child that spins dies anyway
        report = {{}}
        calls = {{
            "writer.flush": writer.flush,
            "writer.add_episode": lambda: writer.add_episode(make_episode(0, 1, {length}, {obs})),
            "reader.sample": lambda: reader.sample(2),
            "reader.stats": reader.stats,
        }}
        for what, call in calls.items():
            start = time.monotonic()
            try:
                call()
                report[what] = ["no error", 0.0]
            except ForkedClientError as exc:
                report[what] = [str(exc), time.monotonic() - start]
        writer.close()  # closing the inherited copies is fine and leaves the parent's alone
        reader.close()
        with Writer(name, timeout=5) as fresh:  # a new client in the child works
            fresh.add_episode(make_episode(2, 0, {length}, {obs}))
        report["fresh"] = fresh.episodes_committed
        os.write(write, json.dumps(report).encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 1 << 16):
        chunks.append(chunk)
    os.waitpid(pid, 0)
    report = json.loads(b"".join(chunks))
    writer.add_episode(make_episode(0, 2, {length}, {obs}))  # the parent's clients still work
    writer.close()
    report["parent_committed"] = writer.episodes_committed
    report["parent_sample"] = len(reader.sample(4))
    reader.close()
    print(json.dumps(report))
"""


def test_client_used_after_fork_fails_fast(daemon, e2e_env):
    """A client inherited through ``fork`` fails at once in the child, naming the fork, and
    the parent's keeps working (the child's ``flush()`` on the parent's ``Writer(timeout=5)``
    spun at 100% CPU for far longer than its timeout, an inherited ``Reader.sample`` too)."""
    d = daemon(capacity=200, unit="episode")
    code = FORK_SCRIPT.format(length=LENGTH, obs=OBS)
    out = run_script(
        f"import sys; sys.argv[1:] = [{d.name!r}]\n" + textwrap.dedent(code), e2e_env.environ
    )
    for what in ("writer.flush", "writer.add_episode", "reader.sample", "reader.stats"):
        message, took = out[what]
        assert "forked" in message and "in the child" in message, (what, message)
        assert took < 0.5, (what, took)
    assert "Writer" in out["writer.flush"][0] and "Reader" in out["reader.sample"][0]
    assert out["fresh"] == 1
    assert out["parent_committed"] == 2 and out["parent_sample"] == 4
    assert d.stats()["episodes_committed"] == 3


def test_writer_and_reader_used_after_close(daemon):
    """A closed Writer or Reader raises ClosedError on every call (the Writer stored nothing
    silently, then a bare AssertionError at flush; the Reader raised ZMQError)."""
    d = daemon(capacity=200, unit="episode")
    writer = Writer(d.name, timeout=5)
    writer.add_episode(make_episode(0, 0, LENGTH, OBS))
    writer.close()
    writer.close()  # twice is fine
    episode = make_episode(0, 1, LENGTH, OBS)
    calls = {
        "add_episode": lambda: writer.add_episode(episode),
        "extend": lambda: writer.extend(episode),
        "add_transition": lambda: writer.add_transition("e", {k: v[0] for k, v in episode.items()}),
        "end_episode": lambda: writer.end_episode("e"),
        "flush": writer.flush,
    }
    for what, call in calls.items():
        with pytest.raises(ClosedError, match="this Writer is closed"):
            call()
            pytest.fail(f"Writer.{what} after close")
    reader = Reader(d.name, timeout=5)
    assert len(reader.sample(2)) == 2
    reader.close()
    reader.close()
    for call in (lambda: reader.sample(2), reader.stats, lambda: len(reader)):
        with pytest.raises(ClosedError, match="this Reader is closed"):
            call()
    with pytest.raises(ClosedError, match="this Reader is closed"), reader.sample_episodes(1):
        pass
    assert d.stats()["episodes_committed"] == 1  # nothing else was stored


@pytest.mark.parametrize("name", [None, "shared"])
def test_buffer_used_after_close(name, e2e_env):
    """A closed Buffer raises ClosedError on every call (it sampled an empty TensorDict and
    wrote into fresh zeroed memory, earlier rows then read back as zeros)."""
    buf = Buffer(100, unit="episode", name=name and f"lifecycle-{e2e_env.runtime_dir.name}")
    buf.add_episode(make_episode(0, 0, LENGTH, OBS))
    check_episode(buf[0])
    buf.close()
    buf.close()  # twice is fine
    step = {k: v[0] for k, v in make_episode(0, 1, LENGTH, OBS).items()}
    calls = [
        lambda: buf.sample(2),
        lambda: buf.sample_episodes(1),
        lambda: buf.sample_slices(1, 2),
        lambda: buf[0],
        buf.get_data,
        lambda: buf.add_episode(make_episode(0, 1, LENGTH, OBS)),
        lambda: buf.extend(make_episode(0, 1, LENGTH, OBS)),
        lambda: buf.add_transition("e", step),
        lambda: buf.end_episode("e"),
        buf.clear,
    ]
    for call in calls:
        with pytest.raises(ClosedError, match="this Buffer is closed"):
            call()
    assert buf.segment is None and len(buf) == 1  # nothing was reallocated or dropped


def test_forked_client_error_is_not_closed_error():
    # Two failures with two remedies: a closed client is reopened, a forked one recreated.
    assert not issubclass(ForkedClientError, ClosedError)
    assert ForkedClientError.code == "forked" and ClosedError.code == "closed"
