"""The process harness of the daemon scenarios: bench-owned folders, real daemon subprocesses
started through ``python -m shmbuffer.cli start``, and spawned children released pass by pass.

Child processes are spawned (or forked from a preloaded forkserver: :func:`preloaded_context`),
build their data and connect *before* a start event, and report their own clock readings
through a queue (``time.perf_counter`` is CLOCK_MONOTONIC on Linux: one clock for every
process). A pass is timed from the parent's release of the start event to the
last *final* report (a role says whether its end is the pass's end). Every wait has a finite
timeout, and every child and every daemon is stopped when its ``with`` block ends, whatever
happened inside it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

from bench import cpu
from bench.data import Spec, schema
from bench.registry import Context

PASSES = ("first", "steady")  # every multi-process run: a fresh buffer, then a second pass
READY_TIMEOUT = 180.0  # children import torch and build data on a busy 2-core machine
PASS_TIMEOUT = 180.0
JOIN_TIMEOUT = 30.0
DAEMON_START_TIMEOUT = 60.0
DAEMON_STOP_TIMEOUT = 15.0
RUNTIME_ENV = "SHMBUFFER_RUNTIME_DIR"

Body = Callable[[int], tuple[int, bool]]
"""One pass of a child: ``body(pass_index) -> (rows, final)``; ``final`` means its end time is
a candidate for the pass's end (a Queue producer's is not: its consumer's is)."""
Role = Callable[..., AbstractContextManager[Body]]
"""What a child does: a module-level context manager (it is pickled by reference into the
spawned child) that prepares, yields the pass body, and cleans up on the way out."""

_names = itertools.count()

#: What the forkserver of :func:`preloaded_context` imports once (a missing one is skipped):
#: a spawned child imports torch (and torchrl) itself, seconds of CPU apiece, most of a
#: ``--quick`` run on two cores.
PRELOAD = [
    "bench.workers",
    "bench.contention",
    "bench.rollout",
    "shmbuffer.clients.writer",
    "shmbuffer.clients.reader",
    "shmbuffer.cli",  # and the daemon's modules: forked daemons (see running_daemon)
    "shmbuffer.daemon.config",
    "shmbuffer.daemon.server",
    "shmbuffer.daemon.service",
    "shmbuffer.samplers._jit",  # numba (the fast extra)
    "torchrl.data",
    "cpprb",
]

#: How :func:`running_daemon` starts a daemon when its caller does not say: ``False``, a
#: ``python -m shmbuffer.cli start`` subprocess (what a user runs; the full run's way);
#: ``True`` (``--quick``, set by the runner), the same ``shmbuffer.cli`` command run in a
#: process forked from the preloaded forkserver, which skips the ~3 s of CPU each daemon
#: spends importing torch. The daemon's code and sockets are the same; its pages are shared
#: with the server, so the memory scenario always asks for a subprocess.
FORK_DAEMONS = False


def preloaded_context() -> Any:
    """A multiprocessing context whose children are forked from one clean server process
    (``forkserver``: no threads, nothing of this process's state) that imported
    :data:`PRELOAD`. What a child does once ready is the same as a spawned one's; its memory
    shares the preloaded modules' pages with the server (so it is not the one a memory
    scenario should measure), and its environment is the server's, fixed when the first
    child started: a child must get endpoints, not names looked up through
    ``SHMBUFFER_RUNTIME_DIR``."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (the first child)
    return ctx


class Report(NamedTuple):
    """What one child reported for one pass (its own clock readings around its body)."""

    cid: int
    t0: float
    t1: float
    rows: int
    final: bool


@contextmanager
def bench_dirs(ctx: Context) -> Iterator[str]:
    """A bench-owned folder for segments and scratch files (in ``--shm-dir``, else on /dev/shm
    when there is one), with its own runtime dir (``SHMBUFFER_RUNTIME_DIR``, inherited by the
    daemons and children started meanwhile) so nothing else that cleans the default one can
    pull a name from under a run. Both are removed, and the variable restored, afterwards."""
    base = ctx.shm_dir or ("/dev/shm" if os.access("/dev/shm", os.W_OK) else ctx.tmpdir)
    root = tempfile.mkdtemp(prefix="bench-daemon-", dir=base)
    run_dir = os.path.join(root, "run")
    os.mkdir(run_dir, 0o700)
    old = os.environ.get(RUNTIME_ENV)
    os.environ[RUNTIME_ENV] = run_dir
    try:
        yield root
    finally:
        if old is None:
            os.environ.pop(RUNTIME_ENV, None)
        else:
            os.environ[RUNTIME_ENV] = old
        shutil.rmtree(root, ignore_errors=True)


def _daemon_main(argv: list[str], log_path: str, env: dict[str, str]) -> None:
    """A forked daemon: ``shmbuffer.cli`` ``argv``, output to ``log_path``, with the
    ``SHMBUFFER_*`` variables of the parent that started it (the forkserver's own are those of
    whoever started the server first: an earlier scenario's runtime dir)."""
    for key in [k for k in os.environ if k.startswith("SHMBUFFER_") and k not in env]:
        del os.environ[key]
    os.environ.update(env)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.setsid()  # its own session, as running_daemon's subprocess (see there)
    from shmbuffer.cli import main

    sys.exit(main(argv))


class _Forked:
    """A forked daemon process behind the few ``subprocess.Popen`` calls used here."""

    def __init__(self, argv: list[str], log_path: str, name: str) -> None:
        env = {k: v for k, v in os.environ.items() if k.startswith("SHMBUFFER_")}
        self.proc = preloaded_context().Process(
            target=_daemon_main, args=(argv, log_path, env), name=name, daemon=True
        )
        self.proc.start()
        self.pid: int = self.proc.pid

    @property
    def returncode(self) -> int | None:
        code: int | None = self.proc.exitcode
        return code

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.proc.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.proc.kill()

    def wait(self, timeout: float) -> int:
        self.proc.join(timeout)
        code = self.returncode
        if code is None:
            raise subprocess.TimeoutExpired(self.proc.name, timeout)
        return code


@contextmanager
def running_daemon(
    storage_dir: str,
    capacity: int,
    unit: str,
    spec: Spec | None = None,
    forked: bool | None = None,
    schema_json: dict[str, Any] | None = None,
    args: tuple[str, ...] = (),
) -> Iterator[str]:
    """A daemon serving a fresh buffer; yields its name once it is ready. ``forked``: from
    the preloaded forkserver rather than a subprocess (default :data:`FORK_DAEMONS`).

    With ``spec`` the schema is declared up front, so the daemon creates (and prefaults) its
    segment before it listens: nothing of that is left for the first timed write.

    The daemon runs in a session of its own, as ``shmbuffer-daemon start --detach`` (or a
    daemon started from its own terminal) does: with the kernel's autogroup scheduling (on by
    default) it then gets a CPU share of its own instead of one share among the writer
    processes of the same session. Measured with two small-row writers on two cores: ~8.1 M
    rows/s in the writers' session, ~8.9 M in its own."""
    from shmbuffer import runtime

    name = f"bench-{os.getpid()}-{next(_names)}"
    argv = ["--log-level", "WARNING", "start"]
    argv += ["--name", name, "--capacity", str(capacity), "--unit", unit]
    argv += ["--storage-dir", storage_dir, *args]  # args: more start flags
    if spec is not None or schema_json is not None:  # schema_json: as the user's file says it
        path = os.path.join(storage_dir, f"{name}.schema.json")
        with open(path, "w") as f:
            json.dump(schema(spec) if spec is not None else schema_json, f)
        argv += ["--schema", path]
    log_path = os.path.join(storage_dir, f"{name}.log")
    proc: subprocess.Popen[bytes] | _Forked
    if FORK_DAEMONS if forked is None else forked:
        open(log_path, "wb").close()  # there to read, even if the child dies before it writes
        proc = _Forked(argv, log_path, f"bench-daemon-{name}")
    else:
        cmd = [sys.executable, "-m", "shmbuffer.cli", *argv]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
            )
    try:
        deadline = time.monotonic() + DAEMON_START_TIMEOUT
        # Ready = its runtime file names this very process (a stale file from an earlier
        # daemon of the same name must not count).
        while (runtime.read(name) or {}).get("pid") != proc.pid:
            if proc.poll() is not None:
                with open(log_path, errors="replace") as f:
                    tail = f.read()[-800:].strip()
                raise RuntimeError(
                    f"the daemon exited with {proc.returncode} before it was ready: {tail}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"the daemon was not ready in {DAEMON_START_TIMEOUT:g} s")
            time.sleep(0.02)
        yield name
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=DAEMON_STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=DAEMON_STOP_TIMEOUT)


def _child_main(
    results: Any, go: list[Any], done: Any, cid: int, role: Role, params: dict[str, Any]
) -> None:
    """Entry point of every spawned child: prepare, report ready, then one body per pass, then
    wait for ``done`` before the role's teardown."""
    try:
        with role(**params) as body:
            results.put(("ready", cid))
            for p, event in enumerate(go):
                if not event.wait(PASS_TIMEOUT):
                    raise TimeoutError(f"no start signal for pass {p} in {PASS_TIMEOUT:g} s")
                t0 = time.perf_counter()
                rows, final = body(p)
                results.put(("pass", cid, p, t0, time.perf_counter(), rows, final))
            # Alive until the parent is done with the passes: the last pass's CPU is read
            # from /proc after the last report, and an exited process cannot be read.
            done.wait(PASS_TIMEOUT)
    except BaseException:
        results.put(("error", cid, traceback.format_exc(limit=8)))
        raise


class Children:
    """Spawned child processes that report on one queue, released together pass by pass.

    Use it as a context manager: on the way out the children are joined (each given
    ``JOIN_TIMEOUT`` to finish) and killed if need be; when the block failed, no one waits for
    stragglers: the live ones are killed at once.

    ``cpu[p]``: the CPU seconds each descendant process spent in pass ``p``, from just before
    its release to just after the last report (:mod:`bench.cpu`). So that the last pass's can
    be read, a child that ran its passes waits, its role still open, until :meth:`close`."""

    def __init__(self, passes: int = len(PASSES), preloaded: bool = False) -> None:
        # preloaded: forked from a server that imported PRELOAD once (preloaded_context)
        self.mp = preloaded_context() if preloaded else mp.get_context("spawn")
        self.results = self.mp.Queue()
        self.go = [self.mp.Event() for _ in range(passes)]
        self.done = self.mp.Event()  # the children may tear their roles down and exit
        self.procs: list[Any] = []
        self.cpu: list[dict[int, float]] = []

    def __enter__(self) -> Children:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            for proc in self.procs:
                if proc.is_alive():
                    proc.kill()
        self.close()

    def start(self, role: Role, **params: Any) -> None:
        """Spawn one child running ``role(**params)`` (the params are pickled)."""
        cid = len(self.procs)
        proc = self.mp.Process(
            target=_child_main,
            args=(self.results, self.go, self.done, cid, role, params),
            name=f"bench-{role.__name__.removesuffix('_role')}-{cid}",
            daemon=True,
        )
        proc.start()
        self.procs.append(proc)

    def _get(self, deadline: float) -> tuple[Any, ...]:
        while True:
            try:
                msg: tuple[Any, ...] = self.results.get(timeout=0.2)
            except queue.Empty:
                dead = [p for p in self.procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"{dead[0].name} exited with {dead[0].exitcode}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError("a child did not report in time") from None
                continue
            if msg[0] == "error":
                raise RuntimeError(f"{self.procs[msg[1]].name} failed:\n{msg[2]}")
            return msg

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        for _ in self.procs:
            self._get(deadline)

    def pass_reports(self, p: int) -> tuple[float, list[Report]]:
        """Release pass ``p``; the release time and every child's report, by child id (and
        the pass's CPU, appended to :attr:`cpu`)."""
        before = cpu.snapshot()  # a scan takes a few ms: outside the timed window
        t_release = time.perf_counter()
        self.go[p].set()
        deadline = time.monotonic() + PASS_TIMEOUT
        msgs = [self._get(deadline) for _ in self.procs]
        self.cpu.append(cpu.used(before, cpu.snapshot()))
        reports = [Report(cid=m[1], t0=m[3], t1=m[4], rows=m[5], final=m[6]) for m in msgs]
        return t_release, sorted(reports, key=lambda r: r.cid)

    def run_pass(self, p: int) -> tuple[int, float]:
        """Release pass ``p``; ``(rows, seconds)`` from the release to the last final report."""
        t_release, reports = self.pass_reports(p)
        finals = [r for r in reports if r.final]
        return sum(r.rows for r in finals), max(r.t1 for r in finals) - t_release

    def run_passes(self) -> list[tuple[int, float]]:
        """Wait until every child is ready, then run every pass in turn."""
        self.wait_ready()
        return [self.run_pass(p) for p in range(len(self.go))]

    def close(self) -> None:
        self.done.set()
        for proc in self.procs:
            proc.join(timeout=JOIN_TIMEOUT if proc.exitcode is None else 0)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self.results.cancel_join_thread()
        self.results.close()


def standalone(
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    run: Callable[[argparse.Namespace], dict[str, Any]],
    report: Callable[[dict[str, Any]], str],
) -> int:
    """A bench module run on its own (``python -m bench.export``): its arguments and
    ``--json``, its figures, its report printed and the figures written where ``--json`` says."""
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    result = run(args)
    print(report(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0
