"""Env workers and learners sharing one shmbuffer daemon.

Start a daemon first (``shmbuffer-daemon start``), then::

    python examples/rollout.py --workers 8 --learners 2 --seconds 30

Each worker runs a toy vectorised environment and writes transitions with
``Writer.add_transition``; each learner samples batches of transitions and whole episodes.
Watch the buffer fill with ``shmbuffer-daemon status --watch``; ``kill -9`` a worker and the
others (and everything already committed) carry on.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import numpy as np
import torch

import shmbuffer


def env_worker(name: str, worker: int, seconds: float, obs_dim: int) -> None:
    rng = np.random.default_rng(worker)
    end = time.monotonic() + seconds
    with shmbuffer.Writer(name) as writer:
        env_id, obs, t = f"worker{worker}", rng.standard_normal(obs_dim, dtype=np.float32), 0
        while time.monotonic() < end:
            action = int(rng.integers(4))  # stand-in for a policy
            next_obs = rng.standard_normal(obs_dim, dtype=np.float32)
            t += 1
            terminated, truncated = rng.random() < 0.01, t >= 200
            writer.add_transition(
                env_id,
                {
                    "obs": obs,
                    "action": action,
                    "reward": float(rng.random()),
                    "next_obs": next_obs,
                    "terminated": terminated,
                    "truncated": truncated,
                },
            )
            obs = next_obs
            if terminated or truncated:  # the writer committed the episode; reset
                obs, t = rng.standard_normal(obs_dim, dtype=np.float32), 0


def learner(name: str, rank: int, seconds: float) -> None:
    end, steps = time.monotonic() + seconds, 0
    with shmbuffer.Reader(name) as reader:
        while time.monotonic() < end:
            try:
                batch = reader.sample(256)  # one gather out of shared memory
                with reader.sample_episodes(4) as episodes:  # zero-copy, leased views
                    returns = [float(ep["reward"].sum()) for ep in episodes]
            except shmbuffer.errors.EmptyBufferError:
                time.sleep(0.1)
                continue
            loss = torch.nn.functional.mse_loss(batch["obs"], batch["next_obs"])  # a stand-in
            steps += 1
            if steps % 200 == 0:
                print(f"learner {rank}: step {steps}, loss {loss:.3f}, returns {returns[:2]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="default", help="the daemon's buffer name")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--learners", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--obs-dim", type=int, default=64)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=env_worker, args=(args.name, w, args.seconds, args.obs_dim))
        for w in range(args.workers)
    ] + [
        ctx.Process(target=learner, args=(args.name, r, args.seconds)) for r in range(args.learners)
    ]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=args.seconds + 30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    with shmbuffer.Reader(args.name) as reader:
        stats = reader.stats()
    print(
        f"buffer {args.name!r}: {stats['rows']:,} rows, {stats['episodes']:,} episodes stored; "
        f"{stats['rows_committed']:,} rows committed in all"
    )


if __name__ == "__main__":
    main()
