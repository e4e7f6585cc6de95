"""SAC on Pendulum-v1 through a shmbuffer daemon: env workers write transitions with float32
torques, the learner samples them uniformly and trains a tanh-squashed Gaussian actor, twin Q
critics and the entropy temperature; workers act with the actor weights it publishes.

    python examples/sac_pendulum.py --workers 2 --minutes 10

Starts a daemon of its own (uniform replay; stopped at the end) unless ``--buffer NAME`` names
a running one in transition unit (empty, or holding these columns: obs [3], action [1] float32,
reward, next_obs, terminated, truncated). Stops once the mean return over the last 20 episodes
reaches ``--target`` (-250; random play scores about -1,200 to -1,500). Pendulum never
terminates: every episode is truncated at 200 steps, so every target bootstraps. The last
line is ``final mean return (last 20 episodes): <number>``.

SAC rather than TD3: its entropy bonus explores without a noise schedule to tune, and it
reaches the target in 3,000-5,000 updates (about a minute of acting on the 2 cores) with the
defaults here, so TD3 was not tried. Where the time goes is the learner's updates, hence the
defaults: 64-unit layers (a 256-unit update costs two to three times the CPU here, and
Pendulum needs no more) and 4 env steps per update (the 20 episodes of the figure span 4,000
env steps, i.e. 1,000 updates, not 4,000; env steps are cheap next to updates).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import itertools
import math
from collections.abc import Mapping
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
from tensordict import TensorDict
from torch import nn

import shmbuffer
from shmbuffer.weights import WeightsPublisher

ENV_ID = "Pendulum-v1"
OBS_DIM, ACT_DIM = 3, 1
ACTION_SCALE = 2.0  # Pendulum's torque bounds: [-2, 2]
LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0


def mlp(n_in: int, n_out: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(n_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, n_out),
    )  # fmt: skip


class Actor(nn.Module):
    """obs -> a Gaussian over pre-squash actions; ``tanh`` of a draw, times ``ACTION_SCALE``,
    is the torque. The only network the workers need."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = mlp(OBS_DIM, 2 * ACT_DIM, hidden)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, log_std = self.net(obs).chunk(2, dim=-1)
        return mean, log_std.clamp(LOG_STD_MIN, LOG_STD_MAX)

    def sample(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A reparameterised action in ``[-1, 1]`` and its log-probability (``[B]``)."""
        mean, log_std = self(obs)
        noise = torch.randn_like(mean)
        u = mean + log_std.exp() * noise
        # log N(u) minus log |d tanh(u) / du|, the latter in the stable form
        # 2 (log 2 - u - softplus(-2u)).
        log_prob = -0.5 * noise.pow(2) - log_std - 0.5 * math.log(2 * math.pi)
        log_prob = log_prob - 2 * (math.log(2) - u - F.softplus(-2 * u))
        return torch.tanh(u), log_prob.sum(-1)


class TwinQ(nn.Module):
    """Two independent Q(obs, action) critics as one batched network: each layer's weights are
    ``[2, in, out]`` and one ``baddbmm`` computes both critics: at 64 units an update is
    bound by the number of ops, not their size (measured 5-30% less CPU per update than two
    ``nn.Sequential`` on the shared 2-core VM). Initialised as ``nn.Linear`` is."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        sizes = [OBS_DIM + ACT_DIM, hidden, hidden, 1]
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList()
        for n_in, n_out in itertools.pairwise(sizes):
            bound = 1 / math.sqrt(n_in)
            self.weights.append(nn.Parameter(torch.empty(2, n_in, n_out).uniform_(-bound, bound)))
            self.biases.append(nn.Parameter(torch.empty(2, 1, n_out).uniform_(-bound, bound)))

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        """Both critics' values, ``[2, B]``."""
        x = torch.cat([obs, action], dim=-1).expand(2, -1, -1)
        for layer, (weight, bias) in enumerate(zip(self.weights, self.biases, strict=True)):
            x = torch.baddbmm(bias, x, weight)
            if layer < len(self.weights) - 1:
                x = torch.relu(x)
        return x.squeeze(-1)


@dataclass(frozen=True)
class SquashedGaussian:
    """The workers' act function: uniform torques for the first ``random_steps`` env steps
    (SAC's warm-up: varied data before the first update), then a draw from the actor."""

    random_steps: int

    def __call__(
        self, net: nn.Module, obs: np.ndarray, rng: np.random.Generator, env_steps: int
    ) -> tuple[np.ndarray, Mapping[str, np.ndarray]]:
        if env_steps < self.random_steps:
            squashed = rng.uniform(-1.0, 1.0, (len(obs), ACT_DIM))
        else:
            mean, log_std = net(torch.from_numpy(obs))
            noise = rng.standard_normal((len(obs), ACT_DIM))
            squashed = np.tanh(mean.numpy() + np.exp(log_std.numpy()) * noise)
        return (ACTION_SCALE * squashed).astype(np.float32), {}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(parser, target=-250.0)
    parser.add_argument("--capacity", type=int, default=100_000, help="rows (own daemon)")
    parser.add_argument("--hidden", type=int, default=64, help="units per hidden layer")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3, help="actor, critics and alpha")
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--tau", type=float, default=0.005, help="target critics' Polyak step")
    parser.add_argument("--learning-starts", type=int, default=1_000, help="env steps")
    parser.add_argument(
        "--env-steps-per-update", type=float, default=4.0, help="the replay ratio's inverse"
    )
    parser.add_argument("--publish-every", type=int, default=10, help="updates between weights")
    return parser.parse_args()


class SAC:
    """The learner's networks, optimisers and one update (Haarnoja et al., 2018, with the
    temperature tuned towards an entropy of ``-ACT_DIM``)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.gamma, self.tau = args.gamma, args.tau
        self.actor = Actor(args.hidden)
        self.critic = TwinQ(args.hidden)
        self.target = copy.deepcopy(self.critic).requires_grad_(False)
        self.log_alpha = torch.zeros((), requires_grad=True)
        self.target_entropy = -float(ACT_DIM)
        # fused: one kernel per step instead of a loop over the tensors (a tenth less CPU).
        self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=args.lr, fused=True)
        self.critic_opt = torch.optim.Adam(self.critic.parameters(), lr=args.lr, fused=True)
        self.alpha_opt = torch.optim.Adam([self.log_alpha], lr=args.lr)

    @property
    def alpha(self) -> float:
        return float(self.log_alpha.detach().exp())

    def update(self, batch: TensorDict) -> None:
        obs, next_obs = batch["obs"], batch["next_obs"]
        action = batch["action"] / ACTION_SCALE  # back into the actor's [-1, 1]
        reward = batch["reward"].float()
        not_terminal = (~batch["terminated"]).float()  # truncation (200 steps) bootstraps
        alpha = self.log_alpha.exp().detach()
        with torch.no_grad():
            next_action, next_logp = self.actor.sample(next_obs)
            next_q = self.target(next_obs, next_action).min(0).values - alpha * next_logp
            y = reward + self.gamma * not_terminal * next_q
        critic_loss = (self.critic(obs, action) - y).pow(2).mean(1).sum()  # each critic's MSE
        self.critic_opt.zero_grad(set_to_none=True)
        critic_loss.backward()
        self.critic_opt.step()

        # The actor's gradient flows through the critics, not into their weights.
        self.critic.requires_grad_(False)
        new_action, logp = self.actor.sample(obs)
        actor_loss = (alpha * logp - self.critic(obs, new_action).min(0).values).mean()
        self.actor_opt.zero_grad(set_to_none=True)
        actor_loss.backward()
        self.actor_opt.step()
        self.critic.requires_grad_(True)

        alpha_loss = -(self.log_alpha * (logp.detach() + self.target_entropy)).mean()
        self.alpha_opt.zero_grad(set_to_none=True)
        alpha_loss.backward()
        self.alpha_opt.step()

        with torch.no_grad():
            pairs = zip(self.target.parameters(), self.critic.parameters(), strict=True)
            for target, online in pairs:
                target.lerp_(online, self.tau)


def train(args: argparse.Namespace, daemon: Daemon) -> None:
    buffer = daemon.name
    torch.manual_seed(args.seed)
    sac = SAC(args)
    with WeightsPublisher(weights_name(buffer), sac.actor) as weights:
        rollout = Rollout(
            args.workers,
            WorkerConfig(
                buffer=buffer,
                weights=weights.name,
                env_id=ENV_ID,
                policy=functools.partial(Actor, args.hidden),
                act=SquashedGaussian(random_steps=args.learning_starts),
                num_envs=args.envs_per_worker,
                seed=args.seed,
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
                    status=lambda n: f"updates {n:,} | alpha {sac.alpha:.3f}",
                ):
                    sac.update(reader.sample(args.batch_size))
                    if updates % args.publish_every == 0:
                        weights.publish(sac.actor)
        finally:
            rollout.stop()
            progress.finish()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # small batches: intra-op threads cost more than they give
    # On Ctrl-C train() stops the workers and prints its figures; our daemon stops after.
    if args.buffer:
        with contextlib.suppress(KeyboardInterrupt):
            train(args, Daemon(args.buffer))
        return
    sampler = ["--sampler", "uniform"]
    name = unique_name("pendulum-sac")
    with Daemon.own(name, args.capacity, "transition", sampler) as daemon:
        print(f"daemon {daemon.name!r}: {args.capacity:,} rows, uniform replay", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            train(args, daemon)


if __name__ == "__main__":
    main()
