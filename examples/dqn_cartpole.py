"""DQN on CartPole-v1 through a shmbuffer daemon: env workers write transitions, the learner
samples them (prioritized replay; ``--uniform`` for uniform), workers act epsilon-greedily
with the weights the learner publishes.

    python examples/dqn_cartpole.py --workers 2 --minutes 10
    python examples/dqn_cartpole.py --workers 2 --minutes 10 --n-step 3

``--n-step N`` bootstraps from N steps on: the reader's sample carries each row's discounted
return over the next N steps of its episode, the observation there and its discount, computed
from the rows in shared memory (docs/sampling.md); the target is
``n_step_return + discount * Q_target(next_obs)`` for every N, 1 included.

Starts a daemon of its own (and stops it at the end) unless ``--buffer NAME`` names a running
one (empty, or holding these columns: obs, action, reward, next_obs, terminated, truncated).
Stops once the mean return over the last 20 episodes reaches ``--target`` (195, CartPole-v0's
"solved"). The last line is ``final mean return (last 20 episodes): <number>``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from common import (
    Daemon,
    Progress,
    Rollout,
    WorkerConfig,
    common_args,
    replay_updates,
    unique_name,
    weights_name,
)
from torch import nn

import shmbuffer
from shmbuffer.weights import WeightsPublisher

ENV_ID = "CartPole-v1"


def q_network() -> nn.Module:
    """DQN's Q-function: obs [B, 4] -> Q-values [B, 2]."""
    return nn.Sequential(
        nn.Linear(4, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 2)
    )


def epsilon_at(steps: int, start: float, end: float, decay_steps: int) -> float:
    """Linear decay from ``start`` to ``end`` over the first ``decay_steps`` env steps of all
    workers together."""
    return end + (start - end) * max(0.0, 1.0 - steps / max(1, decay_steps))


@dataclass(frozen=True)
class EpsilonGreedy:
    """The workers' act function: greedy in Q, random with probability epsilon."""

    start: float = 1.0
    end: float = 0.05
    decay_steps: int = 5_000

    def __call__(
        self, net: nn.Module, obs: np.ndarray, rng: np.random.Generator, env_steps: int
    ) -> tuple[np.ndarray, Mapping[str, np.ndarray]]:
        eps = epsilon_at(env_steps, self.start, self.end, self.decay_steps)
        greedy = net(torch.from_numpy(obs)).argmax(1).numpy()
        explore = rng.random(len(obs)) < eps
        return np.where(explore, rng.integers(0, 2, len(obs)), greedy), {}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(parser, target=195.0)
    parser.add_argument("--uniform", action="store_true", help="uniform instead of prioritized")
    parser.add_argument("--capacity", type=int, default=50_000, help="rows (own daemon)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--n-step", type=int, default=1, help="steps of the return (>= 1)")
    parser.add_argument("--target-update", type=int, default=500, help="updates between syncs")
    parser.add_argument("--learning-starts", type=int, default=1_000, help="env steps")
    parser.add_argument(
        "--env-steps-per-update", type=float, default=2.0, help="the replay ratio's inverse"
    )
    parser.add_argument("--publish-every", type=int, default=10, help="updates between weights")
    parser.add_argument("--eps-decay-steps", type=int, default=5_000)
    return parser.parse_args()


def train(
    args: argparse.Namespace,
    daemon: Daemon,
    prioritized: bool,
    worker_meta: bool = False,
    after_workers: Callable[[], None] | None = None,
) -> None:
    """Train until ``args.target`` or ``args.minutes``; ``worker_meta``: workers attach each
    episode's return, policy version and env to it (docs/metadata.md); ``after_workers``:
    called once the workers stopped, before the figures are printed."""
    buffer = daemon.name
    torch.manual_seed(args.seed)
    q = q_network()
    target = copy.deepcopy(q)
    opt = torch.optim.Adam(q.parameters(), lr=args.lr)
    with WeightsPublisher(weights_name(buffer), q) as weights:
        rollout = Rollout(
            args.workers,
            WorkerConfig(
                buffer=buffer,
                weights=weights.name,
                env_id=ENV_ID,
                policy=q_network,
                act=EpsilonGreedy(1.0, 0.05, args.eps_decay_steps),
                num_envs=args.envs_per_worker,
                seed=args.seed,
                meta=worker_meta,
            ),
        )
        progress = Progress(rollout, args.curve)
        deadline = progress.began + args.minutes * 60
        rollout.set_budget(args.learning_starts)
        rollout.start()
        try:
            daemon.wait_ready()
            with shmbuffer.Reader(buffer, timeout=30.0) as reader:
                for updates in replay_updates(
                    reader,
                    progress,
                    deadline=deadline,
                    target=args.target,
                    batch_size=args.batch_size,
                    learning_starts=args.learning_starts,
                    env_steps_per_update=args.env_steps_per_update,
                ):
                    update(args, reader, q, target, opt, prioritized)
                    if updates % args.target_update == 0:
                        target.load_state_dict(q.state_dict())
                    if updates % args.publish_every == 0:
                        weights.publish(q)
        finally:
            rollout.stop()
            if after_workers is not None:
                after_workers()
            progress.finish()


def update(
    args: argparse.Namespace,
    reader: shmbuffer.Reader,
    q: torch.nn.Module,
    target: torch.nn.Module,
    opt: torch.optim.Optimizer,
    prioritized: bool,
) -> None:
    """One double-DQN step with the Huber loss on the n-step target; with prioritized replay,
    importance weights on the loss and the new |TD errors| back to the daemon's sum tree."""
    # next_obs comes back as the observation n steps on; discount is gamma**m, 0 where the
    # episode terminated within them (a truncation at 500 steps still bootstraps)
    n_step = {"n_step": args.n_step, "gamma": args.gamma, "n_step_keys": {"next_obs": "next_obs"}}
    if prioritized:  # TODO: the only path (uniform's return_info has weight 1)
        batch, info = reader.sample(args.batch_size, return_info=True, **n_step)  # type: ignore[call-arg]
        weight = info["weight"].float()
    else:
        batch, info, weight = reader.sample(args.batch_size, **n_step), None, None
    obs, next_obs, action = batch["obs"], batch["next_obs"], batch["action"].long()
    with torch.no_grad():
        best = q(next_obs).argmax(1, keepdim=True)
        bootstrap = target(next_obs).gather(1, best).squeeze(1)
        y = batch["n_step_return"].float() + batch["discount"].float() * bootstrap
    pred = q(obs).gather(1, action[:, None]).squeeze(1)
    loss = F.smooth_l1_loss(pred, y, reduction="none")
    loss = (loss * weight).mean() if weight is not None else loss.mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(q.parameters(), 10.0)
    opt.step()
    if info is not None:
        priority = (pred.detach() - y).abs() + 1e-3
        reader.update_priorities(  # type: ignore[attr-defined]
            info["index"], priority, generation=info["generation"]
        )


def main() -> None:
    args = parse_args()
    if args.n_step < 1:
        raise SystemExit(f"--n-step must be >= 1, got {args.n_step}")
    torch.set_num_threads(1)  # small batches: intra-op threads cost more than they give
    prioritized = not args.uniform
    # On Ctrl-C train() stops the workers and prints its figures; our daemon stops after.
    if args.buffer:
        with contextlib.suppress(KeyboardInterrupt):
            train(args, Daemon(args.buffer), prioritized)
        return
    sampler = ["--sampler", "prioritized"] if prioritized else []
    replay = "prioritized" if prioritized else "uniform"
    with Daemon.own(unique_name("cartpole-dqn"), args.capacity, "transition", sampler) as daemon:
        returns = f", {args.n_step}-step returns" if args.n_step > 1 else ""
        print(
            f"daemon {daemon.name!r}: {args.capacity:,} rows, {replay} replay{returns}",
            flush=True,
        )
        with contextlib.suppress(KeyboardInterrupt):
            train(args, daemon, prioritized)


if __name__ == "__main__":
    main()
