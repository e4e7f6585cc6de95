"""Access between users and what the command line says and leaves behind, against real
daemons, sockets and shared memory. Another user is played by ``nobody`` through
``tests/e2e/_as_user.py`` (a child that drops root after its imports)."""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shmbuffer import Writer
from shmbuffer.cli.demo_loops import make_episode
from shmbuffer.clients.connection import Connection
from shmbuffer.errors import DaemonUnavailableError, PermissionDeniedError
from shmbuffer.storage.schema import Schema
from shmbuffer.storage.segment import Segment
from shmbuffer.wire.curve import ENV_CURVE_CLIENT_CERT, ENV_CURVE_SERVER_KEY, keygen
from tests.e2e.conftest import CLI, START_TIMEOUT_S, wait_for

REPO = Path(__file__).resolve().parents[2]
AS_USER = [sys.executable, "-m", "tests.e2e._as_user"]
SMALL = Schema.from_spec({"obs": {"dtype": "uint8", "shape": [4]}})


def mode(path: Path | str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def write_one(target: str) -> None:
    with Writer(target, timeout=5) as w:
        w.add_episode(make_episode(0, 0, 10, (2,)))
        w.flush()


# -- another user -----------------------------------------------------------------------------


@pytest.fixture
def nobody() -> pwd.struct_passwd:
    if os.geteuid() != 0:
        pytest.skip("playing another user needs root (to become `nobody`)")
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("this machine has no `nobody` user")


@pytest.fixture
def nobody_env(nobody: pwd.struct_passwd) -> Iterator[dict[str, str]]:
    """The environment of a ``nobody`` process: its own runtime folder, and the default
    storage root (``SHMBUFFER_STORAGE_DIR`` unset); both removed afterwards."""
    root = Path(f"/dev/shm/shmbuffer-{nobody.pw_uid}")
    if root.exists():
        pytest.skip(f"{root} exists already; not ours to remove")
    runtime = Path(tempfile.mkdtemp(prefix="sbnobody-", dir="/tmp"))
    os.chown(runtime, nobody.pw_uid, nobody.pw_gid)
    env = {k: v for k, v in os.environ.items() if k != "SHMBUFFER_STORAGE_DIR"}
    env.update(SHMBUFFER_RUNTIME_DIR=str(runtime), PYTHONDONTWRITEBYTECODE="1")
    try:
        yield env
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


def run_as(
    user: pwd.struct_passwd, env: dict[str, str], *args: str, gid: int | None = None
) -> dict[str, Any]:
    """A ``_as_user`` scenario as ``user`` (in group ``gid``, default its own); its JSON."""
    group = user.pw_gid if gid is None else gid
    done = subprocess.run(
        [*AS_USER, str(user.pw_uid), str(group), *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.fixture
def first_user_segment(monkeypatch: pytest.MonkeyPatch) -> Iterator[Segment]:
    """A segment of ours (root's) in the default storage root: we were on the machine first."""
    monkeypatch.delenv("SHMBUFFER_STORAGE_DIR", raising=False)
    name = f"first-{uuid.uuid4().hex[:8]}"
    seg = Segment.create(name, SMALL, 4)
    root = seg.path.parent
    made_root = not any(p.name != name for p in root.iterdir())
    try:
        yield seg
    finally:
        seg.close()
        Segment.unlink(name)
        if made_root:
            with contextlib.suppress(OSError):
                root.rmdir()


def test_second_user_gets_its_own_default_storage(first_user_segment, nobody, nobody_env):
    """A second user gets a default storage root of its own: the first user's owner-only root
    does not lock it out."""
    seen = run_as(nobody, nobody_env, "segment", "nobody-seg", str(first_user_segment.path))
    root = Path(f"/dev/shm/shmbuffer-{nobody.pw_uid}")
    assert seen["root"] == str(root)
    assert seen["created"] == str(root / "nobody-seg"), seen
    assert (os.stat(root).st_uid, mode(root)) == (nobody.pw_uid, 0o700)
    assert isinstance(seen["cleanup"], list), seen  # ran, whatever else /dev/shm holds
    assert first_user_segment.path.parent != root  # and ours stays apart, still private
    assert mode(first_user_segment.path.parent) & 0o077 == 0


def test_default_storage_root_planted_by_another_user_is_refused(nobody, nobody_env):
    """The per-user root sits in world-writable /dev/shm: one made first by someone else
    (here uid 4242, mode 0777) could have our segment folders swapped, so it is refused."""
    root = Path(f"/dev/shm/shmbuffer-{nobody.pw_uid}")
    root.mkdir(mode=0o777)
    os.chmod(root, 0o777)
    os.chown(root, 4242, 4242)
    seen = run_as(nobody, nobody_env, "segment", "nobody-seg", "/nonexistent")
    assert seen["created"].startswith(f"PermissionDeniedError: refusing storage folder {root}")
    assert "belongs to uid 4242" in seen["created"] and "--storage-dir" in seen["created"]
    assert list(root.iterdir()) == []


def test_second_user_daemon_with_a_lazy_schema(first_user_segment, nobody, nobody_env):
    """The same through the daemon: the writer's first episode allocates the segment in the
    second user's own root (it used to get `internal error: PermissionError`)."""
    name = f"nob-{uuid.uuid4().hex[:8]}"
    runtime = Path(nobody_env["SHMBUFFER_RUNTIME_DIR"])
    log = runtime.parent / f"{runtime.name}.log"
    with open(log, "wb") as out:
        daemon = subprocess.Popen(
            [*AS_USER, str(nobody.pw_uid), str(nobody.pw_gid), "daemon", *("--name", name)],
            env=nobody_env,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:

        def ready() -> bool:
            assert daemon.poll() is None, log.read_text()
            return (runtime / f"{name}.json").is_file()

        wait_for(ready, START_TIMEOUT_S, what="the daemon of `nobody`")
        seen = run_as(nobody, nobody_env, "write", name)
        assert seen.get("sampled") == 4, (seen, log.read_text())
        assert seen["segment"] == f"/dev/shm/shmbuffer-{nobody.pw_uid}/{name}"
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(20) == 0, log.read_text()
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait(10)
        log.unlink(missing_ok=True)


def test_group_member_finds_the_daemon_by_name(daemon, e2e_env, nobody):
    """Refusing untrusted runtime folders keeps ``--group`` working: a member reads the
    runtime folder (another user's, 0750) through SHMBUFFER_RUNTIME_DIR, connects and maps the
    segment."""
    try:
        gid = grp.getgrnam("nogroup").gr_gid
    except KeyError:
        pytest.skip("no `nogroup` group")
    d = daemon(args=["--group", "nogroup"])
    env = {**e2e_env.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    seen = run_as(nobody, env, "write", d.name, gid=gid)
    assert seen.get("sampled") == 4, (seen, d.log())
    assert mode(e2e_env.runtime_dir) == 0o750


@pytest.mark.parametrize("refuses", ["folder", "socket"])
def test_another_users_ipc_daemon_is_refused_at_once_naming_what_to_do(
    daemon, e2e_env, nobody, refuses
):
    """A user who may not reach another user's ipc socket (its folder is private, or the
    socket 0600) is told so at once with PermissionDeniedError, whose path refuses, and how
    the daemon's user can share it; ZeroMQ alone retries quietly until the client's timeout
    and ends in a DaemonUnavailableError asking whether the daemon runs."""
    d = daemon()
    write_one(d.name)
    if refuses == "socket":
        os.chmod(e2e_env.runtime_dir, 0o711)  # the folder may be passed, the socket is 0600
    env = {**e2e_env.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    seen = run_as(nobody, env, "write", d.endpoint)
    error = seen.get("error", "")
    assert error.startswith("PermissionDeniedError: "), seen
    blocker = e2e_env.runtime_dir if refuses == "folder" else d.endpoint[len("ipc://") :]
    assert f"{blocker} belongs to root" in error, seen
    assert "--group" in error and "remote=True" in error, seen
    assert seen["seconds"] < 5, seen  # at once, not after its 10 s timeout
    assert d.stats()["writers"] == 0  # it never got through


def test_another_user_on_loopback_tcp_maps_no_segment_and_is_told_remote(
    daemon, e2e_env, nobody, tmp_path
):
    """On loopback tcp without CURVE any local user may read and write, but the segment stays
    its owner's (0700 folder, 0600 files): a client of another user that would map it is
    refused with PermissionDeniedError naming remote=True, with which it works."""
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(Schema.from_batch(make_episode(0, 0, 1, (2,))).to_spec()))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    d = daemon(args=["--endpoint", endpoint, "--schema", str(schema)])
    env = {**e2e_env.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    seen = run_as(nobody, env, "write", endpoint)
    error = seen.get("error", "")
    assert error.startswith("PermissionDeniedError: "), seen
    assert f"{e2e_env.storage_dir} belongs to root" in error, seen
    assert "passes remote=True" in error, seen
    seen = run_as(nobody, env, "write", endpoint, "remote")
    assert seen.get("sampled") == 4 and seen["segment"] is None, seen
    assert d.stats()["episodes_committed"] == 1


# -- runtime folders and files others could write or plant are refused -------------------------


@pytest.fixture
def tmp_base(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private temp dir standing in for /tmp, for the default ``<tmp>/shmbuffer-<uid>``."""
    base = Path(tempfile.mkdtemp(prefix="sbtmp-", dir="/tmp"))
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_runtime_folder_planted_by_another_user_is_refused(
    daemon, e2e_env, tmp_base, nobody, monkeypatch
):
    """The reproduction: another user pre-made ``/tmp/shmbuffer-<uid>`` 0777 and put a runtime
    file in it naming their own tcp daemon. Our daemon and our Writer must refuse the folder."""
    theirs = daemon(args=["--endpoint", "tcp://127.0.0.1:*"])  # the other user's daemon
    planted = tmp_base / f"shmbuffer-{os.getuid()}"
    planted.mkdir()
    os.chmod(planted, 0o777)
    os.chown(planted, nobody.pw_uid, nobody.pw_gid)
    info = {**e2e_env.read_runtime(theirs.name), "name": "victim"}
    (planted / "victim.json").write_text(json.dumps(info))
    os.chown(planted / "victim.json", nobody.pw_uid, nobody.pw_gid)

    env = {k: v for k, v in e2e_env.environ.items() if k != "SHMBUFFER_RUNTIME_DIR"}
    env.pop("XDG_RUNTIME_DIR", None)
    env["TMPDIR"] = str(tmp_base)
    start = subprocess.run(
        [*CLI, "start", "--name", "mine", "--storage-dir", str(e2e_env.storage_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
        check=False,
    )
    assert start.returncode == 1, start.stderr
    assert f"refusing runtime folder {planted}" in start.stderr
    assert f"belongs to uid {nobody.pw_uid}" in start.stderr
    assert "lets other users write" in start.stderr
    assert "Traceback" not in start.stderr
    assert not (planted / "mine.json").exists()

    monkeypatch.delenv("SHMBUFFER_RUNTIME_DIR")
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_base))
    with pytest.raises(PermissionDeniedError, match="refusing runtime folder"):
        Writer("victim", timeout=2)
    conn = Connection(theirs.endpoint, "reader", timeout=5)  # by endpoint: env is patched
    try:
        assert conn.buffer["schema"] is None  # the victim never defined its schema there
    finally:
        conn.close()


def test_runtime_file_others_may_write_is_refused(daemon, e2e_env):
    d = daemon()
    path = e2e_env.runtime_file(d.name)
    os.chmod(path, 0o666)
    with pytest.raises(PermissionDeniedError, match=f"refusing runtime file {path}"):
        Writer(d.name, timeout=2)
    os.chmod(path, 0o600)
    write_one(d.name)  # as before once the file is private again


# -- admin over tcp needs CURVE or --insecure-tcp-admin ----------------------------------------


def test_admin_ops_need_a_credential_on_tcp(daemon, e2e_env, tmp_path):
    d = daemon(args=["--endpoint", "tcp://127.0.0.1:*"])
    write_one(d.endpoint)
    conn = Connection(d.endpoint, "admin", timeout=5)  # any local user could do this
    try:
        assert conn.call("stats")["stats"]["episodes"] == 1  # status stays readable
        for op, fields in (("clear", {}), ("shutdown", {}), ("checkpoint", {"to": "/tmp/x"})):
            with pytest.raises(PermissionDeniedError) as info:
                conn.call(op, **fields)
            assert "no CURVE authentication" in str(info.value), op
            assert "--insecure-tcp-admin" in str(info.value), op
        assert conn.call("stats")["stats"]["episodes"] == 1  # nothing was cleared
    finally:
        conn.close()
    assert d.process.poll() is None

    # its owner still stops it by name: `stop` falls back to SIGTERM
    stop = subprocess.Popen(
        [*CLI, "stop", "--name", d.name], env=e2e_env.environ, stderr=subprocess.PIPE, text=True
    )
    try:
        assert d.process.wait(20) == 0
        _, err = stop.communicate(timeout=20)
    finally:
        stop.kill()
    assert stop.returncode == 0, err
    assert "SIGTERM" in err


def test_insecure_tcp_admin_allows_them(daemon, e2e_env):
    d = daemon(args=["--endpoint", "tcp://127.0.0.1:*", "--insecure-tcp-admin"])
    assert "INSECURE: any client of" in d.log()
    write_one(d.endpoint)
    conn = Connection(d.endpoint, "admin", timeout=5)
    try:
        conn.call("clear")
        assert conn.call("stats")["stats"]["episodes"] == 0
    finally:
        conn.close()
    stop = subprocess.Popen(  # `stop` takes an endpoint, as `status` does
        [*CLI, "stop", "--name", d.endpoint], env=e2e_env.environ, stderr=subprocess.PIPE
    )
    try:
        assert d.process.wait(20) == 0
        _, err = stop.communicate(timeout=20)
    finally:
        stop.kill()
    assert stop.returncode == 0, err


# -- what the command line says and leaves behind ----------------------------------------------


def test_stop_by_ipc_endpoint(daemon, e2e_env):
    d = daemon()
    stop = subprocess.Popen(
        [*CLI, "stop", "--name", d.endpoint], env=e2e_env.environ, stderr=subprocess.PIPE
    )
    try:
        assert d.process.wait(20) == 0
        _, err = stop.communicate(timeout=20)
    finally:
        stop.kill()
    assert stop.returncode == 0, err
    assert not e2e_env.runtime_file(d.name).exists()


def test_crash_hint_and_resume_log(daemon, e2e_env):
    d = daemon(capacity=100)
    write_one(d.name)
    d.process.send_signal(signal.SIGKILL)
    d.process.wait(10)
    with pytest.raises(DaemonUnavailableError, match=f"start --name {d.name} --resume"):
        Writer(d.name, timeout=2)
    resumed = daemon(name=d.name, capacity=100, args=["--resume"])
    assert resumed.stats()["episodes"] == 1
    text = resumed.log()
    assert "segment and journal are kept and resumed" in text, text
    assert "runtime file and segment" not in text


def test_refused_detach_prints_the_reason(daemon, e2e_env):
    d = daemon()
    again = e2e_env.cli(
        "start", "--detach", "--name", d.name, "--storage-dir", str(e2e_env.storage_dir)
    )
    assert again.returncode == 1
    assert "already served by pid" in again.stderr, again.stderr
    assert d.process.poll() is None


def test_detached_daemon_files_are_private(e2e_env):
    name = "e2e-private"
    out = e2e_env.cli(
        "start", "--detach", "--name", name, "--storage-dir", str(e2e_env.storage_dir)
    )
    info = e2e_env.read_runtime(name)
    if info is not None:
        e2e_env.extra_pids.append(int(info["pid"]))
    assert out.returncode == 0, out.stdout + out.stderr
    assert mode(e2e_env.runtime_dir / f"{name}.log") == 0o600
    assert mode(e2e_env.runtime_dir / f"{name}.pid") == 0o600
    assert mode(e2e_env.runtime_file(name)) == 0o600
    assert e2e_env.cli("stop", "--name", name).returncode == 0
    wait_for(lambda: not e2e_env.runtime_file(name).exists(), 10, what="the daemon to stop")


def test_cleanup_removes_logs_of_daemons_that_are_gone(e2e_env):
    rdir = e2e_env.runtime_dir
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(30)
    stale = {"name": "gone", "endpoint": "ipc:///nowhere", "pid": dead.pid}
    (rdir / "gone.json").write_text(json.dumps({**stale, "host": socket.gethostname()}))
    os.chmod(rdir / "gone.json", 0o600)
    for n in ("gone", "stopped", "starting"):
        (rdir / f"{n}.log").write_text("log\n")
    old = time.time() - 3600
    os.utime(rdir / "stopped.log", (old, old))  # a daemon that stopped an hour ago

    done = e2e_env.cli("cleanup", "--storage-dir", str(e2e_env.storage_dir))
    assert done.returncode == 0, done.stderr
    assert not (rdir / "gone.json").exists()
    assert not (rdir / "gone.log").exists()
    assert not (rdir / "stopped.log").exists()
    assert (rdir / "starting.log").exists()  # just written: a daemon may still be starting


def test_cleanup_skips_what_it_cannot_trust(e2e_env):
    (e2e_env.runtime_dir / "odd name.json").write_text("{}")
    (e2e_env.runtime_dir / "loose.json").write_text("{}")
    os.chmod(e2e_env.runtime_dir / "loose.json", 0o666)
    done = e2e_env.cli("cleanup", "--dry-run", "--storage-dir", str(e2e_env.storage_dir))
    assert done.returncode == 0, done.stderr
    assert "skipping" in done.stderr and "loose.json" in done.stderr


def test_failed_curve_handshake_fails_fast(daemon, tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_CURVE_SERVER_KEY, raising=False)
    monkeypatch.delenv(ENV_CURVE_CLIENT_CERT, raising=False)
    _, secret = keygen(tmp_path / "server", "server")
    other, _ = keygen(tmp_path / "other", "other")
    d = daemon(args=["--endpoint", "tcp://127.0.0.1:*", "--curve-secret", str(secret)])
    for keys in ({"curve_server_key": other}, {}):  # a wrong server key; no keys at all
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailableError, match="CURVE"):
            Connection(d.endpoint, "reader", timeout=30, **keys)
        assert time.monotonic() - t0 < 5, keys  # not the full 30 s timeout
