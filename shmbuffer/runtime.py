"""Runtime files: how clients find a daemon by buffer name, and how a dead one is detected.

Shared by both sides: the daemon writes these files, clients and the command line read them.

``<runtime dir>/<name>.json`` holds the endpoint, pid, segment path and protocol version of
the daemon serving ``name``, and what ``--resume`` needs of one that dies before it has a
segment (its settings, rewritten after ``configure``: :func:`update`). It is written
atomically once the daemon listens and removed when it stops; one left behind by a daemon
that died is *stale* (its pid is gone) and is replaced.

**Group discovery.** A daemon started with ``--group G`` also publishes a copy of that record
in a folder every member of ``G`` can read, at a place that depends on nothing in anyone's
environment: ``/tmp/shmbuffer-g<gid>/<uid>/<name>.json`` (:func:`group_dir`). Its ipc socket
lives beside it (``config.resolved_endpoint``), since the runtime dir may sit under an
owner-only ``$XDG_RUNTIME_DIR``. :func:`lookup` (what clients use to find a name) searches the
user's own runtime dir first — its record wins, live or stale — then the group folders of every
group the user is in. Each step is checked before it is believed (:func:`check_group_dir`):

* ``/tmp/shmbuffer-g<gid>``: a real folder (no symlink) of group ``gid``, owned by root or a
  member of ``gid`` (only they can give a folder that group), with the sticky bit (members
  cannot remove or rename each other's entries) and not writable by other users (``3770``);
* ``<uid>``: a real folder owned by the user it is named after, writable by them only;
* ``<name>.json``: a regular file (no symlink) owned by that user, writable by them only; its
  daemon's pid alive; its ipc socket, when it exists, owned by that user too.

Two live daemons of one name published by different users leave a member who has neither as
their own with an error naming both (the user's own daemon, in its own dir or a group folder,
always wins): a name never silently picks one of two.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import json
import os
import pwd
import socket
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shmbuffer.errors import DaemonUnavailableError, PermissionDeniedError
from shmbuffer.names import validate_name

ENV_RUNTIME_DIR = "SHMBUFFER_RUNTIME_DIR"

#: Where ``--group`` daemons publish themselves: ``<base>/shmbuffer-g<gid>``. A fixed place,
#: not ``$TMPDIR``: every member of the group must look in the same folder.
GROUP_DIR_BASE = Path("/tmp")
#: The group folder's mode: group members create their own folder in it (rwx), the sticky bit
#: keeps them from removing or renaming each other's, setgid hands its group down.
GROUP_DIR_MODE = 0o3770


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


def access_refusal(path: str | Path, need: int = os.R_OK | os.W_OK) -> str | None:
    """Why this process may not use ``path`` (a daemon's socket, a segment's folder or file)
    where permissions are the reason: the first folder on the way it may not enter, or
    ``path`` itself without ``need``, with its owner and mode. None where nothing refuses
    (a missing path is another error, said by whoever opens it)."""
    path = Path(path)
    for step in [*reversed(path.parents), path]:
        try:
            st = os.stat(step)
        except OSError:
            return None
        if not os.access(step, need if step == path else os.X_OK):
            try:
                owner = pwd.getpwuid(st.st_uid).pw_name
            except KeyError:
                owner = f"uid {st.st_uid}"
            return f"{step} belongs to {owner} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


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


def update(name: str, **fields: Any) -> None:
    """Rewrite the runtime file of ``name`` with ``fields`` changed, keeping its other fields
    and the access it was given (a ``--group`` daemon's is group-readable); the copy in a
    group folder keeps what it had (``--resume`` reads the owner's own record)."""
    path = runtime_file(name)
    info = read(name)
    if info is None:
        return
    st = os.stat(path, follow_symlinks=False)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        with contextlib.suppress(OSError):  # a group we left meanwhile: owner-only then
            os.fchown(f.fileno(), -1, st.st_gid)
            os.fchmod(f.fileno(), stat.S_IMODE(st.st_mode) & 0o640)
        json.dump({**info, **fields}, f, indent=1)
    os.replace(tmp, path)


def read(name: str) -> dict[str, Any] | None:
    """The runtime file of ``name``, or None if there is none (or it is half-written).
    PermissionDeniedError for a file that is a symlink, writable by others, or owned by anyone
    but its folder's owner, us or root: it could point clients anywhere."""
    path = runtime_file(name)
    return _read_record(path, (os.getuid(), 0, path.parent.stat().st_uid), "its folder's owner")


def _read_record(path: Path, owners: tuple[int, ...], who: str) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None (no file, or half-written). PermissionDeniedError
    for a symlink, a file not owned by one of ``owners``, writable by others or not regular,
    and for one we may not read (another user's folder, a group we are not in)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PermissionDeniedError(f"refusing runtime file {path}: it is a symlink") from None
        if exc.errno == errno.EACCES:
            raise PermissionDeniedError(
                f"cannot read runtime file {path}: permission denied (a --group daemon's "
                "files are readable only by members of its group)"
            ) from None
        raise
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if st.st_uid not in owners or st.st_mode & 0o022 or not stat.S_ISREG(st.st_mode):
            raise PermissionDeniedError(
                f"refusing runtime file {path}: owned by uid {st.st_uid}, mode "
                f"{stat.S_IMODE(st.st_mode):04o}; only {who} may write it"
            )
        try:
            info = json.load(f)
        except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
            return None
    return info if isinstance(info, dict) else None


def remove(name: str, pid: int | None = None) -> None:
    """Remove the runtime file (only if it is still ``pid``'s, when given), and the copy its
    daemon published for its ``--group`` (:func:`publish_to_group`)."""
    info = read(name)
    if info is not None and pid is not None and info.get("pid") != pid:
        return
    if info is not None and isinstance(info.get("group"), int):
        path = group_user_dir(info["group"]) / f"{validate_name(name)}.json"
        with contextlib.suppress(OSError):  # the folder went, or was never made
            theirs = _read_record(path, (os.getuid(),), "you")
            if theirs is not None and theirs.get("pid") == info.get("pid"):
                path.unlink()
    runtime_file(name).unlink(missing_ok=True)


# -- group discovery ------------------------------------------------------------------------


def group_dir(gid: int) -> Path:
    """The folder where ``--group gid`` daemons publish themselves (see the module doc)."""
    return GROUP_DIR_BASE / f"shmbuffer-g{int(gid)}"


def group_user_dir(gid: int, uid: int | None = None) -> Path:
    """``uid``'s own folder (default: ours) in :func:`group_dir`: its records and sockets."""
    return group_dir(gid) / str(os.getuid() if uid is None else int(uid))


def is_member(uid: int, gid: int) -> bool:
    """Whether ``uid`` is root or in group ``gid`` (as its primary group, or listed in it)."""
    if uid == 0:
        return True
    try:
        user = pwd.getpwuid(uid)
        return user.pw_gid == gid or user.pw_name in grp.getgrgid(gid).gr_mem
    except KeyError:  # a uid or gid the user database does not know: not a member
        return False


def _my_groups() -> list[int]:
    return sorted({os.getgid(), os.getegid(), *os.getgroups()})


def check_group_dir(path: Path, gid: int) -> os.stat_result:
    """Refuse a group folder its members could not trust (see the module doc): it must be a
    real folder of group ``gid`` owned by root or a member, sticky, not writable by others."""
    st = os.lstat(path)
    problems = []
    if stat.S_ISLNK(st.st_mode):
        problems.append("it is a symlink")
    elif not stat.S_ISDIR(st.st_mode):
        problems.append("it is not a folder")
    else:
        if st.st_gid != gid:
            problems.append(f"its group is gid {st.st_gid}, not {gid}")
        if not is_member(st.st_uid, gid):
            problems.append(f"its owner uid {st.st_uid} is not a member of group {gid}")
        if st.st_mode & 0o002:
            problems.append(f"its mode {stat.S_IMODE(st.st_mode):04o} lets any user write to it")
        if not st.st_mode & stat.S_ISVTX:
            problems.append("it lacks the sticky bit, so members could replace each other's files")
    if problems:
        raise PermissionDeniedError(
            f"refusing group folder {path}: {' and '.join(problems)}; remove it (a daemon "
            f"started with --group {gid} makes it again, mode {GROUP_DIR_MODE:04o})"
        )
    return st


def _check_user_dir(path: Path, uid: int) -> None:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise PermissionDeniedError(f"refusing group runtime folder {path}: not a real folder")
    if st.st_uid != uid or st.st_mode & 0o022:
        raise PermissionDeniedError(
            f"refusing group runtime folder {path}: owned by uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):04o}; it must be uid {uid}'s and writable by it only"
        )


def _give_to_group(path: Path, gid: int, mode: int) -> None:
    try:
        os.chown(path, -1, gid)
    except PermissionError:
        raise PermissionDeniedError(
            f"cannot give {path} to group {gid}: only its members (and root) may; is this user "
            f"in the group given to --group?"
        ) from None
    os.chmod(path, mode)


def ensure_group_dir(gid: int) -> Path:
    """Make (or check) :func:`group_dir` and our folder in it (``0750``, group ``gid``), where
    a ``--group`` daemon publishes its record and binds its socket; returns our folder. The
    daemon's side; PermissionDeniedError for a folder it cannot trust (see
    :func:`check_group_dir`), naming what is wrong."""
    base = group_dir(gid)
    try:
        os.mkdir(base, 0o700)
    except FileExistsError:
        pass
    else:  # ours: open it to the group only once it is the group's
        _give_to_group(base, gid, GROUP_DIR_MODE)
    deadline = time.monotonic() + 1.0
    while True:  # another member may have made it a moment ago and not yet given it its mode
        try:
            check_group_dir(base, gid)
            break
        except PermissionDeniedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    mine = group_user_dir(gid)
    with contextlib.suppress(FileExistsError):
        os.mkdir(mine, 0o700)
    _check_user_dir(mine, os.getuid())
    _give_to_group(mine, gid, 0o750)
    return mine


def publish_to_group(name: str, gid: int) -> Path:
    """Copy ``name``'s runtime record into our folder of :func:`group_dir` (``0640``, group
    ``gid``), and note ``gid`` in our own record so that :func:`remove` takes both. Call once
    the daemon listens (its record is written)."""
    info = read(name)
    if info is None:
        raise DaemonUnavailableError(f"no runtime file {runtime_file(name)} to publish")
    info = {**info, "group": int(gid)}
    write(name, info)
    folder = ensure_group_dir(gid)
    path = folder / f"{validate_name(name)}.json"
    tmp = folder / f".{name}.tmp{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):  # left by a daemon that died writing it
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchown(f.fileno(), -1, int(gid))
        os.fchmod(f.fileno(), 0o640)
        json.dump({**info, "uid": os.getuid()}, f, indent=1)
    os.replace(tmp, path)
    return path


@dataclass(frozen=True)
class Published:
    """A live daemon's record found in a group folder."""

    info: dict[str, Any]
    path: Path
    uid: int
    gid: int

    def describe(self) -> str:
        try:
            user = pwd.getpwuid(self.uid).pw_name
        except KeyError:
            user = "?"
        return f"uid {self.uid} ({user}) in group {self.gid} at {self.info.get('endpoint')}"


def _check_socket(found: Published) -> None:
    """A published ipc endpoint must be a socket of the record's owner (when it exists: a
    daemon that just died leaves none, and the connection then times out as for any)."""
    endpoint = str(found.info.get("endpoint", ""))
    if not endpoint.startswith("ipc://"):
        return
    try:
        st = os.lstat(endpoint[len("ipc://") :])
    except OSError:
        return
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != found.uid:
        raise PermissionDeniedError(
            f"refusing runtime file {found.path}: its endpoint {endpoint} is not a socket of "
            f"uid {found.uid} (it belongs to uid {st.st_uid})"
        )


def group_records(name: str) -> tuple[list[Published], list[Published], list[str]]:
    """``name``'s records in the group folders of our groups: (live, stale, why folders or
    files were skipped). Whatever fails a check is skipped, with its reason, never used."""
    validate_name(name)
    live: list[Published] = []
    stale: list[Published] = []
    skipped: list[str] = []
    for gid in _my_groups():
        base = group_dir(gid)
        try:
            check_group_dir(base, gid)
            users = sorted(p for p in base.iterdir() if p.name.isdigit())
        except FileNotFoundError:
            continue
        except (PermissionDeniedError, OSError) as exc:
            skipped.append(str(exc))
            continue
        for folder in users:
            uid = int(folder.name)
            path = folder / f"{name}.json"
            try:
                if not os.path.lexists(path):
                    continue
                _check_user_dir(folder, uid)
                info = _read_record(path, (uid,), f"uid {uid}")
                if info is None or "endpoint" not in info:
                    continue
                found = Published(info, path, uid, gid)
                if is_stale(info):
                    stale.append(found)
                    continue
                _check_socket(found)
            except (PermissionDeniedError, OSError) as exc:
                skipped.append(str(exc))
                continue
            live.append(found)
    return live, stale, skipped


def lookup(name: str) -> dict[str, Any] | None:
    """The runtime record clients use for ``name``: ours (:func:`read`) if we have one, live
    or stale; else the one live record in our groups' folders (ours first, if we published
    one there); else a stale one (for its message), or None. DaemonUnavailableError when two
    other users' daemons serve that name in our groups: the caller must say which."""
    return _find(name)[0]


def _find(name: str) -> tuple[dict[str, Any] | None, list[str]]:
    """:func:`lookup`, and why group folders or files were skipped (for a not-found error)."""
    own = read(name)
    if own is not None:
        return own, []
    live, stale, skipped = group_records(name)
    mine = [f for f in live if f.uid == os.getuid()]
    pool = mine or live
    endpoints = {(f.info.get("endpoint"), f.info.get("pid")) for f in pool}
    if len(endpoints) > 1:
        listed = "; ".join(f.describe() for f in pool)
        raise DaemonUnavailableError(
            f"buffer {name!r} is ambiguous: {len(pool)} daemons published in your groups' "
            f"folders serve it ({listed}); pass the endpoint of the one you mean "
            f"(Writer('ipc://...')) or set ${ENV_RUNTIME_DIR} to its owner's runtime folder"
        )
    if pool:
        return {**pool[0].info, "published": str(pool[0].path)}, skipped
    if stale:
        return {**stale[0].info, "published": str(stale[0].path)}, skipped
    return None, skipped


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
    info, skipped = _find(target)
    if info is None:
        groups = ", ".join(str(gid) for gid in _my_groups())
        note = f"; skipped: {'; '.join(skipped)}" if skipped else ""
        raise DaemonUnavailableError(
            f"no daemon serves buffer {target!r} (no runtime file {runtime_file(target)}, and "
            f"none in the group folders {GROUP_DIR_BASE}/shmbuffer-g<gid> of your groups "
            f"{groups}: another user's daemon is found by name only by members of its --group"
            f"{note}); start one with `shmbuffer-daemon start --name {target}`"
        )
    if is_stale(info):
        raise DaemonUnavailableError(gone_advice(target, info))
    return str(info["endpoint"])


def gone_advice(target: str, info: dict[str, Any]) -> str:
    """What to do about the dead daemon of ``info``: what ``--resume`` would give back."""
    resume = f"`shmbuffer-daemon start --name {target} --resume`"
    what = f"the daemon of buffer {target!r} (pid {info.get('pid')})"
    segment = info.get("segment")
    if isinstance(segment, str) and not os.path.isdir(segment):  # never had a schema
        return (
            f"{what} is gone; it stored nothing (it died before its first write, with no "
            f"segment); {resume} starts it again, empty, with its settings (sampler, rate "
            "limiter as last configured)"
        )
    if "published" in info:
        return (
            f"{what}, published in {info['published']}, is gone; its user can serve its "
            f"committed data again with {resume}"
        )
    return f"{what} is gone; {resume} serves its committed data again (a plain `start` discards it)"
