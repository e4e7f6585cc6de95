"""PPO on CartPole-v1 through a shmbuffer daemon: env workers act with the current policy and
write fixed-length rollouts, the learner consumes each rollout exactly once, trains on it for a
few epochs and publishes the new weights; workers wait for them before acting again.

    python examples/ppo_cartpole.py --workers 2 --minutes 10

Starts a daemon of its own (episode unit, FIFO consume-once; stopped at the end) unless
``--buffer NAME`` names a running one in episode unit (empty, or holding this example's
columns). Stops once the mean return over the last 20 episodes reaches ``--target`` (475,
CartPole-v1's threshold). The last line is ``final mean return (last 20 episodes): <number>``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from common import (
    Daemon,
    Progress,
    Rollout,
    WorkerConfig,
    common_args,
    unique_name,
    weights_name,
)
from tensordict import TensorDict
from torch import nn

import shmbuffer
from shmbuffer.errors import EmptyBufferError, WaitTimeoutError
from shmbuffer.weights import WeightsPublisher

ENV_ID = "CartPole-v1"

#: Seconds the learner waits for one version's rollouts before training on what it has (a
#: worker that died or stalls must not stop the run).
COLLECT_TIMEOUT_S = 30.0


class ActorCritic(nn.Module):
    """PPO's policy and value function, apart (shared layers slow CartPole down), with the
    orthogonal initialisation of the PPO implementation-details study (Huang et al., 2022)."""

    def __init__(self) -> None:
        super().__init__()

        def layer(n_in: int, n_out: int, std: float = math.sqrt(2)) -> nn.Linear:
            lin = nn.Linear(n_in, n_out)
            nn.init.orthogonal_(lin.weight, std)
            nn.init.zeros_(lin.bias)
            return lin

        self.actor = nn.Sequential(
            layer(4, 64), nn.Tanh(), layer(64, 64), nn.Tanh(), layer(64, 2, std=0.01)
        )
        self.critic = nn.Sequential(
            layer(4, 64), nn.Tanh(), layer(64, 64), nn.Tanh(), layer(64, 1, std=1.0)
        )

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        values: torch.Tensor = self.critic(obs)
        return values.squeeze(-1)


def sample_action(
    net: nn.Module, obs: np.ndarray, rng: np.random.Generator, env_steps: int
) -> tuple[np.ndarray, Mapping[str, np.ndarray]]:
    """The workers' act function: an action drawn from the policy, and its log-probability
    (the ``logp`` column, PPO's ratio denominator)."""
    assert isinstance(net, ActorCritic)
    log_probs = torch.log_softmax(net.actor(torch.from_numpy(obs)), dim=1).numpy()
    u = rng.random(len(obs))
    actions = (u[:, None] > np.exp(log_probs).cumsum(1)[:, :-1]).sum(1)
    logp = log_probs[np.arange(len(obs)), actions]
    return actions.astype(np.int64), {"logp": np.asarray(logp, np.float32)}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(parser, target=475.0)
    parser.add_argument("--rollout-len", type=int, default=128, help="steps per env per update")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--minibatches", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2.5e-4)
    parser.add_argument("--anneal-steps", type=int, default=500_000, help="lr decays to 0 here")
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--gae-lambda", type=float, default=0.95)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--ent-coef", type=float, default=0.01)
    parser.add_argument("--vf-coef", type=float, default=0.5)
    return parser.parse_args()


def collect(
    reader: shmbuffer.Reader, version: int, expected: int, progress: Progress
) -> list[TensorDict]:
    """The ``expected`` rollout entries acted with policy ``version``, each taken once."""
    got: list[TensorDict] = []
    deadline = time.monotonic() + COLLECT_TIMEOUT_S
    while len(got) < expected and time.monotonic() < deadline:
        progress.update()
        try:
            # The daemon's FIFO hands each entry out once, oldest first, and waits in the
            # daemon while there is none.
            with reader.sample_episodes(expected - len(got)) as entries:
                got += [entry.clone() for entry in entries]
        except (EmptyBufferError, WaitTimeoutError):
            pass
        if len(got) < expected:
            time.sleep(0.005)  # the workers are still stepping: leave them the CPU
    return [entry for entry in got if int(entry["policy_version"][0]) == version]


def advantages(
    net: ActorCritic, batch: TensorDict, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over ``[entries, T]``: an entry's last step bootstraps from V(next_obs) unless it
    terminated; a truncated step (500 steps) bootstraps from its final observation."""
    with torch.no_grad():
        values = net.value(batch["obs"])
        next_values = net.value(batch["next_obs"])
    reward = batch["reward"].float()
    not_terminal = (~batch["terminated"]).float()
    not_done = (~(batch["terminated"] | batch["truncated"])).float()
    delta = reward + gamma * next_values * not_terminal - values
    adv = torch.zeros_like(delta)
    last = torch.zeros(delta.shape[0])
    for t in reversed(range(delta.shape[1])):
        last = delta[:, t] + gamma * lam * not_done[:, t] * last
        adv[:, t] = last
    return adv, adv + values


def ppo_update(
    args: argparse.Namespace,
    net: ActorCritic,
    opt: torch.optim.Optimizer,
    batch: TensorDict,
) -> dict[str, float]:
    adv, returns = advantages(net, batch, args.gamma, args.gae_lambda)
    obs, action = batch["obs"].reshape(-1, 4), batch["action"].reshape(-1).long()
    old_logp = batch["logp"].reshape(-1).float()
    adv, returns = adv.reshape(-1), returns.reshape(-1)
    n = obs.shape[0]
    size = max(1, n // args.minibatches)
    stats: dict[str, Any] = {}
    for _ in range(args.epochs):
        for idx in torch.split(torch.randperm(n), size):
            logits = net.actor(obs[idx])
            logp_all = torch.log_softmax(logits, dim=1)
            logp = logp_all.gather(1, action[idx, None]).squeeze(1)
            entropy = -(logp_all.exp() * logp_all).sum(1).mean()
            ratio = (logp - old_logp[idx]).exp()
            a = adv[idx]
            a = (a - a.mean()) / (a.std() + 1e-8)
            policy_loss = -torch.min(
                ratio * a, ratio.clamp(1 - args.clip, 1 + args.clip) * a
            ).mean()
            value_loss = 0.5 * (net.value(obs[idx]) - returns[idx]).pow(2).mean()
            loss = policy_loss + args.vf_coef * value_loss - args.ent_coef * entropy
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
            opt.step()
            stats = {"value_loss": value_loss.item(), "entropy": entropy.item()}
    return stats


def train(args: argparse.Namespace, daemon: Daemon) -> None:
    buffer = daemon.name
    torch.manual_seed(args.seed)
    net = ActorCritic()
    opt = torch.optim.Adam(net.parameters(), lr=args.lr, eps=1e-5)
    expected = args.workers * args.envs_per_worker  # entries per policy version
    with WeightsPublisher(weights_name(buffer), net) as weights:
        rollout = Rollout(
            args.workers,
            WorkerConfig(
                buffer=buffer,
                weights=weights.name,
                env_id=ENV_ID,
                policy=ActorCritic,
                act=sample_action,
                num_envs=args.envs_per_worker,
                seed=args.seed,
                rollout_len=args.rollout_len,
            ),
        )
        progress = Progress(rollout, args.curve)
        deadline = progress.began + args.minutes * 60
        rollout.start()
        stats: dict[str, float] = {}
        try:
            daemon.wait_ready()
            with shmbuffer.Reader(buffer, timeout=30.0) as reader:
                if reader.unit != "episode":
                    raise SystemExit(
                        f"buffer {buffer!r} is in {reader.unit} unit; PPO needs episode"
                    )
                while time.monotonic() < deadline and not progress.reached(args.target):
                    version = weights.version
                    entries = collect(reader, version, expected, progress)
                    progress.samples += sum(int(e.batch_size[0]) for e in entries)
                    if not entries:
                        continue
                    length = min(int(e.batch_size[0]) for e in entries)
                    batch = torch.stack([e[:length] for e in entries])  # [entries, T]
                    frac = max(0.0, 1.0 - rollout.env_steps / args.anneal_steps)
                    for group in opt.param_groups:
                        group["lr"] = args.lr * frac
                    stats = ppo_update(args, net, opt, batch)
                    weights.publish(net)  # the workers wait for this version
                    progress.maybe_print(
                        f"version {version:,} | value loss {stats['value_loss']:7.2f} | "
                        f"entropy {stats['entropy']:.3f}"
                    )
                    progress.update()
        finally:
            rollout.stop()
            progress.finish()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # small minibatches: intra-op threads cost more than they give
    # On Ctrl-C train() stops the workers and prints its figures; our daemon stops after.
    if args.buffer:
        with contextlib.suppress(KeyboardInterrupt):
            train(args, Daemon(args.buffer))
        return
    # Two versions' worth of rows: the entries being consumed and the next ones.
    capacity = 2 * args.workers * args.envs_per_worker * args.rollout_len
    sampler = ["--sampler", "fifo", "--max-times-sampled", "1"]
    queue = "FIFO consume-once"
    with Daemon.own(unique_name("cartpole-ppo"), capacity, "episode", sampler) as daemon:
        print(f"daemon {daemon.name!r}: {capacity:,} rows, episode unit, {queue}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            train(args, daemon)


if __name__ == "__main__":
    main()
