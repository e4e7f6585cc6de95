"""``--group`` discovery: members of a daemon's group find it by name with
nothing set, through its record in ``/tmp/shmbuffer-g<gid>/<uid>/`` (``shmbuffer/runtime.py``);
users outside the group are refused with a clear error.

Against a real daemon, another user is played by ``nobody`` through ``tests/e2e/_as_user.py``
(needs root). The checks a client makes of a group folder and the records in it are exercised
in process further down, on folders planted in a temporary base (root too: they chown)."""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shmbuffer import runtime
from shmbuffer.errors import DaemonUnavailableError, PermissionDeniedError
from tests.e2e.conftest import wait_for

REPO = Path(__file__).resolve().parents[2]
AS_USER = [sys.executable, "-m", "tests.e2e._as_user"]
STRANGER_UID = 4242  # in no passwd entry: a member only by the groups it runs with


def mode(path: Path | str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def nobody() -> pwd.struct_passwd:
    if os.geteuid() != 0:
        pytest.skip("playing another user needs root (to become `nobody`)")
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("this machine has no `nobody` user")


@pytest.fixture
def group() -> int:
    try:
        return grp.getgrnam("nogroup").gr_gid
    except KeyError:
        pytest.skip("no `nogroup` group to share with")


@pytest.fixture
def bare_env(nobody: pwd.struct_passwd) -> Iterator[dict[str, str]]:
    """The environment of a ``nobody`` client that sets nothing: no ``SHMBUFFER_RUNTIME_DIR``
    (nor ``XDG_RUNTIME_DIR``/``TMPDIR``), so its own runtime folder is the default
    ``/tmp/shmbuffer-<uid>``, removed afterwards if this test made it."""
    own = Path(tempfile.gettempdir()) / f"shmbuffer-{nobody.pw_uid}"
    existed = own.exists()
    drop = ("SHMBUFFER_RUNTIME_DIR", "XDG_RUNTIME_DIR", "TMPDIR", "SHMBUFFER_STORAGE_DIR")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    try:
        yield env
    finally:
        if not existed:
            shutil.rmtree(own, ignore_errors=True)


def run_as(uid: int, gid: int, env: dict[str, str], *args: str) -> dict[str, Any]:
    """A ``_as_user`` scenario as ``uid`` in group ``gid`` only; its JSON line."""
    done = subprocess.run(
        [*AS_USER, str(uid), str(gid), *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def published(name: str, gid: int) -> Path:
    return runtime.group_user_dir(gid, os.getuid()) / f"{name}.json"


# -- against a real daemon ----------------------------------------------------------------------


def test_member_finds_the_daemon_by_name_with_nothing_set(daemon, group, nobody, bare_env):
    """``nobody``, in the daemon's group, writes and samples by name: it sets no
    ``SHMBUFFER_RUNTIME_DIR``, and its own runtime folder is not the daemon's."""
    d = daemon(args=["--group", "nogroup"])
    record = published(d.name, group)
    wait_for(record.exists, 20.0, what="the record in the group folder")
    sock = Path(d.endpoint[len("ipc://") :])
    assert sock.parent == runtime.group_user_dir(group)  # reachable wherever the runtime dir is
    base = runtime.group_dir(group)
    assert (mode(base), os.stat(base).st_gid) == (0o3770, group)
    assert (mode(record.parent), os.stat(record.parent).st_gid) == (0o750, group)
    assert (mode(record), os.stat(record).st_gid) == (0o640, group)
    assert (mode(sock), os.stat(sock).st_gid) == (0o660, group)
    assert json.loads(record.read_text())["pid"] == d.pid

    seen = run_as(nobody.pw_uid, group, bare_env, "write", d.name)
    assert seen.get("sampled") == 4, (seen, d.log())
    assert seen["segment"] == str(d.segment_path)
    assert d.stats()["episodes"] == 1

    assert d.stop() == 0  # a stopped daemon takes its record and socket with it
    assert not record.exists() and not sock.exists()


def test_user_outside_the_group_is_refused(daemon, e2e_env, group, nobody, bare_env):
    """``nobody`` in another group finds nothing by name, and is told why; pointing
    ``SHMBUFFER_RUNTIME_DIR`` at the daemon's folder is refused as unreadable."""
    other = next(g.gr_gid for g in grp.getgrall() if g.gr_gid not in (group, 0))
    d = daemon(args=["--group", "nogroup"])
    wait_for(published(d.name, group).exists, 20.0, what="the record in the group folder")
    seen = run_as(nobody.pw_uid, other, bare_env, "resolve", d.name, str(e2e_env.runtime_dir))
    by_name, by_dir = seen["by_name"], seen["by_dir"]
    assert by_name.startswith(f"DaemonUnavailableError: no daemon serves buffer {d.name!r}")
    assert "found by name only by members of its --group" in by_name, by_name
    assert f"your groups {other}" in by_name, by_name
    assert by_dir.startswith("PermissionDeniedError: cannot read runtime file"), by_dir
    assert "readable only by members of its group" in by_dir, by_dir
    assert d.stats()["name"] == d.name  # the daemon is unharmed


# -- the checks, in process, on planted folders -------------------------------------------------


@pytest.fixture
def base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temporary stand-in for ``/tmp`` holding the group folders, and a private runtime
    folder of our own (empty: nothing of ours serves any name)."""
    if os.geteuid() != 0:
        pytest.skip("planting other users' folders needs root (chown)")
    folder = tmp_path / "base"
    folder.mkdir()
    own = tmp_path / "own"
    own.mkdir(mode=0o700)
    monkeypatch.setattr(runtime, "GROUP_DIR_BASE", folder)
    monkeypatch.setenv("SHMBUFFER_RUNTIME_DIR", str(own))
    return folder


GID = 0  # a group root (this test process) is in


def plant(uid: int, name: str, endpoint: str, pid: int | None = None) -> Path:
    """``uid``'s record of ``name`` in group :data:`GID`'s folder, as a daemon would write it."""
    runtime.ensure_group_dir(GID)  # the group folder (and ours) made as a daemon makes them
    folder = runtime.group_user_dir(GID, uid)
    folder.mkdir(mode=0o750, exist_ok=True)
    os.chown(folder, uid, GID)
    os.chmod(folder, 0o750)  # no setgid inherited from the group folder: the message's mode
    path = folder / f"{name}.json"
    info = {"name": name, "endpoint": endpoint, "pid": pid or os.getpid()}
    path.write_text(json.dumps({**info, "host": socket.gethostname(), "uid": uid}))
    os.chown(path, uid, GID)
    os.chmod(path, 0o640)
    return path


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_own_record_wins_then_the_only_one_then_ambiguity(base):
    plant(65534, "buf", "ipc:///nobodys.sock")
    assert runtime.resolve_endpoint("buf") == "ipc:///nobodys.sock"  # the one in our groups

    runtime.write("buf", {"endpoint": "ipc:///own.sock", "pid": os.getpid()})
    assert runtime.resolve_endpoint("buf") == "ipc:///own.sock"  # our own runtime dir wins
    runtime.remove("buf")

    plant(STRANGER_UID, "buf", "ipc:///strangers.sock")
    with pytest.raises(
        DaemonUnavailableError, match="'buf' is ambiguous: 2 daemons published"
    ) as info:
        runtime.resolve_endpoint("buf")
    message = str(info.value)
    assert "uid 65534" in message and f"uid {STRANGER_UID}" in message, message
    assert "ipc:///nobodys.sock" in message and "ipc:///strangers.sock" in message

    plant(os.getuid(), "buf", "ipc:///ours-published.sock")  # ours, in a group folder: wins
    assert runtime.resolve_endpoint("buf") == "ipc:///ours-published.sock"
    with pytest.raises(DaemonUnavailableError, match="no daemon serves buffer 'other'"):
        runtime.resolve_endpoint("other")


def test_publish_and_remove(base):
    runtime.write("pub", {"endpoint": "ipc:///p.sock", "pid": os.getpid()})
    path = runtime.publish_to_group("pub", GID)
    assert path == runtime.group_user_dir(GID) / "pub.json"
    assert (mode(runtime.group_dir(GID)), mode(path.parent), mode(path)) == (0o3770, 0o750, 0o640)
    assert runtime.read("pub")["group"] == GID  # so that remove() finds the copy
    assert json.loads(path.read_text())["uid"] == os.getuid()
    runtime.remove("pub", pid=os.getpid() + 1)  # not that pid's: both stay
    assert path.exists()
    runtime.remove("pub", pid=os.getpid())
    assert not path.exists() and runtime.read("pub") is None


def test_stale_record_says_whose_daemon_is_gone(base):
    plant(65534, "gone", "ipc:///gone.sock", pid=dead_pid())
    with pytest.raises(DaemonUnavailableError, match=r"published in .* is gone"):
        runtime.resolve_endpoint("gone")
    plant(STRANGER_UID, "gone", "ipc:///alive.sock")  # a live one beside it is the one
    assert runtime.resolve_endpoint("gone") == "ipc:///alive.sock"


def _unsticky(path: Path) -> None:
    os.chmod(path.parent.parent, 0o2770)


def _world_writable(path: Path) -> None:
    os.chmod(path.parent.parent, 0o3777)


def _other_group(path: Path) -> None:
    os.chown(path.parent.parent, -1, 65534)


def _outsider_owner(path: Path) -> None:
    os.chown(path.parent.parent, STRANGER_UID, -1)  # not root, not in group 0


def _symlinked_group_folder(path: Path) -> None:
    real = path.parent.parent
    moved = real.with_name("elsewhere")
    real.rename(moved)
    real.symlink_to(moved)


def _user_folder_of_another(path: Path) -> None:
    os.chown(path.parent, STRANGER_UID, -1)


def _user_folder_group_writable(path: Path) -> None:
    os.chmod(path.parent, 0o770)


def _record_of_another(path: Path) -> None:
    os.chown(path, STRANGER_UID, -1)


def _record_group_writable(path: Path) -> None:
    os.chmod(path, 0o660)


def _record_symlink(path: Path) -> None:
    real = path.with_name("real.json")
    path.rename(real)
    path.symlink_to(real)


def _socket_of_another(path: Path) -> None:
    sock_path = path.parent.parent.parent / "root.sock"  # bound by us (root), not by 65534
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock_path))
    info = json.loads(path.read_text())
    path.write_text(json.dumps({**info, "endpoint": f"ipc://{sock_path}"}))


@pytest.mark.parametrize(
    ("spoil", "reason"),
    [
        (_unsticky, "lacks the sticky bit"),
        (_world_writable, "lets any user write to it"),
        (_other_group, "its group is gid 65534, not 0"),
        (_outsider_owner, f"its owner uid {STRANGER_UID} is not a member of group 0"),
        (_symlinked_group_folder, "it is a symlink"),
        (_user_folder_of_another, f"owned by uid {STRANGER_UID}, mode 0750; it must be uid 65534"),
        (_user_folder_group_writable, "mode 0770; it must be uid 65534's"),
        (_record_of_another, f"owned by uid {STRANGER_UID}, mode 0640; only uid 65534 may"),
        (_record_group_writable, "mode 0660; only uid 65534 may write it"),
        (_record_symlink, "it is a symlink"),
        (_socket_of_another, "is not a socket of uid 65534 (it belongs to uid 0)"),
    ],
)
def test_untrusted_group_folders_and_records_are_skipped(base, spoil, reason):
    """Whatever fails a check is never used: the name is not found, and the error says what
    was skipped and why."""
    path = plant(65534, "buf", "ipc:///nobodys.sock")
    assert runtime.resolve_endpoint("buf") == "ipc:///nobodys.sock"
    spoil(path)
    with pytest.raises(DaemonUnavailableError, match="no daemon serves buffer 'buf'") as info:
        runtime.resolve_endpoint("buf")
    assert reason in str(info.value), str(info.value)


def test_daemon_side_refuses_a_planted_group_folder(base):
    """A group folder someone else made wrong stops the daemon (the start fails naming it)
    rather than publishing where others could replace its record."""
    planted = runtime.group_dir(GID)
    planted.mkdir(mode=0o777)
    os.chmod(planted, 0o777)
    with pytest.raises(PermissionDeniedError, match=f"refusing group folder {planted}") as info:
        runtime.ensure_group_dir(GID)
    assert "lets any user write" in str(info.value) and "remove it" in str(info.value)
    with contextlib.suppress(OSError):
        planted.rmdir()
