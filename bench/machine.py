"""The machine a run is on, and how busy it was: CPU model, cores, memory and package versions;
per scenario the load average before and after, and the CPU that *other* processes used.

The load average counts this run's own processes too (a scenario with four children drives it
past 2 on two cores by itself), so it cannot say whether something else disturbed a scenario.
:class:`LoadWatch` can: the CPU time the whole machine spent busy (``/proc/stat``) minus what
this process and its descendants spent, over the wall time, is the number of cores other
processes kept busy meanwhile.
"""

from __future__ import annotations

import os
import platform
import threading
import time
from importlib import metadata
from typing import Any, NamedTuple

#: A run whose 1-minute load average exceeds ``cores * LOAD_PER_CORE`` before it starts, or
#: whose scenarios shared the machine with more than that many busy cores of other
#: processes, does not write the README (unless forced).
LOAD_PER_CORE = 0.5
PACKAGES = (
    "shmbuffer", "numpy", "numba", "torch", "tensordict", "torchrl", "cpprb", "pyzmq", "ale-py",
)  # fmt: skip


def cores() -> int:
    return os.cpu_count() or 1


def load_limit() -> float:
    return cores() * LOAD_PER_CORE


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in PACKAGES:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "absent"
    return out


def describe() -> dict[str, Any]:
    mem = memory_bytes()
    return {
        "cpu": cpu_model(),
        "cores": cores(),
        "memory_gb": round(mem / 1e9, 1) if mem else None,
        "system": f"{platform.system()} {platform.release()} {platform.machine()}",
    }


def _busy_seconds() -> float | None:
    """Seconds all CPUs spent busy since boot (user, nice, system, irq, softirq), or None."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


class Proc(NamedTuple):
    ppid: int
    cpu: float  # utime + stime, seconds
    reaped: float  # cutime + cstime: of the children it waited for


def descendants() -> dict[int, Proc]:
    """Every live descendant of this process, from ``/proc/<pid>/stat``."""
    procs: dict[int, Proc] = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks = [int(v) for v in fields[11:15]]
            ppid = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        procs[pid] = Proc(ppid, (ticks[0] + ticks[1]) / tick, (ticks[2] + ticks[3]) / tick)
    children: dict[int, list[int]] = {}
    for pid, proc in procs.items():
        children.setdefault(proc.ppid, []).append(pid)
    out: dict[int, Proc] = {}
    todo = [os.getpid()]
    while todo:
        for pid in children.get(todo.pop(), []):
            out[pid] = procs[pid]
            todo.append(pid)
    return out


def _times() -> tuple[float, float]:
    """This process's CPU seconds, and those of the children it reaped."""
    t = os.times()
    return t.user + t.system, t.children_user + t.children_system


class LoadWatch:
    """Started at creation; :meth:`stop` says how loaded the machine was meanwhile.

    This run's own CPU is this process's plus its descendants', the larger of two counts that
    each miss something: the children it reaped plus the live ones with theirs (``os.times``
    and ``/proc/<pid>/stat``: misses a forkserver's children and Ray's workers, reaped by
    others), and every descendant read every ``interval`` seconds by a thread while it lives
    (misses what a process did in its last ``interval``). What is missed counts as other. A
    scan costs a few ms."""

    def __init__(self, interval: float = 0.5) -> None:
        self.wall = time.monotonic()
        self.before = os.getloadavg()
        self.busy = _busy_seconds()
        self.own = _times()
        self.start = descendants()
        self.last = dict(self.start)
        self._done = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._watch, name="bench-loadwatch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._done.wait(self._interval):
            self.last.update(descendants())

    def stop(self) -> dict[str, Any]:
        """``before``/``after``: the 1, 5 and 15-minute load averages; ``cpu_seconds``: CPU
        this process and its descendants used; ``other_cores``: cores other processes kept
        busy on average (None where ``/proc/stat`` is missing)."""
        self._done.set()
        self._thread.join()
        now = descendants()
        self.last.update(now)
        wall = max(time.monotonic() - self.wall, 1e-9)
        mine, reaped = _times()
        me = os.getpid()

        def direct(procs: dict[int, Proc]) -> float:
            return sum(p.cpu + p.reaped for p in procs.values() if p.ppid == me)

        by_reaping = reaped - self.own[1] + direct(now) - direct(self.start)
        zero = Proc(0, 0.0, 0.0)
        by_sampling = sum(  # a pid reading lower than at the start was reused: a new process
            p.cpu - self.start.get(pid, zero).cpu
            if p.cpu >= self.start.get(pid, zero).cpu
            else p.cpu
            for pid, p in self.last.items()
        )
        own = mine - self.own[0] + max(by_reaping, by_sampling)
        busy = _busy_seconds()
        other = None
        if busy is not None and self.busy is not None:
            other = max(0.0, (busy - self.busy) - own) / wall
        return {
            "seconds": round(wall, 2),
            "cpu_seconds": round(own, 2),
            "load_before": [round(x, 2) for x in self.before],
            "load_after": [round(x, 2) for x in os.getloadavg()],
            "other_cores": None if other is None else round(other, 2),
        }


def too_busy(start_load: float, scenarios: dict[str, dict[str, Any]]) -> str | None:
    """Why a run's figures should not go into the README, or None: the 1-minute load average
    before it started, or the cores other processes kept busy during a scenario, above
    :func:`load_limit`."""
    limit = load_limit()
    if start_load > limit:
        return (
            f"the 1-minute load average was {start_load:.2f} before the run, above {limit:g} "
            f"({cores()} cores x {LOAD_PER_CORE:g})"
        )
    busy = {n: s["other_cores"] for n, s in scenarios.items() if (s["other_cores"] or 0) > limit}
    if busy:
        worst = ", ".join(f"{n} {v:.2f}" for n, v in busy.items())
        return f"other processes kept more than {limit:g} cores busy during: {worst}"
    return None
