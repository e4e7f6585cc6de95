"""Daemon scenarios (issue "the daemon"): writer processes inserting through a daemon, a learner
sampling it, and the control-message rate one daemon sustains.

Peers: a pickled ``multiprocessing.Queue`` to one consumer process, cpprb's ``MPReplayBuffer``
written from child processes (both in :mod:`bench.workers`), cpprb ``ReplayBuffer`` and TorchRL
``ReplayBuffer`` + ``LazyMemmapStorage`` sampled in-process (:mod:`bench.peers`), and the
single-thread copy limit (bench.copylimit).

This module only says what is measured and turns the timings into rows. Daemons and children
come from :mod:`bench.harness`: each daemon is a real ``shmbuffer.cli start`` subprocess whose
segment lies in a bench-owned folder under /dev/shm (removed afterwards); a multi-process pass
is timed from the release of a start event to the last writer's ``flush`` returning (for the
Queue peer: the consumer's last copy).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from bench import data, workers
from bench.adapters import (
    Adapter,
    DaemonBuffer,
    DaemonPrefetch,
    Unsupported,
    missing_module,
    run_each,
)
from bench.copylimit import CopyLimit
from bench.harness import PASSES, bench_dirs
from bench.peers import Cpprb, TorchRLMemmap
from bench.registry import Context, Row, make_row, scenario, timed
from bench.workers import LENGTH, POOL, Passes

DAEMON = DaemonBuffer.name
#: Untimed calls of each sampling op first, for every implementation: the first call of an op
#: pays one-off work (the first batch's fresh pages: ~14 ms for 256 image rows; a reader's
#: first prefetch), which is not the steady cost the pass reports.
WARMUP_CALLS = 5


# -- insert scenarios -----------------------------------------------------------------------


INSERT_IMPLS: list[tuple[str, Callable[..., Passes], str | None]] = [
    (DAEMON, workers.insert_daemon, None),
    ("mp.Queue", workers.insert_queue, None),
    ("cpprb-MPReplayBuffer", workers.insert_cpprb, "cpprb"),
]


def _copy_limit(kind: str, unit: str, total: int, tmpdir: str) -> list[tuple[str, int, float]]:
    """``(pass, rows, seconds)``: the copy limit writing the same ``total`` episodes per pass."""
    limit = CopyLimit(total * LENGTH, data.SPECS[kind], unit, tmpdir)
    pool = data.pool(kind, POOL, LENGTH, seed=0)
    seq = [pool[i % len(pool)] for i in range(total)]
    out = []
    for pass_ in PASSES:
        limit.set_pass(pass_)
        seconds, calls = timed(limit.write, seq, float("inf"))
        out.append((pass_, calls * LENGTH, seconds))
    return out


def _insert(ctx: Context, name: str, kind: str, unit: str, episodes: int) -> list[Row]:
    counts = (2,) if ctx.quick else (1, 2, 4)  # --quick: one daemon (each imports torch)
    step = max(counts)
    total = max(step, ctx.size(episodes) // step * step)  # episodes per pass, all writers
    row_bytes = data.row_bytes(data.SPECS[kind])
    ctx.note(
        name,
        f"{total} episodes x {LENGTH} steps per pass ({total * LENGTH * row_bytes / 1e9:.2f} GB) "
        f"split over the writers, into a fresh {total * LENGTH}-row buffer per writer count; "
        "first = fresh buffer (the daemon reserves its segment's pages at start, writers "
        "attach with prefault), steady = a second pass into the same buffer (overwrites all)",
    )
    ctx.note(
        name,
        "mp.Queue: N producer processes -> one pickled Queue -> 1 consumer process copying into "
        "a preallocated ring; timed to the consumer's last copy. cpprb-MPReplayBuffer: created "
        "in the parent, add(**episode) from N child processes (forked from one forkserver that "
        "imported torch and the peers once)",
    )
    ctx.note(
        name,
        f"copy-limit: one thread, the same episodes copied (rows of 4 KiB or more with "
        f"streaming stores, as a Writer copies them; else np.copyto) into a preallocated "
        f"{total * LENGTH}-row ring (first: fresh np.empty pages); measured once and repeated "
        "for each writer count",
    )
    out: list[Row] = []

    def add(impl: str, op: str, pass_: str, rows: int, seconds: float, writers: int) -> None:
        nbytes = rows * row_bytes
        extra = {"chunk": LENGTH, "writers": writers}
        out.append(
            make_row(
                name, impl, op, rows=rows, nbytes=nbytes, seconds=seconds, pass_=pass_, **extra
            )
        )

    with bench_dirs(ctx) as root:
        copy_rows = _copy_limit(kind, unit, total, ctx.tmpdir)
        for n in counts:
            op = f"insert-{n}w"
            for impl, fn, module in ctx.rotate(INSERT_IMPLS):  # none always first
                reason = missing_module(module) if module else None
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
                    add(impl, op, pass_, rows, seconds, writers=n)
            for pass_, rows, seconds in copy_rows:
                add("copy-limit", op, pass_, rows, seconds, writers=1)
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


def _sample_ops(
    adapter: Adapter, length: int, episodes: tuple[int, ...] = (32,)
) -> list[tuple[str, Callable[[Any], Any], int]]:
    slices = getattr(adapter, "sample_slices", None)
    if slices is None:  # TorchRL SliceSampler(num_slices=32); copy limit: 32 runs of 16 rows
        slices = adapter.sample_episodes
    ops: list[tuple[str, Callable[[Any], Any], int]] = [
        ("sample", lambda _: adapter.sample(256), 256)
    ]

    def episodes_of(k: int) -> Callable[[Any], Any]:
        return lambda _: adapter.sample_episodes(k, length)

    for k in episodes:
        op = "sample-episodes" if k == 32 else f"sample-episodes{k}"
        ops.append((op, episodes_of(k), k * length))
    ops.append(("sample-slices", lambda _: slices(32, 16), 32 * 16))
    n_step = getattr(adapter, "sample_n_step", None)
    if n_step is not None:  # sample(256, n_step=3): the Reader's n-step sample
        ops.append(("sample-nstep3", lambda _: n_step(256), 256))
    return ops


@scenario("daemon.sample")
def sample(ctx: Context) -> list[Row]:
    """A learner samples a daemon holding 50,000 image rows (250 episodes of 200): sample(256),
    sample_episodes(32) (zero-copy views under a lease), sample_slices(32, 16),
    sample(256, n_step=3) (sample-nstep3), and the first, the third and the last with
    ``Reader(prefetch=4)`` (shmbuffer-daemon-prefetch); vs TorchRL
    LazyMemmapStorage (RandomSampler, SliceSampler), cpprb ReplayBuffer and np.take. Then
    sample_episodes(32) and (8) on episodes of 50, 200 and 400 steps (same rows): cost per call."""
    name = "daemon.sample"
    capacity = ctx.size(50_000, minimum=8000)
    calls = ctx.size(500, minimum=20)
    row_bytes = data.row_bytes(data.ATARI_SPEC)
    ctx.note(
        name,
        f"{capacity} rows of obs u8[4,84,84] ({capacity * row_bytes / 1e9:.2f} GB), filled "
        f"untimed; {calls} calls per op (capped at {ctx.max_op_seconds:g} s) after "
        f"{WARMUP_CALLS} untimed ones; pass=steady",
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
        pool = data.pool("images", max(2, 2000 // length), length, seed=0)
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
                    for _ in range(WARMUP_CALLS):  # first-use work: fresh pages, a prefetch
                        fn(None)
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
    main_ops = ("sample", "sample-episodes", "sample-slices", "sample-episodes8", "sample-nstep3")
    impls: list[type[Adapter]] = [DaemonBuffer, DaemonPrefetch, TorchRLMemmap, Cpprb, CopyLimit]
    kw: dict[str, Any] = {"capacity": capacity, "spec": data.ATARI_SPEC, "unit": "episode"}
    with bench_dirs(ctx) as root:
        sub = dataclasses.replace(ctx, tmpdir=root)  # same notes list; scratch under /dev/shm
        out += run_each(sub, name, ctx.rotate(impls), body_for(LENGTH, main_ops), **kw)
        for length in () if ctx.quick else (50, 400):  # --quick: one daemon, not three
            body = body_for(length, ("sample-episodes", "sample-episodes8"), f"-L{length}")
            out += run_each(sub, name, [DaemonBuffer], body, **kw)
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
    from shmbuffer.wire.protocol import encode, request

    name = "daemon.messages"
    seconds, window = (0.5 if ctx.quick else 3.0), 100
    msg_bytes = len(encode(request("ping", 10**6)))
    ctx.note(
        name,
        f"rows = requests answered (each one ping round trip, {window} in flight per client); "
        f"bytes = request header bytes ({msg_bytes} B each); pass=steady",
    )
    out: list[Row] = []
    with bench_dirs(ctx) as root:
        for n in (2,) if ctx.quick else (1, 2):  # --quick: one daemon
            op = f"ping-{n}c"
            try:
                rows, secs = workers.ping_daemon(root, n, seconds, window)
            except Exception as exc:
                ctx.note(name, f"{DAEMON} {op} failed: {type(exc).__name__}: {exc}")
                continue
            nbytes = rows * msg_bytes
            out.append(
                make_row(
                    name,
                    DAEMON,
                    op,
                    rows=rows,
                    nbytes=nbytes,
                    seconds=secs,
                    pass_="steady",
                    clients=n,
                )
            )
    return out
