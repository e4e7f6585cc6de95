"""Live status and metrics of a real daemon: ``status --watch`` under a pseudo-terminal follows
a spawned writer's inserts, and ``start --metrics-port`` serves Prometheus text over HTTP
whose counters rise after a write."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import re
import signal
import socket
import struct
import subprocess
import termios
import threading
import time
import urllib.request
from typing import Any

import pytest

from shmbuffer import Reader, Writer
from shmbuffer.cli.demo_loops import make_episode
from tests.e2e.conftest import CLI, wait_for

pytest.importorskip("rich")

ANSI = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|[@-Z\\-_])")


class Terminal:
    """A pseudo-terminal (50 x 140) for a child's stdout; a thread drains what it draws, so
    the child never blocks on a full pty buffer."""

    def __init__(self) -> None:
        self.master, self.slave = pty.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 140, 0, 0))
        self._raw = bytearray()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # EIO: the child closed its side; EBADF: we closed ours
                return
            if not data:
                return
            with self._lock:
                self._raw += data

    @property
    def raw(self) -> str:
        with self._lock:
            return self._raw.decode(errors="replace")

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw)

    def committed(self) -> list[int]:
        """Every "rows committed N" figure drawn so far, frame by frame (a number at the very
        end may be cut by a read: only one followed by the cell's padding counts)."""
        found = re.findall(r"rows committed\s+([\d,]+)(?=\s)", self.text)
        return [int(n.replace(",", "")) for n in found]

    def started(self) -> None:
        """The child holds the slave side now: ours goes, so the child's exit ends the drain
        (EIO) instead of leaving the thread blocked in a read."""
        os.close(self.slave)

    def close(self) -> None:
        self._thread.join(5.0)  # the child has exited: the read ends at once
        with contextlib.suppress(OSError):
            os.close(self.master)


def write_on_signal(runtime_dir: str, go: str, name: str, episodes: int, length: int) -> None:
    """A spawned writer that starts once the file ``go`` exists (its interpreter starts while
    the watch starts, so the test waits for neither twice)."""
    os.environ["SHMBUFFER_RUNTIME_DIR"] = runtime_dir
    from shmbuffer.cli.demo_loops import writer_loop

    deadline = time.monotonic() + 60
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            raise SystemExit(2)
        time.sleep(0.02)
    writer_loop(name, 1, episodes, length, (2,))


def test_status_watch_draws_a_live_view_that_follows_a_writer(daemon, e2e_env, children):
    d = daemon(capacity=2000, unit="episode")
    go = e2e_env.runtime_dir / "go"
    writer = children.ctx.Process(
        target=write_on_signal,
        args=(str(e2e_env.runtime_dir), str(go), d.name, 20, 10),
        daemon=True,
    )
    writer.start()
    children.procs.append(writer)  # killed in teardown if it hangs
    term = Terminal()
    env = {**e2e_env.environ, "TERM": "xterm-256color", "COLUMNS": "140", "LINES": "50"}
    env.pop("NO_COLOR", None)
    watch = subprocess.Popen(
        [*CLI, "status", "--name", d.name, "--watch", "0.2"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=term.slave,
        stderr=subprocess.PIPE,
    )
    term.started()
    try:
        with Writer(d.name) as mine:  # a client that stays connected: its row is drawn
            wait_for(term.committed, 30, what="a first frame of the live view")
            assert term.committed()[0] == 0
            assert "╭" in term.raw  # rich's panels, not the plain text frames
            go.touch()
            assert children.join(writer, 60) == 0
            wait_for(lambda: term.committed()[-1] == 200, 30, what="200 rows committed drawn")
            seen = term.committed()
            assert seen == sorted(seen), seen  # the figure only ever rose, frame by frame
            mine.add_episode(make_episode(0, 0, 5, (2,)))
            mine.flush()

            def my_row() -> list[str]:  # this process's writer, with its own 5 rows
                me = f" {os.getpid()} "
                lines = term.text.splitlines()
                return [x for x in lines if me in x and " writer " in x and " 5 (" in x]

            wait_for(my_row, 30, what="this process's writer drawn with its 5 rows")
            assert term.committed()[-1] == 205
        assert "fill" in term.text and "rate limiter" in term.text and "sampler" in term.text
    finally:
        watch.send_signal(signal.SIGINT)
        try:
            watch.wait(10)
        except subprocess.TimeoutExpired:
            watch.kill()
            watch.wait(10)
        assert watch.stderr is not None
        stderr = watch.stderr.read().decode()
        watch.stderr.close()
        term.close()
    assert watch.returncode == 0, stderr


def test_status_watch_without_a_terminal_prints_plain_frames(daemon, e2e_env):
    d = daemon(capacity=100, unit="episode")
    with subprocess.Popen(
        [*CLI, "status", "--name", d.name, "--watch", "0.2"],
        env=e2e_env.environ,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as watch:
        try:
            first = watch.stdout.read1(65536).decode() if watch.stdout else ""
        finally:
            watch.send_signal(signal.SIGINT)
            watch.communicate(timeout=10)
    assert first.startswith("\x1b[H\x1b[2J") and "capacity    100 rows" in first
    assert "╭" not in first


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def test_metrics_port_serves_prometheus_metrics_that_follow_writes(daemon, e2e_env, children):
    pytest.importorskip("prometheus_client")
    port = free_port()
    d = daemon(capacity=2000, unit="episode", args=["--metrics-port", str(port)])
    url = f"http://127.0.0.1:{port}/metrics"
    assert e2e_env.read_runtime(d.name)["metrics"] == url  # loopback by default

    first: dict[str, Any] = wait_for(
        lambda: (m := scrape(url)).get("shmbuffer_capacity_rows") and m, 30, what="a snapshot"
    )
    for name in (
        "shmbuffer_rows_committed_total",
        "shmbuffer_episodes_committed_total",
        "shmbuffer_rows_sampled_total",
        "shmbuffer_samples_total",
        "shmbuffer_rows",
        "shmbuffer_fill_ratio",
        "shmbuffer_leases",
        "shmbuffer_reservations",
        'shmbuffer_clients{role="writer"}',
        'shmbuffer_clients{role="reader"}',
        'shmbuffer_rate_limiter_blocked_seconds_total{queue="insert"}',
        'shmbuffer_rate_limiter_blocked_seconds_total{queue="sample"}',
        "shmbuffer_sample_seconds_count",
    ):
        assert name in first, f"{name} not scraped: {sorted(first)}"
    assert first["shmbuffer_capacity_rows"] == 2000
    assert first["shmbuffer_rows_committed_total"] == 0

    children.spawn("w", "write_episodes", d.name, 1, 10, 10, (2,))
    assert children.collect({"w"}, timeout=60) == {"w": 10}
    after = wait_for(
        lambda: (m := scrape(url))["shmbuffer_rows_committed_total"] == 100 and m,
        30,
        what="rows_committed_total to reach 100",
    )
    assert after["shmbuffer_episodes_committed_total"] == 10
    assert after["shmbuffer_rows"] == 100
    assert after["shmbuffer_fill_ratio"] == pytest.approx(0.05)
    assert after['shmbuffer_request_seconds_count{op="reserve"}'] >= 1  # commits ride on it

    with Reader(d.name, local_draws=False) as reader:  # the daemon's draw, timed
        reader.sample(4)
        sampled = wait_for(
            lambda: (m := scrape(url))["shmbuffer_sample_seconds_count"] >= 1 and m,
            30,
            what="a sample timed",
        )
        assert sampled["shmbuffer_samples_total"] >= 1
        assert sampled["shmbuffer_rows_sampled_total"] >= 4
        assert sampled['shmbuffer_clients{role="reader"}'] == 1
        assert sampled["shmbuffer_sample_seconds_sum"] > 0


def test_a_bad_metrics_port_is_refused_naming_the_flag(e2e_env):
    bad = e2e_env.cli(
        "start", "--name", "badport", "--metrics-port", "70000", "--storage-dir", "/dev/shm/x"
    )
    assert bad.returncode == 1
    assert "--metrics-port must be a port of 1-65535" in bad.stderr
    assert e2e_env.read_runtime("badport") is None
