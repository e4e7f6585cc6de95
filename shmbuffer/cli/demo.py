"""``shmbuffer-daemon demo``: a daemon, writer processes and learners on synthetic data, and a
verdict on what the learners checked.

The run lasts ``--seconds`` for every process at once: each child connects, then waits at a
start line (:class:`_StartLine`) until all have connected, so no child's run is spent while
another is still importing torch. The start-up before it is bounded (:data:`STARTUP_S`) and
overlaps the daemon's own; this process imports no torch (the children's data and loops are
:mod:`shmbuffer.cli.demo_loops`, imported in the children only). On a terminal each second
redraws the daemon's status; into a pipe or a file each second is one plain line.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from shmbuffer.cli.statusview import format_status, plural

#: Seconds the daemon and every child together may take to start (each imports torch) before
#: the demo gives up; the run's ``--seconds`` come after.
STARTUP_S = 120.0
#: Seconds after the run's end for the children to finish their last write or sample.
FINISH_S = 30.0
#: Seconds between two status frames (or lines).
FRAME_S = 1.0


def episode_spec(obs_shape: tuple[int, ...]) -> dict[str, dict[str, Any]]:
    """The schema of :func:`~shmbuffer.cli.demo_loops.make_episode`'s rows, declared up front so
    that the daemon allocates and prefaults its segment before it is ready (instead of stalling
    every client when the first writer defines it), without importing torch here."""
    scalar: list[int] = []
    return {
        "obs": {"dtype": "uint8", "shape": list(obs_shape)},
        "writer": {"dtype": "int64", "shape": scalar},
        "episode": {"dtype": "int64", "shape": scalar},
        "step": {"dtype": "int64", "shape": scalar},
        "reward": {"dtype": "float32", "shape": scalar},
        "done": {"dtype": "bool", "shape": scalar},
    }


class _StartLine:
    """Where the demo's children meet: ``up`` once the daemon serves (they import torch
    meanwhile), then each connects and reports ``ready``, and all wait for ``go``."""

    def __init__(self, ctx: Any) -> None:
        self.up = ctx.Event()
        self.ready = ctx.Semaphore(0)
        self.go = ctx.Event()

    def wait_up(self) -> None:
        if not self.up.wait(STARTUP_S):
            raise TimeoutError(f"the demo's daemon was not up within {STARTUP_S:.0f}s")

    def start(self) -> None:
        """Called by a connected child: the run begins when every child is connected."""
        self.ready.release()
        if not self.go.wait(STARTUP_S):
            raise TimeoutError(f"the demo's processes did not all start in {STARTUP_S:.0f}s")


def _child(role: str, target: str, line: _StartLine, out: Any, seconds: float, job: Any) -> None:
    from shmbuffer.cli import demo_loops as demo  # torch: imported in the children only

    line.wait_up()
    if role == "writer":
        wid, length, shape = job
        written = demo.writer_loop(
            target, wid, 10**9, length, shape, seconds=seconds, start=line.start
        )
        out.put(("writer", {"episodes_written": written, "rows_written": written * length}))
    else:
        out.put(("learner", demo.learner_loop(target, seconds, start=line.start)))
    # A spawned child ends through the interpreter's full finalisation (seconds of CPU with
    # torch loaded, several children at once), where a forked one ends with os._exit. Its
    # work is done and its report flushed to the pipe, so it ends as a forked child does.
    out.close()
    out.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _Screen:
    """The demo's frames: the status redrawn in place on a terminal; one plain line per frame
    elsewhere, and no terminal control codes."""

    def __init__(self, row_bytes: int) -> None:
        self.tty = sys.stdout.isatty()
        self.row_bytes = row_bytes
        self.peak = [0.0, 0.0]  # GB/s in and out

    def frame(self, s: dict[str, Any], clock: str) -> None:
        rates = [s[k] * self.row_bytes / 1e9 for k in ("insert_rows_per_s", "sample_rows_per_s")]
        self.peak = [max(a, b) for a, b in zip(self.peak, rates, strict=True)]
        throughput = f"{rates[0]:.2f} GB/s in, {rates[1]:.2f} GB/s out"
        if self.tty:
            print(f"\x1b[H\x1b[2J{format_status(s)}\nthroughput  {throughput}\n{clock}", flush=True)
        else:
            print(f"{clock}: {plural(s['rows'], 'row')} stored, {throughput}", flush=True)


def _children(args: argparse.Namespace, name: str, line: _StartLine, out: Any) -> list[Any]:
    ctx = mp.get_context("spawn")
    shape = _shape(args.obs_shape)
    procs = [
        ctx.Process(
            target=_child,
            args=("writer", name, line, out, args.seconds, (w, args.episode_len, shape)),
            name=f"writer-{w}",
        )
        for w in range(args.writers)
    ]
    procs += [
        ctx.Process(
            target=_child,
            args=("learner", name, line, out, args.seconds, None),
            name=f"learner-{i}",
        )
        for i in range(args.learners)
    ]
    return procs


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def _failed(procs: list[Any], reported: int) -> str | None:
    """A child that ended with an error, or more children ended than reported: what to say."""
    for p in procs:
        if p.exitcode not in (None, 0):
            return f"{p.name} failed (exit code {p.exitcode}): its traceback is above"
    if sum(p.exitcode == 0 for p in procs) > reported:
        return "a process ended without its report: its traceback is above"
    return None


def cmd_demo(args: argparse.Namespace) -> int:
    from shmbuffer.runtime import read

    shape = _shape(args.obs_shape)
    name = args.name or f"demo-{os.getpid()}"
    schema_file = Path(tempfile.mkdtemp(prefix="shmbuffer-demo-")) / "schema.json"
    schema_file.write_text(json.dumps(episode_spec(shape)))
    cli = [sys.executable, "-m", "shmbuffer.cli", "--log-level", "WARNING", "start"]
    options = ["--capacity", str(args.capacity), "--unit", "episode", "--schema", str(schema_file)]
    began = time.monotonic()
    daemon = subprocess.Popen([*cli, "--name", name, *options])
    ctx = mp.get_context("spawn")
    line, out = _StartLine(ctx), ctx.Queue()
    procs = _children(args, name, line, out)
    try:
        for p in procs:  # they import torch while the daemon starts
            p.start()
        deadline = began + STARTUP_S
        while (read(name) or {}).get("pid") != daemon.pid:
            if time.monotonic() > deadline or daemon.poll() is not None:
                print("the daemon did not start", file=sys.stderr)
                return 1
            time.sleep(0.05)
        line.up.set()
        print(
            f"daemon {name!r} up (pid {daemon.pid}); {plural(args.writers, 'writer')}, "
            f"{plural(args.learners, 'learner')}, {args.seconds:g}s, obs uint8{list(shape)}",
            flush=True,
        )
        from shmbuffer.clients.connection import Connection

        admin = Connection(name, "admin")
        try:
            return _run(args, admin, procs, line, out, deadline, began)
        finally:
            admin.close()
    finally:
        # after a run the children are ending; after a failure they may be waiting at the
        # start line for STARTUP_S: either way none outlives the demo
        stop_by = time.monotonic() + (5.0 if line.go.is_set() else 0.0)
        for p in procs:
            if p.pid is None:  # never started
                continue
            p.join(timeout=max(0.0, stop_by - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        daemon.terminate()
        try:
            daemon.wait(timeout=10)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(timeout=10)
        shutil.rmtree(schema_file.parent, ignore_errors=True)


def _run(
    args: argparse.Namespace,
    admin: Any,
    procs: list[Any],
    line: _StartLine,
    out: Any,
    deadline: float,
    began: float,
) -> int:
    screen = _Screen(row_bytes=math.prod(_shape(args.obs_shape)) + 8 * 3 + 4 + 1)
    starting = f"starting {plural(len(procs), 'process', 'processes')}, each imports torch"
    if not screen.tty:
        print(f"{starting}", flush=True)
    connected, next_frame = 0, time.monotonic() + FRAME_S
    while connected < len(procs):
        if line.ready.acquire(timeout=0.1):
            connected += 1
            continue
        failed = _failed(procs, 0)
        if failed or time.monotonic() > deadline:
            print(
                failed or f"{connected} of {len(procs)} processes started in {STARTUP_S:.0f}s",
                file=sys.stderr,
            )
            return 1
        if screen.tty and time.monotonic() >= next_frame:
            screen.frame(admin.call("stats")["stats"], f"({starting}; {connected} connected)")
            next_frame += FRAME_S
    line.go.set()
    go = time.monotonic()
    startup = go - began
    if not screen.tty:
        print(f"all connected after {startup:.1f}s; running {args.seconds:g}s", flush=True)
    reports: list[tuple[str, dict[str, int]]] = []
    next_frame, end = go + FRAME_S, go + args.seconds + FINISH_S
    while len(reports) < len(procs):
        try:
            reports.append(out.get(timeout=max(0.01, min(next_frame, end) - time.monotonic())))
            continue
        except queue.Empty:
            pass
        failed = _failed(procs, len(reports))
        if failed:
            print(failed, file=sys.stderr)
            return 1
        now = time.monotonic()
        if now >= end:
            late = [p.name for p in procs if p.is_alive()]
            print(
                f"{', '.join(late)} still running {args.seconds + FINISH_S:.0f}s after the start",
                file=sys.stderr,
            )
            return 1
        if now >= next_frame:
            screen.frame(admin.call("stats")["stats"], f"{now - go:.0f}s of {args.seconds:g}s")
            next_frame += FRAME_S
    ran = time.monotonic() - go
    stats = admin.call("stats")["stats"]
    if not screen.tty:
        print(format_status(stats))
    _verdict(args, screen, reports, startup, ran)
    return 0


def _verdict(
    args: argparse.Namespace,
    screen: _Screen,
    reports: list[tuple[str, dict[str, int]]],
    startup: float,
    ran: float,
) -> None:
    def total(role: str, key: str) -> int:
        return sum(r[key] for who, r in reports if who == role)

    print(f"start-up {startup:.1f}s, run {ran:.1f}s")
    print(f"peak throughput {screen.peak[0]:.2f} GB/s in, {screen.peak[1]:.2f} GB/s out")
    print(
        f"{plural(args.writers, 'writer')} wrote "
        f"{plural(total('writer', 'episodes_written'), 'episode')} "
        f"({plural(total('writer', 'rows_written'), 'row')})"
    )
    if args.learners:
        checked = plural(total("learner", "episodes_checked"), "sampled episode")
        rows = plural(total("learner", "rows_checked"), "row")
        print(f"{plural(args.learners, 'learner')} verified {checked} and {rows}: none torn")
    else:
        print("no learners: nothing sampled or verified")
