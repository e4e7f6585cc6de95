"""CPU time of a multi-process load, read from the OS: what every process of an implementation
spent during a timed pass, and how much of it was a server process's (shmbuffer's daemon).

A pass's window runs from just before its release to just after the last child's report
(:meth:`bench.harness.Children.pass_reports`). At both ends every descendant of the bench
process is read from ``/proc/<pid>/stat`` (utime + stime: all of a process's threads, live
and ended, so a Queue's feeder thread or a Reader's prefetch counts). Descendants are the
children that write and sample, the daemon (started by this process or forked by its
forkserver) and any helper a peer starts (a ``multiprocessing`` manager, say); the forkserver
and the resource tracker are among them too, idle while a pass runs. The bench process itself
only waits and is left out. The kernel counts in clock ticks (10 ms at the usual 100 Hz), so
a figure is good to about that much per process; a process that ended inside the window is
missed (none of the loads' processes does).
"""

from __future__ import annotations

from bench.machine import Proc, descendants

Snapshot = dict[int, Proc]


def snapshot() -> Snapshot:
    """Every live descendant of this process with its CPU seconds so far (empty without
    ``/proc``)."""
    return descendants()


def used(before: Snapshot, after: Snapshot) -> dict[int, float]:
    """CPU seconds each process of ``after`` spent since ``before``; a process started
    meanwhile counts whole (a pid whose reading went down was reused: a new process)."""
    out: dict[int, float] = {}
    for pid, proc in after.items():
        old = before.get(pid)
        spent = proc.cpu - old.cpu if old is not None and proc.cpu >= old.cpu else proc.cpu
        out[pid] = round(spent, 6)  # whole ticks: no 0.060000000000000005 in the JSON
    return out


def share(spent: dict[int, float], server: int | None) -> tuple[float | None, float | None]:
    """``(total, server's)`` CPU seconds of a window: every process's, and the ``server`` pid's
    (None without a server); ``(None, None)`` when nothing could be read (no ``/proc``)."""
    if not spent:
        return None, None
    total = round(sum(spent.values()), 6)
    return total, (spent.get(server, 0.0) if server is not None else None)
