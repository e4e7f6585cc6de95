"""Contention scenario: writer processes and two learner processes at once, as training runs,
and the insert and sample rates each side keeps up while the other works, with the CPU all of
an implementation's processes spent per million rows inserted or sampled (:mod:`bench.cpu`).

For each implementation in turn (the order rotates with the repetition), a fresh buffer of
image rows is made in this process and shared with child processes (:mod:`bench.loads`):
shmbuffer through a daemon (``Writer.add_episode`` / ``Reader(prefetch=4).sample``), cpprb's
``MPReplayBuffer`` (``add`` / ``sample`` from the children) and TorchRL's ``ReplayBuffer`` over
a shared ``LazyMemmapStorage`` (``extend`` / ``sample``). Pass 0 fills the buffer (untimed);
then, for each writer count, the writers insert pre-generated episodes and both learners
sample batches of 256, all for the same number of seconds.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from bench import data, loads
from bench.harness import Body, bench_dirs
from bench.registry import Context, Row, scenario

NAME = "contention"
IMPLS = [loads.SHM, loads.CPPRB, loads.TORCHRL]
KIND, UNIT = "images", "episode"
LENGTH = 200  # steps per episode
LEARNERS = 2
BATCH = 256


@contextmanager
def writer_role(
    impl: str, handle: Any, wid: int, plan: loads.Plan, threads: int, pool_size: int
) -> Iterator[Body]:
    """Inserts pre-generated episodes (converted to the impl's input before any pass)."""
    loads.torch_threads(threads)
    pool = data.pool(KIND, pool_size, LENGTH, seed=wid)
    with loads.sink(impl, handle, UNIT) as out:
        natives = [out.convert(ep) for ep in pool]
        del pool

        def op(i: int) -> int:
            out.write(natives[i % len(natives)])
            return LENGTH

        yield loads.looping(op, plan, out.finish)


@scenario(NAME)
def contention(ctx: Context) -> list[Row]:
    """1, 2 and 4 writer processes (--workers) inserting 200-step image episodes (u8[4,84,84])
    while two learner processes sample(256), all at once for 3 s: insert and sample rates and
    CPU per row; shmbuffer through a daemon vs cpprb MPReplayBuffer and TorchRL's shared
    LazyMemmapStorage."""
    counts = ctx.worker_counts()
    seconds = 0.5 if ctx.quick else 3.0
    pool_size = 2 if ctx.quick else 4
    capacity = ctx.size(200, minimum=50) * LENGTH  # rows
    row_bytes = data.row_bytes(data.SPECS[KIND])
    fill_each = max(1, capacity // LENGTH // max(counts))
    ctx.note(
        NAME,
        f"a {capacity:,}-row buffer ({capacity * row_bytes / 1e9:.2f} GB) filled untimed by "
        f"{max(counts)} writers ({fill_each} episodes each), then per writer count one {seconds:g} "
        f"s pass: the writers insert {LENGTH}-step episodes (each cycling {pool_size} distinct "
        f"ones) while {LEARNERS} learners sample({BATCH}) as fast as they can; insert-Nw = rows "
        "the N writers inserted, sample-Nw = rows both learners sampled, each over the time "
        "from the pass's release to its side's last end; pass=steady (the buffer is full). A "
        "shmbuffer sample that raises TornReadError (its rows overwritten again through every "
        "resample: the ring turns over faster than a copy) counts 0 rows",
    )
    ctx.note(
        NAME,
        "shmbuffer-daemon: Writer.add_episode + flush at the pass's end, "
        "Reader(prefetch=4).sample (copies out of shared memory); cpprb-MPReplayBuffer: "
        "made here, add(**episode) and "
        "sample(256) in the children; torchrl-shared-LazyMemmapStorage: "
        "ReplayBuffer(LazyMemmapStorage, shared=True) in /dev/shm, extend(TensorDict) "
        "(converted before the pass) and sample(256). Children are forked from one "
        "forkserver that imported torch, shmbuffer and the peers once, with the parent's "
        "torch thread count (--threads)",
    )
    ctx.note(NAME, loads.CPU_NOTE)
    writer_plan, learner_plan = loads.plans(counts, ("count", fill_each), ("idle", 0.0), seconds)
    out: list[Row] = []
    with bench_dirs(ctx) as root:
        for impl in ctx.rotate(IMPLS):
            reason = loads.missing(impl)
            if reason:
                ctx.note(NAME, f"{impl} skipped: {reason}")
                continue
            try:
                passes = loads.run_load(
                    impl,
                    root,
                    (capacity, UNIT, data.SPECS[KIND]),
                    writer_role,
                    {"pool_size": pool_size},
                    writer_plan,
                    max(counts),
                    LEARNERS,
                    learner_plan,
                    {"batch": BATCH, "pause": 0.0, "capacity": capacity, "kind": KIND},
                )
            except Exception as exc:
                ctx.note(NAME, f"{impl} failed: {type(exc).__name__}: {exc}")
                continue
            sides = (("writers", "insert", LENGTH), ("learners", "sample", BATCH))
            out += loads.rate_rows(ctx, NAME, impl, counts, passes, sides, row_bytes, LEARNERS)
    return out
