"""Daemon scenarios (issue "the daemon"): writer processes inserting through a daemon, a learner
sampling it, and the control-message rate one daemon sustains.

Peers: a pickled ``multiprocessing.Queue`` to one consumer process, cpprb's ``MPReplayBuffer``
written from child processes, cpprb ``ReplayBuffer`` and TorchRL ``ReplayBuffer`` +
``LazyMemmapStorage`` sampled in-process, and the single-thread numpy copy limit.

Each daemon is a real ``shmbuffer.daemon.cli start`` subprocess whose segment lies in a
bench-owned folder under /dev/shm (removed afterwards). Child processes are spawned, build their
data and connect *before* a start event, and report their own clock readings through a queue
(``time.perf_counter`` is CLOCK_MONOTONIC on Linux: one clock for every process). A pass is timed
from the parent's release of the start event to the last writer's ``flush`` returning (for the
Queue peer: the consumer's last copy). Every child, and every daemon, is stopped in ``finally``.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from contextlib import contextmanager
from typing import Any

import numpy as np

from bench import data
from bench.adapters import Adapter, Unsupported, run_each
from bench.copylimit import CopyLimit
from bench.data import Batch, Spec
from bench.peers import Cpprb, TorchRLMemmap, _missing
from bench.registry import Context, Row, make_row, scenario, timed

DAEMON = "shmbuffer-daemon"
LENGTH = 200  # steps per episode
POOL = 8  # distinct episodes each writer cycles through
PASSES = ("first", "steady")
READY_TIMEOUT = 180.0  # children import torch and build data on a busy 2-core machine
PASS_TIMEOUT = 180.0
JOIN_TIMEOUT = 30.0
DAEMON_START_TIMEOUT = 60.0
DAEMON_STOP_TIMEOUT = 15.0
RUNTIME_ENV = "SHMBUFFER_RUNTIME_DIR"

SPECS: dict[str, Spec] = {"images": data.ATARI_SPEC, "small": data.TRANSITION_SPEC}

_names = itertools.count()


# -- data -----------------------------------------------------------------------------------


def _pool(kind: str, seed: int, length: int = LENGTH, count: int = POOL) -> list[Batch]:
    """``count`` distinct episodes of ``length`` steps of the ``kind`` spec."""
    if kind == "images":
        return data.episodes(count, length, seed=seed)
    batch = data.transitions(count * length, seed=seed)
    batch["done"][:] = False
    batch["done"][length - 1 :: length] = True
    return data.chunks(batch, length)


@contextmanager
def bench_dirs(ctx: Context) -> Iterator[str]:
    """A bench-owned folder for segments and scratch files (on /dev/shm when there is one),
    with its own runtime dir (``SHMBUFFER_RUNTIME_DIR``, inherited by the daemons and children
    started meanwhile) so nothing else that cleans the default one can pull a name from under
    a run. Both are removed, and the variable restored, afterwards."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else ctx.tmpdir
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


# -- the daemon -----------------------------------------------------------------------------


@contextmanager
def running_daemon(
    storage_dir: str, capacity: int, unit: str, spec: Spec | None = None
) -> Iterator[str]:
    """A daemon subprocess serving a fresh buffer; yields its name once it is ready.

    With ``spec`` the schema is declared up front, so the daemon creates (and prefaults) its
    segment before it listens: nothing of that is left for the first timed write."""
    from shmbuffer.daemon import runtime

    name = f"bench-{os.getpid()}-{next(_names)}"
    cmd = [sys.executable, "-m", "shmbuffer.daemon.cli", "--log-level", "WARNING", "start"]
    cmd += ["--name", name, "--capacity", str(capacity), "--unit", unit]
    cmd += ["--storage-dir", storage_dir]
    if spec is not None:
        path = os.path.join(storage_dir, f"{name}.schema.json")
        schema = {k: {"dtype": dt.name, "shape": list(shape)} for k, (shape, dt) in spec.items()}
        with open(path, "w") as f:
            json.dump(schema, f)
        cmd += ["--schema", path]
    log_path = os.path.join(storage_dir, f"{name}.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + DAEMON_START_TIMEOUT
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


# -- child processes ------------------------------------------------------------------------


def _child_main(results: Any, go: list[Any], cid: int, role: str, params: dict[str, Any]) -> None:
    """Entry point of every spawned child: prepare, report ready, then one body per pass."""
    try:
        with _ROLES[role](**params) as body:
            results.put(("ready", cid))
            for p, event in enumerate(go):
                if not event.wait(PASS_TIMEOUT):
                    raise TimeoutError(f"no start signal for pass {p} in {PASS_TIMEOUT:g} s")
                t0 = time.perf_counter()
                rows, final = body(p)
                results.put(("pass", cid, p, t0, time.perf_counter(), rows, final))
    except BaseException:
        results.put(("error", cid, traceback.format_exc(limit=8)))
        raise


@contextmanager
def _writer_role(
    target: str, kind: str, unit: str, wid: int, episodes: int
) -> Iterator[Callable[[int], tuple[int, bool]]]:
    """A shmbuffer ``Writer`` (it attaches the segment with prefault): ``episodes`` episodes
    per pass, then ``flush``."""
    pool = _pool(kind, seed=wid)
    from shmbuffer import Writer

    writer = Writer(target)
    write = writer.add_episode if unit == "episode" else writer.extend

    def body(_: int) -> tuple[int, bool]:
        for i in range(episodes):
            write(pool[i % len(pool)])
        writer.flush()
        return episodes * LENGTH, True

    try:
        yield body
    finally:
        writer.close()


@contextmanager
def _producer_role(
    data_q: Any, kind: str, wid: int, episodes: int
) -> Iterator[Callable[[int], tuple[int, bool]]]:
    """Puts episodes on a ``multiprocessing.Queue`` (pickled by its feeder thread); its own end
    time is not the pass's end (the consumer's is)."""
    pool = _pool(kind, seed=wid)

    def body(_: int) -> tuple[int, bool]:
        for i in range(episodes):
            data_q.put(pool[i % len(pool)])
        return episodes * LENGTH, False

    try:
        yield body
    finally:
        data_q.close()
        data_q.join_thread()  # everything put is delivered before the process exits


@contextmanager
def _consumer_role(
    data_q: Any, kind: str, episodes: int, capacity: int
) -> Iterator[Callable[[int], tuple[int, bool]]]:
    """Takes ``episodes`` episodes per pass off the queue and copies each into a preallocated
    ring (fresh ``np.empty`` memory on the first pass, reused on the second)."""
    ring = {k: np.empty((capacity, *shape), dt) for k, (shape, dt) in SPECS[kind].items()}
    pos = 0

    def body(_: int) -> tuple[int, bool]:
        nonlocal pos
        rows = 0
        for _ in range(episodes):
            ep = data_q.get(timeout=PASS_TIMEOUT)
            n = len(ep["done"])
            if pos + n > capacity:
                pos = 0
            for k, v in ep.items():
                np.copyto(ring[k][pos : pos + n], v)
            pos += n
            rows += n
        return rows, True

    yield body


@contextmanager
def _cpprb_role(rb: Any, kind: str, wid: int, episodes: int) -> Iterator[Any]:
    """``MPReplayBuffer.add(**episode)`` from a child process."""
    pool = _pool(kind, seed=wid)

    def body(_: int) -> tuple[int, bool]:
        for i in range(episodes):
            rb.add(**pool[i % len(pool)])
        return episodes * LENGTH, True

    yield body


@contextmanager
def _pinger_role(target: str, seconds: float, window: int) -> Iterator[Any]:
    """``ping`` requests pipelined ``window`` at a time (send them all, then wait for all)."""
    from shmbuffer.clients.connection import Connection

    conn = Connection(target, "admin", timeout=30.0)

    def body(_: int) -> tuple[int, bool]:
        count = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            seqs = [conn.send("ping") for _ in range(window)]
            conn.wait_all(seqs)
            for seq in seqs:
                conn.wait(seq)  # pops the reply and checks it is ok
            count += window
        return count, True

    try:
        yield body
    finally:
        conn.close()


_ROLES: dict[str, Callable[..., Any]] = {
    "writer": _writer_role,
    "producer": _producer_role,
    "consumer": _consumer_role,
    "cpprb": _cpprb_role,
    "pinger": _pinger_role,
}


class Children:
    """Spawned child processes that report on one queue; always joined, killed if need be."""

    def __init__(self, mpctx: Any, passes: int = len(PASSES)) -> None:
        self.mp = mpctx
        self.results = mpctx.Queue()
        self.go = [mpctx.Event() for _ in range(passes)]
        self.procs: list[Any] = []

    def start(self, role: str, **params: Any) -> None:
        cid = len(self.procs)
        proc = self.mp.Process(
            target=_child_main,
            args=(self.results, self.go, cid, role, params),
            name=f"bench-{role}-{cid}",
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

    def run_pass(self, p: int) -> tuple[int, float]:
        """Release pass ``p``; ``(rows, seconds)`` from the release to the last final report."""
        t_release = time.perf_counter()
        self.go[p].set()
        deadline = time.monotonic() + PASS_TIMEOUT
        msgs = [self._get(deadline) for _ in self.procs]
        finals = [m for m in msgs if m[6]]
        return sum(m[5] for m in finals), max(m[4] for m in finals) - t_release

    def close(self) -> None:
        for proc in self.procs:
            proc.join(timeout=JOIN_TIMEOUT if proc.exitcode is None else 0)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self.results.cancel_join_thread()
        self.results.close()


def _spawn() -> Any:
    return mp.get_context("spawn")


@contextmanager
def children(passes: int = len(PASSES)) -> Iterator[Children]:
    group = Children(_spawn(), passes)
    try:
        yield group
    except BaseException:
        for proc in group.procs:  # failed: no one waits for stragglers
            if proc.is_alive():
                proc.kill()
        raise
    finally:
        group.close()


# -- insert scenarios -----------------------------------------------------------------------


def _insert_daemon(root: str, kind: str, unit: str, n: int, per_writer: int) -> list[Any]:
    with (
        running_daemon(root, n * per_writer * LENGTH, unit, SPECS[kind]) as target,
        children() as kids,
    ):
        for w in range(n):
            kids.start("writer", target=target, kind=kind, unit=unit, wid=w, episodes=per_writer)
        kids.wait_ready()
        return [kids.run_pass(p) for p in range(len(PASSES))]


def _insert_queue(root: str, kind: str, unit: str, n: int, per_writer: int) -> list[Any]:
    with children() as kids:
        data_q = kids.mp.Queue()
        kids.start(
            "consumer",
            data_q=data_q,
            kind=kind,
            episodes=n * per_writer,
            capacity=n * per_writer * LENGTH,
        )
        for w in range(n):
            kids.start("producer", data_q=data_q, kind=kind, wid=w, episodes=per_writer)
        kids.wait_ready()
        return [kids.run_pass(p) for p in range(len(PASSES))]


def _insert_cpprb(root: str, kind: str, unit: str, n: int, per_writer: int) -> list[Any]:
    import cpprb

    env = {k: {"shape": shape or 1, "dtype": dt} for k, (shape, dt) in SPECS[kind].items()}
    with children() as kids:
        rb = cpprb.MPReplayBuffer(n * per_writer * LENGTH, env, ctx=kids.mp)
        try:
            for w in range(n):
                kids.start("cpprb", rb=rb, kind=kind, wid=w, episodes=per_writer)
            kids.wait_ready()
            return [kids.run_pass(p) for p in range(len(PASSES))]
        finally:
            del rb


INSERT_IMPLS: list[tuple[str, Callable[..., list[Any]], str | None]] = [
    (DAEMON, _insert_daemon, None),
    ("mp.Queue", _insert_queue, None),
    ("cpprb-MPReplayBuffer", _insert_cpprb, "cpprb"),
]


def _insert(ctx: Context, name: str, kind: str, unit: str, episodes: int) -> list[Row]:
    counts = (1, 2) if ctx.quick else (1, 2, 4)
    step = max(counts)
    total = max(step, ctx.size(episodes) // step * step)  # episodes per pass, all writers
    spec = SPECS[kind]
    row_bytes = data.row_bytes(spec)
    out: list[Row] = []
    dirs = contextlib.ExitStack()
    root = dirs.enter_context(bench_dirs(ctx))
    ctx.note(
        name,
        f"{total} episodes x {LENGTH} steps per pass ({total * LENGTH * row_bytes / 1e9:.2f} GB) "
        f"split over the writers, into a fresh {total * LENGTH}-row buffer per writer count; "
        "first = fresh buffer (the daemon prefaults its segment at start, writers attach with "
        "prefault), steady = a second pass into the same buffer (overwrites all)",
    )
    ctx.note(
        name,
        "mp.Queue: N producer processes -> one pickled Queue -> 1 consumer process copying into "
        "a preallocated ring; timed to the consumer's last copy. cpprb-MPReplayBuffer: created "
        "in the parent (spawn context), add(**episode) from N spawned children",
    )
    ctx.note(
        name,
        f"copy-limit: one thread, np.copyto of the same episodes into a preallocated "
        f"{total * LENGTH}-row ring (first: fresh np.empty pages); measured once and repeated "
        "for each writer count",
    )
    try:
        limit = CopyLimit(total * LENGTH, spec, unit, ctx.tmpdir)
        pool = _pool(kind, seed=0)
        seq = [pool[i % len(pool)] for i in range(total)]
        copy_rows = []
        for pass_ in PASSES:
            limit.set_pass(pass_)
            seconds, calls = timed(limit.write, seq, float("inf"))
            copy_rows.append((pass_, calls * LENGTH, seconds))
        del limit, pool, seq
        for n in counts:
            op = f"insert-{n}w"
            for impl, fn, module in INSERT_IMPLS:
                reason = _missing(module) if module else None
                if reason:
                    if n == counts[0]:
                        ctx.note(name, f"{impl} skipped: {reason}")
                    continue
                try:
                    passes = fn(root, kind, unit, n, total // n)
                except Exception as exc:
                    ctx.note(name, f"{impl} {op} failed: {type(exc).__name__}: {exc}")
                    continue
                for pass_, (rows, seconds) in zip(PASSES, passes, strict=True):
                    out.append(
                        make_row(
                            name,
                            impl,
                            op,
                            rows=rows,
                            nbytes=rows * row_bytes,
                            seconds=seconds,
                            pass_=pass_,
                            chunk=LENGTH,
                            writers=n,
                        )
                    )
            for pass_, rows, seconds in copy_rows:
                out.append(
                    make_row(
                        name,
                        "copy-limit",
                        op,
                        rows=rows,
                        nbytes=rows * row_bytes,
                        seconds=seconds,
                        pass_=pass_,
                        chunk=LENGTH,
                        writers=1,
                    )
                )
    finally:
        dirs.close()
    return out


@scenario("daemon.insert_images")
def insert_images(ctx: Context) -> list[Row]:
    """1, 2, 4 writer processes insert 200 episodes x 200 steps of obs u8[4,84,84] (1.1 GB)
    through a daemon, twice (fresh buffer, then steady); vs a pickled mp.Queue to one consumer,
    cpprb MPReplayBuffer written from children and the single-thread np.copyto."""
    return _insert(ctx, "daemon.insert_images", "images", "episode", episodes=200)


@scenario("daemon.insert_small")
def insert_small(ctx: Context) -> list[Row]:
    """The same with small rows (obs f32[64], action i64, reward f32, done bool) in transition
    unit: 5,000 episodes of 200 steps (1M rows) per pass, one extend per episode."""
    return _insert(ctx, "daemon.insert_small", "small", "transition", episodes=5000)


# -- sampling -------------------------------------------------------------------------------


class DaemonBuffer(Adapter):
    """A daemon subprocess holding the buffer; filled by a ``Writer`` and sampled by a
    ``Reader`` in this process (shared memory both ways)."""

    name = DAEMON

    @classmethod
    def missing(cls) -> str | None:
        return _missing("shmbuffer.clients.reader")

    def __init__(self, capacity: int, spec: Spec, unit: str, tmpdir: str) -> None:
        super().__init__(capacity, spec, unit, tmpdir)
        from shmbuffer import Reader, Writer

        self._daemon = running_daemon(tmpdir, capacity, unit, spec)
        self.target = self._daemon.__enter__()
        self.reader: Any = None
        try:
            self.writer: Any = Writer(self.target)
            self.reader = Reader(self.target)
        except BaseException:
            self.close()
            raise

    def write(self, native: Batch) -> None:
        if self.unit == "episode":
            self.writer.add_episode(native)
        else:
            self.writer.extend(native)

    def prepare_sampling(self) -> None:
        self.writer.flush()
        self.reader.sample(2)  # attaches the segment

    def sample(self, n: int) -> Any:
        return self.reader.sample(n)

    def sample_episodes(self, n: int, length: int) -> Any:
        with self.reader.sample_episodes(n) as episodes:
            for ep in episodes:  # touch one element of each view
                ep["obs"].flatten()[0].item()
        return len(episodes)

    def sample_slices(self, n: int, length: int) -> Any:
        return self.reader.sample_slices(n, length)

    def close(self) -> None:
        try:
            for client in (getattr(self, "writer", None), self.reader):
                if client is not None:
                    client.close()
        finally:
            self._daemon.__exit__(None, None, None)


def _sample_ops(
    adapter: Adapter, length: int, episodes: tuple[int, ...] = (32,)
) -> list[tuple[str, Callable[[Any], Any], int]]:
    slices = getattr(adapter, "sample_slices", None)
    if slices is None:  # TorchRL SliceSampler(num_slices=32); copy limit: 32 runs of 16 rows
        slices = adapter.sample_episodes
    ops: list[tuple[str, Callable[[Any], Any], int]] = [
        ("sample", lambda _: adapter.sample(256), 256)
    ]
    for k in episodes:
        op = "sample-episodes" if k == 32 else f"sample-episodes{k}"
        ops.append((op, lambda _, k=k: adapter.sample_episodes(k, length), k * length))
    ops.append(("sample-slices", lambda _: slices(32, 16), 32 * 16))
    return ops


@scenario("daemon.sample")
def sample(ctx: Context) -> list[Row]:
    """A learner samples a daemon holding 50,000 image rows (250 episodes of 200): sample(256),
    sample_episodes(32) (zero-copy views under a lease), sample_slices(32, 16); vs TorchRL
    LazyMemmapStorage (RandomSampler, SliceSampler), cpprb ReplayBuffer and np.take. Then
    sample_episodes(32) and (8) on episodes of 50, 200 and 400 steps (same rows): cost per call."""
    name = "daemon.sample"
    capacity = ctx.size(50_000, minimum=8000)
    calls = ctx.size(200, minimum=20)
    row_bytes = data.row_bytes(data.ATARI_SPEC)
    dirs = contextlib.ExitStack()
    root = dirs.enter_context(bench_dirs(ctx))
    sub = dataclasses.replace(ctx, tmpdir=root)  # same notes list; scratch under /dev/shm
    ctx.note(
        name,
        f"{capacity} rows of obs u8[4,84,84] ({capacity * row_bytes / 1e9:.2f} GB), filled "
        f"untimed; {calls} calls per op (capped at {ctx.max_op_seconds:g} s); pass=steady",
    )
    ctx.note(
        name,
        "shmbuffer-daemon sample-episodes: 32 zero-copy views under a lease (enter, touch one "
        "element of each, release); peers copy: TorchRL SliceSampler(num_slices=32, "
        "end_key='done') with batch 32 x 200, copy-limit 32 x 200-row copies. sample-slices: "
        "TorchRL SliceSampler(num_slices=32) batch 512; copy-limit 32 runs of 16 rows",
    )
    per_call_us: dict[tuple[str, int], float] = {}

    def body_for(length: int, ops: tuple[str, ...], op_suffix: str = "") -> Any:
        pool = _pool("images", seed=0, length=length, count=max(2, 2000 // length))
        order = list(range(capacity // length))

        def body(adapter: Adapter, create_s: float, rows: list[Row]) -> None:
            natives = [adapter.convert(ep) for ep in pool]  # untimed, like the core scenarios
            for i in order:
                adapter.write(natives[i % len(natives)])
            del natives
            adapter.prepare_sampling()
            for op, fn, per_call in _sample_ops(adapter, length, (32, 8)):
                if op not in ops:
                    continue
                try:
                    seconds, n = timed(fn, range(calls), ctx.max_op_seconds)
                except Unsupported as exc:
                    ctx.note(name, f"{adapter.name} {op}: {exc}")
                    continue
                except Exception as exc:  # one op failing leaves the others to run
                    ctx.note(
                        name, f"{adapter.name} {op + op_suffix} failed: {type(exc).__name__}: {exc}"
                    )
                    continue
                if op.startswith("sample-episodes") and adapter.name == DAEMON:
                    per_call_us[(op, length)] = seconds / n * 1e6
                rows.append(
                    make_row(
                        name,
                        adapter.name,
                        op + op_suffix,
                        rows=n * per_call,
                        nbytes=n * per_call * row_bytes,
                        seconds=seconds,
                        pass_="steady",
                        chunk=per_call,
                        calls=n,
                    )
                )

        return body

    out: list[Row] = []
    try:
        main_ops = ("sample", "sample-episodes", "sample-slices", "sample-episodes8")
        impls: list[type[Adapter]] = [DaemonBuffer, TorchRLMemmap, Cpprb, CopyLimit]
        kw: dict[str, Any] = {"capacity": capacity, "spec": data.ATARI_SPEC, "unit": "episode"}
        out += run_each(sub, name, impls, body_for(LENGTH, main_ops), **kw)
        for length in (50, 400):
            body = body_for(length, ("sample-episodes", "sample-episodes8"), f"-L{length}")
            out += run_each(sub, name, [DaemonBuffer], body, **kw)
    finally:
        dirs.close()
    for op in ("sample-episodes", "sample-episodes8"):
        got = {length: us for (o, length), us in sorted(per_call_us.items()) if o == op}
        if got:
            text = ", ".join(f"L={k}: {v:.0f} us" for k, v in got.items())
            k = 32 if op == "sample-episodes" else 8
            ctx.note(
                name, f"shmbuffer-daemon sample_episodes({k}) per call by episode length: {text}"
            )
    return out


# -- control messages -----------------------------------------------------------------------


@scenario("daemon.messages")
def messages(ctx: Context) -> list[Row]:
    """Control messages per second one daemon sustains: 1 and 2 client processes each sending
    ``ping`` requests, 100 in flight at a time, for 3 s."""
    from shmbuffer.protocol import encode, request

    name = "daemon.messages"
    seconds, window = (0.5 if ctx.quick else 3.0), 100
    msg_bytes = len(encode(request("ping", 10**6)))
    ctx.note(
        name,
        f"rows = requests answered (each one ping round trip, {window} in flight per client); "
        f"bytes = request header bytes ({msg_bytes} B each); pass=steady",
    )
    out: list[Row] = []
    dirs = contextlib.ExitStack()
    root = dirs.enter_context(bench_dirs(ctx))
    try:
        for n in (1, 2):
            op = f"ping-{n}c"
            try:
                with running_daemon(root, 1000, "transition") as target, children(1) as kids:
                    for _ in range(n):
                        kids.start("pinger", target=target, seconds=seconds, window=window)
                    kids.wait_ready()
                    rows, secs = kids.run_pass(0)
            except Exception as exc:
                ctx.note(name, f"{DAEMON} {op} failed: {type(exc).__name__}: {exc}")
                continue
            out.append(
                make_row(
                    name,
                    DAEMON,
                    op,
                    rows=rows,
                    nbytes=rows * msg_bytes,
                    seconds=secs,
                    pass_="steady",
                    clients=n,
                )
            )
    finally:
        dirs.close()
    return out
