"""Rollout scenario: an end-to-end collection loop. N worker processes step a cheap numpy
environment and write each finished episode; one learner process samples batches, with a
pause standing for its (GPU) update. Env steps per second and learner rows sampled per second,
and the CPU all of an implementation's processes spent per million of them (:mod:`bench.cpu`).

The same loop is built on each implementation (:mod:`bench.loads`), one after another (the
order rotates with the repetition): shmbuffer through a daemon (``Writer.extend`` of the
episode, ``Reader(prefetch=4).sample``); a ``multiprocessing.Queue`` of episodes (pickled)
drained by the learner into its own ring, sampled with ``np.take``; cpprb's
``MPReplayBuffer``; TorchRL's ``ReplayBuffer`` over a shared ``LazyMemmapStorage`` (each
episode converted to a TensorDict, inside the loop: it is part of that buffer's write path).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from bench import data, loads
from bench.harness import Body, bench_dirs
from bench.registry import Context, Row, scenario

NAME = "rollout"
IMPLS = [loads.SHM, loads.QUEUE, loads.CPPRB, loads.TORCHRL]
KIND, UNIT = "small", "transition"  # obs f32[64], action i64, reward f32, done bool
LENGTH = 100  # steps per episode
BATCH = 256
PAUSE = 0.002  # s the learner sleeps per batch: its update, on a GPU, not on these CPUs
WARM = 4  # episodes each worker writes before the timed passes (the learner needs data)
ACTIONS = 18


class ToyEnv:
    """A cheap deterministic environment: a 64-float observation that decays, drifts with the
    action and picks up tabulated noise; reward is minus its mean magnitude; an episode ends
    after ``length`` steps."""

    def __init__(self, seed: int, length: int = LENGTH) -> None:
        rng = np.random.default_rng(seed)
        self.noise = rng.standard_normal((256, 64), dtype=np.float32) * 0.1
        self.drift = rng.standard_normal((ACTIONS, 64), dtype=np.float32) * 0.01
        self.length = length
        self.t = 0
        self.obs = np.zeros(64, np.float32)

    def reset(self) -> np.ndarray:
        self.t = 0
        self.obs = np.zeros(64, np.float32)
        return self.obs

    def step(self, action: int) -> tuple[np.ndarray, float, bool]:
        self.t += 1
        self.obs = self.obs * 0.99 + self.drift[action] + self.noise[self.t % 256]
        return self.obs, -float(np.abs(self.obs).mean()), self.t >= self.length


def run_episode(env: ToyEnv, wid: int) -> data.Batch:
    """One episode of ``env`` under a fixed cyclic policy, as fresh numpy columns."""
    ep = {k: np.empty((env.length, *shape), dt) for k, (shape, dt) in data.SPECS[KIND].items()}
    obs = env.reset()
    for t in range(env.length):
        action = (7 * t + wid) % ACTIONS  # a policy costs nothing here: the buffer is timed
        nxt, reward, done = env.step(action)
        ep["obs"][t] = obs
        ep["action"][t] = action
        ep["reward"][t] = reward
        ep["done"][t] = done
        obs = nxt
    return ep


@contextmanager
def worker_role(impl: str, handle: Any, wid: int, plan: loads.Plan, threads: int) -> Iterator[Body]:
    """Steps its own :class:`ToyEnv` and writes each episode as it ends."""
    loads.torch_threads(threads)
    env = ToyEnv(seed=wid)
    with loads.sink(impl, handle, UNIT) as out:

        def op(_: int) -> int:
            out.write(out.convert(run_episode(env, wid)))
            return env.length

        yield loads.looping(op, plan, out.finish)


@scenario(NAME)
def rollout(ctx: Context) -> list[Row]:
    """1, 2 and 4 worker processes (--workers) stepping a numpy toy env (obs f32[64]), writing
    each 100-step episode, one learner sample(256) + 2 ms update, 3 s: env steps/s, learner
    rows/s and CPU per row; shmbuffer through a daemon vs a multiprocessing.Queue, cpprb MP,
    TorchRL shared."""
    counts = ctx.worker_counts()
    seconds = 0.5 if ctx.quick else 3.0
    capacity = ctx.size(200_000, minimum=20_000)
    row_bytes = data.row_bytes(data.SPECS[KIND])
    workers = max(counts)
    ctx.note(
        NAME,
        f"{workers} worker processes (the ones past a pass's count idle), each stepping its own "
        f"toy env ({LENGTH}-step episodes, a cyclic policy) and writing each finished episode; "
        f"1 learner: sample({BATCH}) then sleep {PAUSE * 1e3:g} ms (its update, off the CPU); "
        f"a {capacity:,}-row buffer, {WARM} warm-up episodes per worker first (untimed); per "
        f"worker count one {seconds:g} s pass. env-steps-Nw = steps the N workers took, "
        "learner-samples-Nw = rows the learner sampled, each over the time from the pass's "
        "release to its side's last end",
    )
    ctx.note(
        NAME,
        f"mp.Queue: a Queue({loads.QUEUE_EPISODES}) of episodes (pickled by each worker's "
        "feeder thread; a full queue blocks the worker); the learner takes everything queued "
        "before each batch, copies it into its own ring and samples it with np.take. "
        "shmbuffer-daemon: Writer.extend(episode), flushed at the pass's end; "
        "Reader(prefetch=4).sample. "
        "torchrl-shared-LazyMemmapStorage: TensorDict per episode, rb.extend, rb.sample. "
        "Children are forked from one forkserver that imported torch, shmbuffer and the "
        "peers once, with the parent's torch thread count (--threads)",
    )
    ctx.note(NAME, loads.CPU_NOTE)
    writer_plan, learner_plan = loads.plans(counts, ("count", WARM), ("idle", 0.0), seconds)
    out: list[Row] = []
    with bench_dirs(ctx) as root:
        for impl in ctx.rotate(IMPLS):
            reason = loads.missing(impl)
            if reason:
                ctx.note(NAME, f"{impl} skipped: {reason}")
                continue
            # The Queue's learner must take the warm-up episodes off the queue itself.
            first = ("drain", float(WARM * workers)) if impl == loads.QUEUE else ("idle", 0.0)
            try:
                passes = loads.run_load(
                    impl,
                    root,
                    (capacity, UNIT, data.SPECS[KIND]),
                    worker_role,
                    {},
                    writer_plan,
                    workers,
                    1,
                    [first, *learner_plan[1:]],
                    {"batch": BATCH, "pause": PAUSE, "capacity": capacity, "kind": KIND},
                )
            except Exception as exc:
                ctx.note(NAME, f"{impl} failed: {type(exc).__name__}: {exc}")
                continue
            sides = (("writers", "env-steps", LENGTH), ("learners", "learner-samples", BATCH))
            out += loads.rate_rows(ctx, NAME, impl, counts, passes, sides, row_bytes, 1)
    return out
