"""The ``shmbuffer-daemon`` command line: start, status, stop, --detach, stale runtime files."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from shmbuffer import Writer
from shmbuffer.cli.demo_loops import make_episode
from tests.e2e.conftest import CLI, START_TIMEOUT_S, wait_for


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_start_status_refuse_stop(daemon, e2e_env):
    d = daemon(capacity=1234, unit="episode", via_cli=True)  # the console entry itself
    with Writer(d.name) as w:  # a schema, hence a segment folder, to be unlinked by stop
        w.add_episode(make_episode(0, 0, 10, (2,)))
    assert (d.segment_path / "manifest.json").is_file()

    text = e2e_env.cli("status", "--name", d.name)
    assert text.returncode == 0, text.stderr
    assert d.name in text.stdout
    assert "1,234 rows" in text.stdout
    assert "unit=episode" in text.stdout

    js = e2e_env.cli("status", "--name", d.name, "--json")
    assert js.returncode == 0, js.stderr
    stats = json.loads(js.stdout)
    assert stats["name"] == d.name
    assert stats["capacity"] == 1234
    assert stats["pid"] == d.pid
    assert stats["episodes_committed"] == 1

    again = e2e_env.cli(
        "start", "--name", d.name, "--capacity", "10", "--storage-dir", str(d.storage_dir)
    )
    assert again.returncode != 0
    assert "already served" in again.stderr
    assert e2e_env.read_runtime(d.name)["pid"] == d.pid  # the live daemon's file is untouched
    assert d.process.poll() is None

    # `stop` waits for the pid to vanish; as the daemon's parent we must reap it meanwhile
    # (a zombie still answers kill(pid, 0))
    stop = subprocess.Popen(
        [*CLI, "stop", "--name", d.name],
        env=e2e_env.environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert d.process.wait(20) == 0
        _, err = stop.communicate(timeout=20)
    finally:
        stop.kill()
    assert stop.returncode == 0, err
    assert not e2e_env.runtime_file(d.name).exists()
    assert not d.segment_path.exists()
    assert not (e2e_env.runtime_dir / f"{d.name}.sock").exists()

    gone = e2e_env.cli("status", "--name", d.name, "--timeout", "2")
    assert gone.returncode != 0
    assert e2e_env.cli("stop", "--name", d.name).returncode != 0


@pytest.mark.slow
def test_detach_then_stop(e2e_env):
    name = "e2e-detached"
    out = e2e_env.cli(
        "start",
        "--detach",
        "--name",
        name,
        "--capacity",
        "100",
        "--storage-dir",
        str(e2e_env.storage_dir),
        "--ready-timeout",
        "20",
    )
    match = re.search(r"ready: pid (\d+)", out.stdout)
    if match:
        e2e_env.extra_pids.append(int(match.group(1)))
    assert out.returncode == 0, out.stdout + out.stderr
    assert match, out.stdout
    pid = int(match.group(1))
    assert e2e_env.read_runtime(name)["pid"] == pid
    assert _pid_alive(pid)
    status = e2e_env.cli("status", "--name", name, "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["pid"] == pid

    stop = e2e_env.cli("stop", "--name", name)
    assert stop.returncode == 0, stop.stderr
    wait_for(lambda: not _pid_alive(pid), 10, what="the detached daemon to exit")
    assert not e2e_env.runtime_file(name).exists()


def test_stale_runtime_file_is_replaced(daemon, e2e_env):
    name = "e2e-stale"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(30)
    stale = {
        "name": name,
        "endpoint": f"ipc://{e2e_env.runtime_dir / 'gone.sock'}",
        "pid": dead.pid,
        "storage_dir": str(e2e_env.storage_dir),
        "protocol": "1.0",
        "host": socket.gethostname(),
        "written": time.time(),
    }
    e2e_env.runtime_file(name).write_text(json.dumps(stale))
    leftover = e2e_env.storage_dir / name
    leftover.mkdir(parents=True)
    (leftover / "junk").write_bytes(b"x")

    # nothing serves it: clients and `stop` say so instead of hanging on a dead endpoint
    assert e2e_env.cli("stop", "--name", name).returncode != 0
    from shmbuffer.errors import DaemonUnavailableError

    with pytest.raises(DaemonUnavailableError, match="gone"):
        Writer(name, timeout=2)

    # start as a user does; the fixture waits until the runtime file names the new pid
    d = daemon(name=name, capacity=100, via_cli=True)
    assert e2e_env.read_runtime(name)["pid"] == d.pid != dead.pid
    assert not (leftover / "junk").exists()  # the dead daemon's segment was cleared
    assert d.stats()["capacity"] == 100


# -- usage errors: refused before anything starts, with a message and no traceback ------------


@pytest.mark.parametrize(
    ("args", "rc", "message"),
    [
        (["--endpoint", "tcp://127.0.0.1:99999"], 1, "port '99999' is not 1-65535"),
        (["--endpoint", "tcp://127.0.0.1"], 1, "expected tcp://HOST:PORT"),
        (["--endpoint", "udp://127.0.0.1:5555"], 1, "transport 'udp' is not supported"),
        (["--endpoint", "ipc:///tmp/" + "x" * 120 + ".sock"], 1, "over the kernel's limit"),
        (["--reservation-ttl", "nan"], 2, "--reservation-ttl: must be a positive, finite"),
        (["--lease-ttl", "-1"], 2, "--lease-ttl: must be a positive, finite"),
        (
            ["--capacity", "16", "--rate-limiter", "min-size", "--min-size", "17"],
            1,
            "--min-size=17 is above the buffer's capacity of 16 rows",
        ),
        (
            ["--capacity", "16", "--rate-limiter", "min-size", "--min-size", "9" * 20],
            1,
            "--min-size=99999999999999999999 is above the buffer's capacity of 16 rows",
        ),
    ],
)
def test_start_refuses_bad_settings(e2e_env, args, rc, message):
    argv = ["start", "--name", "bad", "--storage-dir", str(e2e_env.storage_dir), *args]
    done = e2e_env.cli(*argv, timeout=START_TIMEOUT_S)  # a daemon that starts fails here
    assert done.returncode == rc, done.stderr
    assert message in done.stderr
    assert "Traceback" not in done.stderr
    assert e2e_env.read_runtime("bad") is None


@pytest.mark.parametrize(
    ("file", "text", "message"),
    [
        ("schema.toml", "obs = { dtype = ", "Invalid"),
        ("schema.toml", 'obs = { dtype = "uint9", shape = [2] }', "uint9"),
        ("schema.json", '{"obs": ', "Expecting value"),
        ("daemon.toml", "reservation_ttl = nan", "reservation_ttl must be a positive, finite"),
        ("daemon.toml", "lease_ttl = ", "Invalid"),
        (
            "daemon.toml",
            'capacity = 16\nrate_limiter = "min-size"\nmin_size = 17',
            "--min-size=17 is above the buffer's capacity of 16 rows",
        ),
    ],
)
def test_file_errors_name_the_file(e2e_env, tmp_path, file, text, message):
    path = tmp_path / file
    path.write_text(text)
    option = "--config" if file.startswith("daemon") else "--schema"
    done = e2e_env.cli(
        "start", "--name", "bad", "--storage-dir", str(e2e_env.storage_dir), option, str(path)
    )
    assert done.returncode == 1, done.stderr
    if file.startswith("schema"):  # the config loader's own value errors name the setting
        assert f"schema file {path}" in done.stderr
    elif message == "Invalid":  # a file that does not parse; a bad value names its flag
        assert f"config file {path}" in done.stderr
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def test_configure_refuses_a_min_size_the_buffer_cannot_hold(daemon, e2e_env):
    """Above the capacity every sample would wait forever; past what msgpack carries the
    client could not even send it. Both are refused naming the flag; nothing changes."""
    d = daemon(capacity=16, unit="transition", args=["--rate-limiter", "min-size"])
    for value, message in [
        ("17", "--min-size=17 is above the buffer's capacity of 16 rows"),
        ("99999999999999999999", "--min-size"),
    ]:
        done = e2e_env.cli("configure", "--name", d.name, "--min-size", value)
        assert done.returncode == 1, done.stderr
        assert message in done.stderr and "Traceback" not in done.stderr
    assert d.stats()["rate_limiter"]["min_size"] == 1
    done = e2e_env.cli("configure", "--name", d.name, "--min-size", "16")
    assert done.returncode == 0, done.stderr
    assert d.stats()["rate_limiter"]["min_size"] == 16


def test_status_watch_needs_a_positive_interval(daemon, e2e_env):
    d = daemon()
    done = e2e_env.cli("status", "--name", d.name, "--watch", "-1")
    assert done.returncode == 2
    assert "--watch: must be a positive, finite number of seconds" in done.stderr
    assert d.process.poll() is None


# -- a closed stdout (`status | head -1`) -------------------------------------------------------


@pytest.mark.parametrize("extra", [[], ["--json"], ["--watch", "0.1"]])
def test_status_into_a_closed_pipe_exits_quietly_as_unix_tools_do(daemon, e2e_env, extra):
    """The reader of stdout gone (``| head -2`` that has read its lines) is not an error to
    report: like a tool killed by SIGPIPE, the command ends at once, says nothing on stderr
    and exits 128 + SIGPIPE (what a shell shows for ``yes | head -1`` under pipefail). The
    pipe's read end is closed before the command starts, so every run hits it, not one in a
    few."""
    d = daemon()
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [*CLI, "status", "--name", d.name, *extra],
            env=e2e_env.environ,
            stdout=write_end,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            timeout=30,
            check=False,
        )
    finally:
        os.close(write_end)
    assert done.stderr == ""
    assert done.returncode == 128 + signal.SIGPIPE
    assert d.process.poll() is None
