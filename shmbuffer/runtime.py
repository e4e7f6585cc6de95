"""Runtime files: how clients find a daemon by buffer name, and how a dead one is detected.

Shared by both sides: the daemon writes these files, clients and the command line read them.

``<runtime dir>/<name>.json`` holds the endpoint, pid, segment path and protocol version of
the daemon serving ``name``. It is written atomically once the daemon listens and removed when
it stops; one left behind by a daemon that died is *stale* (its pid is gone) and is replaced.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from shmbuffer.errors import DaemonUnavailableError
from shmbuffer.names import validate_name


def runtime_dir() -> Path:
    """Where runtime files and ipc sockets live: ``$XDG_RUNTIME_DIR/shmbuffer`` if set, else a
    per-user folder in the temp dir. Created owner-only."""
    base = os.environ.get("SHMBUFFER_RUNTIME_DIR")
    if base:
        path = Path(base)
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "shmbuffer"
    else:
        path = Path(tempfile.gettempdir()) / f"shmbuffer-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
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
    try:
        with open(runtime_file(name)) as f:
            return dict(json.load(f))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


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
        info = read(path.stem)
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
            f"start a new one with `shmbuffer-daemon start --name {target}`"
        )
    return str(info["endpoint"])
