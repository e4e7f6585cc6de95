"""Runtime files: how clients find a daemon by buffer name, and how a dead one is detected.

Shared by both sides: the daemon writes these files, clients and the command line read them.

``<runtime dir>/<name>.json`` holds the endpoint, pid, segment path and protocol version of
the daemon serving ``name``. It is written atomically once the daemon listens and removed when
it stops; one left behind by a daemon that died is *stale* (its pid is gone) and is replaced.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

from shmbuffer.errors import DaemonUnavailableError, PermissionDeniedError
from shmbuffer.names import validate_name

ENV_RUNTIME_DIR = "SHMBUFFER_RUNTIME_DIR"


def check_private_dir(
    path: Path, what: str, *, any_owner: bool = False, hint: str = ""
) -> os.stat_result:
    """Refuse a folder whose contents someone else could replace, as ssh does with its keys:
    it must be a folder (a symlink to one is followed), owned by us or root (any owner when
    ``any_owner``: a folder named explicitly, e.g. a ``--group`` daemon's), and writable by its
    owner only. A pre-made ``/tmp/shmbuffer-<uid>`` of another user's would otherwise let them
    swap the runtime file and point our clients at their own daemon. Returns its stat."""
    st = os.stat(path)
    problems = []
    if not stat.S_ISDIR(st.st_mode):
        problems.append("it is not a folder")
    if not any_owner and st.st_uid not in (os.getuid(), 0):
        problems.append(f"it belongs to uid {st.st_uid}, not to you (uid {os.getuid()})")
    if st.st_mode & 0o022:
        problems.append(f"its mode {stat.S_IMODE(st.st_mode):04o} lets other users write to it")
    if problems:
        raise PermissionDeniedError(
            f"refusing {what} {path}: {' and '.join(problems)}, so another user could replace "
            f"what is in it; remove it or make it yours with mode 0700{hint}"
        )
    return st


def runtime_dir() -> Path:
    """Where runtime files and ipc sockets live: ``$SHMBUFFER_RUNTIME_DIR``, else
    ``$XDG_RUNTIME_DIR/shmbuffer``, else a per-user folder in the temp dir. Created owner-only
    and checked on every use (:func:`check_private_dir`); a folder named by
    ``$SHMBUFFER_RUNTIME_DIR`` may be another user's (how ``--group`` members find a daemon),
    but still writable by its owner only."""
    base = os.environ.get(ENV_RUNTIME_DIR)
    if base:
        path = Path(base)
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "shmbuffer"
    else:
        path = Path(tempfile.gettempdir()) / f"shmbuffer-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    hint = f" (or set ${ENV_RUNTIME_DIR} to a folder of yours)"
    check_private_dir(path, "runtime folder", any_owner=bool(base), hint=hint)
    return path


def runtime_file(name: str) -> Path:
    return runtime_dir() / f"{validate_name(name)}.json"


def pid_alive(pid: int) -> bool:
    """Whether a local process still runs; a zombie (killed, not yet waited for) is dead."""
    if pid <= 0:  # 0 and negatives would signal process groups
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc: trust kill()


def write(name: str, info: dict[str, Any]) -> Path:
    path = runtime_file(name)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({**info, "host": socket.gethostname(), "written": time.time()}, f, indent=1)
    os.replace(tmp, path)
    return path


def read(name: str) -> dict[str, Any] | None:
    """The runtime file of ``name``, or None if there is none (or it is half-written).
    PermissionDeniedError for a file that is a symlink, writable by others, or owned by anyone
    but its folder's owner, us or root: it could point clients anywhere."""
    path = runtime_file(name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PermissionDeniedError(f"refusing runtime file {path}: it is a symlink") from None
        raise
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        owners = (os.getuid(), 0, path.parent.stat().st_uid)
        if st.st_uid not in owners or st.st_mode & 0o022 or not stat.S_ISREG(st.st_mode):
            raise PermissionDeniedError(
                f"refusing runtime file {path}: owned by uid {st.st_uid}, mode "
                f"{stat.S_IMODE(st.st_mode):04o}; only its folder's owner may write it"
            )
        try:
            info = json.load(f)
        except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
            return None
    return info if isinstance(info, dict) else None


def remove(name: str, pid: int | None = None) -> None:
    """Remove the runtime file (only if it is still ``pid``'s, when given)."""
    info = read(name)
    if info is not None and pid is not None and info.get("pid") != pid:
        return
    runtime_file(name).unlink(missing_ok=True)


def is_stale(info: dict[str, Any]) -> bool:
    return info.get("host") == socket.gethostname() and not pid_alive(int(info.get("pid", 0)))


def live_daemons() -> list[dict[str, Any]]:
    out = []
    for path in sorted(runtime_dir().glob("*.json")):
        try:
            info = read(path.stem)
        except (PermissionDeniedError, ValueError):  # untrusted file, or not a buffer name
            continue
        if info is not None and not is_stale(info):
            out.append(info)
    return out


def resolve_endpoint(target: str) -> str:
    """An endpoint as given (``ipc://…``, ``tcp://…``), or the endpoint of the live daemon
    serving the buffer called ``target``."""
    if "://" in target:
        return target
    info = read(target)
    if info is None:
        raise DaemonUnavailableError(
            f"no daemon serves buffer {target!r} (no runtime file {runtime_file(target)}); "
            f"start one with `shmbuffer-daemon start --name {target}`"
        )
    if is_stale(info):
        raise DaemonUnavailableError(
            f"the daemon of buffer {target!r} (pid {info.get('pid')}) is gone; "
            f"`shmbuffer-daemon start --name {target} --resume` serves its committed data "
            "again (a plain `start` discards it)"
        )
    return str(info["endpoint"])
