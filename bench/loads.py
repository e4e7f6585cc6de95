"""Time-bounded multi-process loads (the ``contention`` and ``rollout`` scenarios): writer and
learner processes of one implementation running at once, and the rate each role kept up.

Every implementation is driven the same way: its buffer is made in this process
(:func:`shared_buffer`: a daemon, cpprb's ``MPReplayBuffer``, TorchRL's ``ReplayBuffer`` over a
shared ``LazyMemmapStorage``, or a ``multiprocessing.Queue``), and the children receive a
*handle* to it (the daemon's endpoint, the pickled buffer, the queue); the children are forked
from one preloaded forkserver (:func:`bench.harness.preloaded_context`) and run torch with this
process's thread count. A child's work per pass is a :data:`Plan` step: a fixed count of
operations (the untimed fill), operations for a number of seconds (the timed load), or nothing
(a writer not in this pass's writer count). A role's rate is its rows over the time from the
pass's release to the last of its children's ends. Beside it, every pass records the CPU that all
the implementation's processes spent in it, and its server's share (:mod:`bench.cpu`).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import queue
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from bench import cpu, data
from bench.adapters import PREFETCH, missing_module
from bench.data import Batch, Spec
from bench.harness import (
    PASS_TIMEOUT,
    Body,
    Children,
    Report,
    Role,
    preloaded_context,
    running_daemon,
)
from bench.peers import cpprb_env
from bench.registry import Context, Row, make_row

SHM = "shmbuffer-daemon"
CPPRB = "cpprb-MPReplayBuffer"
TORCHRL = "torchrl-shared-LazyMemmapStorage"
QUEUE = "mp.Queue"
#: impl -> the module it needs (None: always there)
MODULES: dict[str, str | None] = {
    SHM: "shmbuffer.clients.reader",
    CPPRB: "cpprb",
    TORCHRL: "torchrl.data",
    QUEUE: None,
}
QUEUE_EPISODES = 256  # bound of the Queue peer's queue: a full queue blocks its producers
#: What a load's CPU columns mean (a note of each scenario that runs one).
CPU_NOTE = (
    "cpu_s_per_M_rows: the CPU seconds (utime + stime in /proc/<pid>/stat, every thread, 10 ms "
    "ticks) that all processes of the implementation spent from a pass's release to its last "
    "report (writers, idle ones included, learners, shmbuffer's daemon, any helper process, "
    "the idle forkserver; not this bench process, which only waits), per million rows of the "
    "row's side: written on the writers', sampled on the learners'. daemon_share: the "
    "daemon's part of it (— for a peer: it has no daemon)"
)

Step = tuple[str, float]
"""``("count", n)``: n operations; ``("run", s)``: operations for s seconds; ``("drain", n)``:
(Queue learner) take n episodes off the queue; ``("idle", 0)``: nothing, not final."""
Plan = list[Step]


def missing(impl: str) -> str | None:
    module = MODULES[impl]
    return missing_module(module) if module else None


# -- the buffers (made in this process) -----------------------------------------------------


@contextlib.contextmanager
def _default_start_method(method: str) -> Iterator[None]:
    """TorchRL creates its shared cursor, length and lock with the *default* context; made
    under "fork" (Linux's default) their semaphores cannot be unpickled by a child started
    any other way."""
    old = mp.get_start_method(allow_none=True)
    mp.set_start_method(method, force=True)
    try:
        yield
    finally:
        mp.set_start_method(old, force=True)


def _torchrl_batch(batch: Batch) -> Any:
    import torch
    from tensordict import TensorDict

    n = len(batch["done"])
    return TensorDict({k: torch.from_numpy(v) for k, v in batch.items()}, batch_size=[n])


@contextlib.contextmanager
def shared_buffer(
    impl: str, root: str, capacity: int, unit: str, spec: Spec
) -> Iterator[tuple[Any, int | None]]:
    """The buffer of ``impl`` for the children to share: the handle their roles take, and the
    pid of the process that serves it (shmbuffer's daemon; None for a peer, which has none);
    freed on the way out (the daemon stopped, the memmap folder removed), so the children must
    be gone first."""
    ctx = preloaded_context()  # the children's (Children(preloaded=True))
    if impl == SHM:
        from shmbuffer import runtime

        with running_daemon(root, capacity, unit, spec) as target:
            # The endpoint, not the name: a forked child has the forkserver's environment,
            # whose runtime dir may be an earlier scenario's.
            pid = (runtime.read(target) or {}).get("pid")
            yield runtime.resolve_endpoint(target), pid if isinstance(pid, int) else None
    elif impl == CPPRB:
        import cpprb

        rb = cpprb.MPReplayBuffer(capacity, cpprb_env(spec), ctx=ctx)
        try:
            yield rb, None
        finally:
            del rb
    elif impl == TORCHRL:
        from torchrl.data import LazyMemmapStorage, ReplayBuffer

        logging.getLogger("torchrl").setLevel(logging.WARNING)
        scratch = tempfile.mkdtemp(prefix="bench-memmap-", dir=root)
        try:
            with _default_start_method(ctx.get_start_method()):
                rb = ReplayBuffer(
                    storage=LazyMemmapStorage(capacity, scratch_dir=scratch), shared=True
                )
                # A lazy storage must be initialised before it is shared; one zero row does it
                # (the fill overwrites it).
                zero = {k: np.zeros((1, *shape), dt) for k, (shape, dt) in spec.items()}
                rb.extend(_torchrl_batch(zero))
            yield rb, None
            del rb
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    elif impl == QUEUE:
        data_q = ctx.Queue(QUEUE_EPISODES)
        try:
            yield data_q, None
        finally:
            data_q.cancel_join_thread()
            data_q.close()
    else:
        raise ValueError(f"unknown implementation {impl!r}; known: {list(MODULES)}")


# -- what the children do -------------------------------------------------------------------


def torch_threads(n: int) -> None:
    """The parent's torch intra-op thread count (``--threads``), in a child that has torch:
    with torch's default (one thread per core) every child spins OpenMP threads against the
    others on a small machine, and TorchRL's small extends slow down 40-fold."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(n)


def looping(op: Callable[[int], int], plan: Plan, finish: Callable[[], None]) -> Body:
    """A pass body running ``op(i) -> rows`` as the pass's plan step says, then ``finish``."""

    def body(p: int) -> tuple[int, bool]:
        what, amount = plan[p]
        if what == "idle":
            return 0, False
        rows = i = 0
        if what == "count":
            for i in range(int(amount)):
                rows += op(i)
        else:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < amount:
                rows += op(i)
                i += 1
        finish()
        return rows, True

    return body


@dataclass
class Sink:
    """One implementation's write path in a writer process: ``convert`` a numpy episode to its
    input (for pre-generated data, outside the timed loop), ``write`` it, ``finish`` a pass."""

    convert: Callable[[Batch], Any]
    write: Callable[[Any], None]
    finish: Callable[[], None]


def _same(batch: Batch) -> Batch:
    return batch


def _nothing() -> None:
    pass


@contextlib.contextmanager
def sink(impl: str, handle: Any, unit: str) -> Iterator[Sink]:
    """The write path of ``impl`` into the buffer behind ``handle`` (see :func:`shared_buffer`)."""
    if impl == SHM:
        from shmbuffer import Writer

        with Writer(handle) as writer:
            write = writer.add_episode if unit == "episode" else writer.extend
            yield Sink(_same, write, writer.flush)
    elif impl == CPPRB:
        yield Sink(_same, lambda ep: handle.add(**ep), _nothing)
    elif impl == TORCHRL:
        logging.getLogger("torchrl").setLevel(logging.WARNING)
        yield Sink(_torchrl_batch, handle.extend, _nothing)
    elif impl == QUEUE:
        try:
            yield Sink(_same, lambda ep: handle.put(ep, timeout=PASS_TIMEOUT), _nothing)
        finally:
            handle.cancel_join_thread()  # the consumer may be gone: never block the exit on it
    else:
        raise ValueError(f"unknown implementation {impl!r}")


class _Ring:
    """The Queue peer's learner-side buffer: episodes taken off the queue are copied into a
    preallocated ring of ``capacity`` rows, and sampled from it with ``np.take``."""

    def __init__(self, data_q: Any, capacity: int, spec: Spec) -> None:
        self.q, self.capacity = data_q, capacity
        self.cols = {k: np.empty((capacity, *shape), dt) for k, (shape, dt) in spec.items()}
        self.pos = self.size = 0
        self.rng = np.random.default_rng(0)

    def put(self, ep: Batch) -> None:
        n = len(ep["done"])
        if self.pos + n > self.capacity:
            self.pos = 0
        for k, v in ep.items():
            self.cols[k][self.pos : self.pos + n] = v
        self.pos += n
        self.size = max(self.size, self.pos)

    def drain(self) -> None:
        """Everything on the queue now, without waiting."""
        while True:
            try:
                self.put(self.q.get_nowait())
            except queue.Empty:
                return

    def sample(self, n: int) -> Batch:
        self.drain()
        idx = self.rng.integers(0, self.size, n)
        return {k: np.take(v, idx, axis=0) for k, v in self.cols.items()}


@contextlib.contextmanager
def learner_role(
    impl: str,
    handle: Any,
    plan: Plan,
    batch: int,
    pause: float,
    capacity: int,
    kind: str,
    threads: int,
) -> Iterator[Body]:
    """Samples ``batch`` rows per step, then sleeps ``pause`` seconds (a training step that
    leaves the CPU free, as a GPU update does); ``("drain", n)``: (Queue) take n episodes."""
    torch_threads(threads)
    with contextlib.ExitStack() as stack:
        ring = None
        if impl == SHM:
            from shmbuffer import Reader

            # prefetch: a sampling loop's next 4 batches are asked for in one request while
            # these are gathered (the README's advice for a learner; nothing consumed)
            reader = stack.enter_context(Reader(handle, prefetch=PREFETCH))
            sample: Callable[[int], Any] = reader.sample
        elif impl == QUEUE:
            ring = _Ring(handle, capacity, data.SPECS[kind])
            sample = ring.sample
        else:
            logging.getLogger("torchrl").setLevel(logging.WARNING)
            sample = handle.sample

        torn: tuple[type[BaseException], ...] = ()
        if impl == SHM:
            from shmbuffer.errors import TornReadError

            torn = (TornReadError,)

        def step(_: int) -> int:
            try:
                sample(batch)
            except torn:  # rows overwritten through every resample: this batch got nothing
                return 0
            finally:
                if pause:
                    time.sleep(pause)
            return batch

        timed = looping(step, plan, _nothing)

        # The Queue's writers block on a full queue: once this learner's timed pass is over,
        # a thread keeps taking episodes off it (untimed) until the next pass begins, so a
        # writer still in its last put finishes its pass instead of waiting PASS_TIMEOUT.
        between: list[tuple[threading.Thread, threading.Event]] = []

        def keep_draining(stop: threading.Event) -> None:
            assert ring is not None
            while not stop.is_set():
                try:
                    ring.put(handle.get(timeout=0.05))
                except queue.Empty:
                    continue

        def stop_draining() -> None:
            for thread, stop in between:
                stop.set()
                thread.join()
            between.clear()

        def body(p: int) -> tuple[int, bool]:
            stop_draining()
            what, amount = plan[p]
            if what == "drain":
                assert ring is not None, "only the Queue learner drains"
                for _ in range(int(amount)):
                    ring.put(handle.get(timeout=PASS_TIMEOUT))
                return 0, False
            result = timed(p)
            if ring is not None:
                stop = threading.Event()
                thread = threading.Thread(target=keep_draining, args=(stop,), daemon=True)
                thread.start()
                between.append((thread, stop))
            return result

        try:
            yield body
        finally:
            stop_draining()


# -- measuring ------------------------------------------------------------------------------


def role_rates(
    t_release: float, reports: list[Report], roles: dict[int, str]
) -> dict[str, tuple[int, float]]:
    """Per role: ``(rows, seconds)``, summed over its children that worked in this pass
    (final reports), from the release to the last one's end."""
    out: dict[str, tuple[int, float]] = {}
    for role in dict.fromkeys(roles.values()):
        mine = [r for r in reports if roles[r.cid] == role and r.final]
        if mine:
            out[role] = (sum(r.rows for r in mine), max(r.t1 for r in mine) - t_release)
    return out


class Pass(NamedTuple):
    """One pass of a load: per role ``(rows, seconds)`` (:func:`role_rates`); the CPU seconds
    every process of the implementation spent in it, and its server's (the daemon's; None for
    a peer); both None where the OS could not be read."""

    rates: dict[str, tuple[int, float]]
    cpu_s: float | None
    server_cpu_s: float | None


def run_plan(
    kids: Children, roles: dict[int, str], passes: int, server: int | None = None
) -> list[Pass]:
    """Wait for every child, run ``passes`` passes; per pass its :class:`Pass` (``server``:
    the pid whose CPU is reported apart)."""
    kids.wait_ready()
    out = []
    for p in range(passes):
        rates = role_rates(*kids.pass_reports(p), roles)
        out.append(Pass(rates, *cpu.share(kids.cpu[p], server)))
    return out


def plans(counts: tuple[int, ...], fill: Step, learner_fill: Step, seconds: float) -> Any:
    """``(writer plan for writer w, learner plan)``: pass 0 is ``fill``, then one timed pass of
    ``seconds`` per writer count in ``counts`` (writers past the count idle in it)."""

    def writer(w: int) -> Plan:
        return [fill] + [("run", seconds) if w < n else ("idle", 0.0) for n in counts]

    return writer, [learner_fill] + [("run", seconds)] * len(counts)


def run_load(
    impl: str,
    root: str,
    buffer: tuple[int, str, Spec],
    writer: Role,
    writer_params: dict[str, Any],
    writer_plan: Callable[[int], Plan],
    writers: int,
    learners: int,
    learner_plan: Plan,
    learner_params: dict[str, Any],
) -> list[Pass]:
    """``writers`` children running ``writer(impl=, handle=, wid=, plan=, threads=,
    **writer_params)`` and ``learners`` running :func:`learner_role`, on a fresh ``buffer``
    ``(capacity, unit, spec)`` of ``impl``; per pass its :class:`Pass`, whose rates are
    ``{"writers": (rows, s), "learners": (rows, s)}``. ``threads``: this process's torch
    thread count, given to every child."""
    import torch

    threads = torch.get_num_threads()
    capacity, unit, spec = buffer
    with (
        shared_buffer(impl, root, capacity, unit, spec) as (handle, server),
        Children(passes=len(learner_plan), preloaded=True) as kids,
    ):
        roles: dict[int, str] = {}
        for w in range(writers):
            roles[len(roles)] = "writers"
            params = {"impl": impl, "handle": handle, "wid": w, "plan": writer_plan(w)}
            params["threads"] = threads
            kids.start(writer, **params, **writer_params)
        for _ in range(learners):
            roles[len(roles)] = "learners"
            kids.start(
                learner_role,
                impl=impl,
                handle=handle,
                plan=learner_plan,
                threads=threads,
                **learner_params,
            )
        return run_plan(kids, roles, len(learner_plan), server)


def cpu_fields(rows: int, pass_: Pass) -> dict[str, float | None]:
    """A row's CPU figures: ``cpu_s`` (every process of the implementation, over the pass),
    ``cpu_s_per_m_rows`` (that over the row's own rows: rows written on a writer side, rows
    sampled on a learner side, in millions), ``daemon_cpu_s`` and ``daemon_cpu_share`` (of
    ``cpu_s``; None for a peer, which has no daemon)."""
    total, server = pass_.cpu_s, pass_.server_cpu_s
    return {
        "cpu_s": total,
        "cpu_s_per_m_rows": total / rows * 1e6 if total is not None and rows > 0 else None,
        "daemon_cpu_s": server,
        "daemon_cpu_share": server / total if server is not None and total else None,
    }


def rate_rows(
    ctx: Context,
    scenario: str,
    impl: str,
    counts: tuple[int, ...],
    passes: list[Pass],
    sides: tuple[tuple[str, str, int], ...],
    row_bytes: int,
    learners: int,
) -> list[Row]:
    """One row per writer count and side of :func:`run_load`'s timed passes (the first pass,
    the untimed fill, is dropped): ``sides`` are ``(role, op, rows per call)``, the op named
    ``<op>-<n>w``, with the pass's CPU figures (:func:`cpu_fields`); a side with no report gets
    a note instead of a row."""
    out: list[Row] = []
    for n, pass_ in zip(counts, passes[1:], strict=True):
        for role, op, chunk in sides:
            if role not in pass_.rates:
                ctx.note(scenario, f"{impl} {op}-{n}w: no {role} report")
                continue
            rows, secs = pass_.rates[role]
            out.append(
                make_row(
                    scenario,
                    impl,
                    f"{op}-{n}w",
                    rows=rows,
                    nbytes=rows * row_bytes,
                    seconds=secs,
                    pass_="steady",
                    chunk=chunk,
                    writers=n,
                    learners=learners,
                    **cpu_fields(rows, pass_),
                )
            )
    return out
