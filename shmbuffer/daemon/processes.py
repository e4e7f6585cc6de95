"""Which local process is at the other end of a socket, vouched for by the kernel.

A pid a client only *claims* in its ``hello`` proves nothing, and a pid alone is reused: a
writer that died and a new process that got its pid look the same to ``kill(pid, 0)``. A
:class:`Process` is therefore the pid the kernel reports for a unix socket's peer
(``SO_PEERCRED``) together with that process's start time (``/proc/<pid>/stat``, clock ticks
since boot), and it is alive only while a process of that pid *and* that start time runs.

The daemon pins a writer's rows on it (``daemon/pins.py``): rows a live local writer may still
be copying into are never handed to anyone else, however long it is stopped.
"""

from __future__ import annotations

import socket
import struct
from typing import NamedTuple

_UCRED = struct.Struct("3i")  # pid, uid, gid


class Process(NamedTuple):
    pid: int
    #: Start time in clock ticks since boot (field 22 of ``/proc/<pid>/stat``).
    start: int


def start_time(pid: int) -> int | None:
    """The start time of process ``pid``, or None when there is none (or it is a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ")".
    rest = stat.rsplit(b")", 1)[-1].split()
    if len(rest) < 20 or rest[0] == b"Z":
        return None
    return int(rest[19])


def process_of(pid: int) -> Process | None:
    """The running process ``pid`` as it is now (None: no such process visible here)."""
    if pid <= 0:
        return None
    start = start_time(pid)
    return None if start is None else Process(pid, start)


def peer_process(sock: socket.socket) -> Process | None:
    """The process at the other end of a connected unix socket (None: the kernel gives no pid
    we can see, as for a peer in another pid namespace)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except (OSError, AttributeError):  # AttributeError: a platform without SO_PEERCRED
        return None
    pid, _, _ = _UCRED.unpack(raw)
    return process_of(pid)


def alive(process: Process) -> bool:
    """Whether ``process`` still runs: same pid, same start time (a reused pid is not it)."""
    return start_time(process.pid) == process.start
