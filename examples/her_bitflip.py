"""DQN with hindsight experience replay on the bit-flipping task of the HER paper
(Andrychowicz et al. 2017), through a shmbuffer daemon: env workers write whole episodes, the
learner samples with ``her=`` and the daemon's rows are relabelled at sample time.

    python examples/her_bitflip.py --bits 10 --workers 2 --minutes 10
    python examples/her_bitflip.py --bits 10 --no-her        # the same without relabelling

The environment is written here: a state of ``n`` bits and a goal of ``n`` bits, both
random; action ``i`` flips bit ``i``; the reward is -1 until the state equals the goal (0 on
the step that reaches it, which ends the episode), and an episode is cut after ``n`` steps.
Random play almost never reaches a goal at ``n = 10``, so without relabelling the learner
sees no reward but -1 and learns nothing; with ``future`` relabelling every episode teaches
how to reach the states it did reach.

Each worker steps ``--envs-per-worker`` envs at once (numpy), acts epsilon-greedily with the
weights the learner publishes (its last env greedily: those episodes are the success rate),
and writes each finished episode with ``Writer.add_episode``. The learner keeps the ratio of
env steps to updates fixed (a budget in a shared integer) and stops once the greedy success
rate over the last 100 episodes reaches ``--target``. The last line is
``final success rate (last 100 greedy episodes): <number>``.
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing as mp
import queue
import time
from collections import deque

import numpy as np
import torch
import torch.nn.functional as F
from common import Daemon, _connect_writer, unique_name, weights_name
from torch import nn

import shmbuffer
from shmbuffer.weights import WeightsPublisher, WeightsSubscriber

LAST_N = 100


def q_network(bits: int) -> nn.Module:
    """Q(state, goal) -> one value per bit to flip."""
    return nn.Sequential(nn.Linear(2 * bits, 256), nn.ReLU(), nn.Linear(256, bits))


def goal_reward(achieved: torch.Tensor, desired: torch.Tensor) -> torch.Tensor:
    """The task's reward, vectorised: 0 where every bit agrees, else -1 (what ``her=`` calls)."""
    return -(achieved != desired).any(dim=-1).to(torch.float32)


class BitFlip:
    """``envs`` bit-flipping tasks of ``bits`` bits, stepped together."""

    def __init__(self, envs: int, bits: int, rng: np.random.Generator) -> None:
        self.bits, self.rng = bits, rng
        self.state = np.zeros((envs, bits), np.float32)
        self.goal = np.zeros((envs, bits), np.float32)
        self.steps = np.zeros(envs, np.int64)
        self.reset(np.arange(envs))

    def reset(self, which: np.ndarray) -> None:
        for i in which:  # a goal the start state does not already meet
            self.state[i] = self.rng.integers(0, 2, self.bits)
            self.goal[i] = self.state[i]
            while (self.goal[i] == self.state[i]).all():
                self.goal[i] = self.rng.integers(0, 2, self.bits)
        self.steps[which] = 0

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Flip; returns (reward, terminated, truncated) per env."""
        rows = np.arange(len(actions))
        self.state[rows, actions] = 1.0 - self.state[rows, actions]
        self.steps += 1
        reached = (self.state == self.goal).all(axis=1)
        return reached - 1.0, reached, ~reached & (self.steps >= self.bits)


def worker(index: int, args: argparse.Namespace, weights: str, shared: dict) -> None:
    """One env-worker process: step, act, write finished episodes, report greedy ones."""
    torch.set_num_threads(1)
    rng = np.random.default_rng(args.seed * 1000 + index)
    net = q_network(args.bits)
    env = BitFlip(args.envs_per_worker, args.bits, rng)
    steps: list[list[dict[str, np.ndarray]]] = [[] for _ in range(args.envs_per_worker)]
    with (
        _connect_writer(args.buffer_name) as writer,
        WeightsSubscriber(weights, timeout=60.0) as subscriber,
    ):
        while not subscriber.poll(net):
            time.sleep(0.01)
        while not shared["stop"].is_set():
            if shared["env_steps"].value >= shared["budget"].value:
                time.sleep(0.002)
                continue
            subscriber.poll(net)
            obs, goal = env.state.copy(), env.goal.copy()
            with torch.no_grad():
                q = net(torch.from_numpy(np.concatenate([obs, goal], axis=1)))
            actions = q.argmax(dim=1).numpy()
            explore = rng.random(len(actions)) < args.epsilon
            explore[-1] = False  # the last env acts greedily: the success rate
            actions[explore] = rng.integers(0, args.bits, int(explore.sum()))
            reward, terminated, truncated = env.step(actions)
            with shared["env_steps"].get_lock():
                shared["env_steps"].value += len(actions)
            for i in range(len(actions)):
                steps[i].append(
                    {
                        "obs": obs[i], "desired_goal": goal[i], "action": actions[i],
                        "reward": np.float32(reward[i]), "terminated": terminated[i],
                        "truncated": truncated[i], "next_obs": env.state[i].copy(),
                    }
                )  # fmt: skip
            for i in np.flatnonzero(terminated | truncated):
                writer.add_episode(_episode(steps[i]))
                steps[i] = []
                if i == len(actions) - 1:
                    shared["greedy"].put(bool(terminated[i]))
            env.reset(np.flatnonzero(terminated | truncated))


def _episode(steps: list[dict[str, np.ndarray]]) -> dict[str, object]:
    """One episode's columns; the goal achieved after a step is its next state."""
    col = {key: np.stack([s[key] for s in steps]) for key in steps[0]}
    nxt = col.pop("next_obs")
    return {
        **col,
        "next": {"obs": nxt, "achieved_goal": nxt, "desired_goal": col["desired_goal"]},
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bits", type=int, default=10)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--envs-per-worker", type=int, default=16)
    parser.add_argument("--minutes", type=float, default=10.0, help="time limit")
    parser.add_argument("--target", type=float, default=0.9, help="greedy success rate")
    parser.add_argument("--no-her", action="store_true", help="sample without relabelling")
    parser.add_argument("--strategy", default="future", choices=["future", "final", "episode"])
    parser.add_argument("--k", type=int, default=4, help="relabelled share k / (k + 1)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--env-steps-per-update", type=float, default=2.0)
    parser.add_argument("--learning-starts", type=int, default=1_000, help="env steps")
    parser.add_argument("--epsilon", type=float, default=0.2)
    parser.add_argument("--gamma", type=float, default=0.98)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--target-update", type=int, default=200, help="updates between")
    parser.add_argument("--capacity", type=int, default=200_000)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def update(args: argparse.Namespace, reader: shmbuffer.Reader, q: nn.Module, target: nn.Module,
           opt: torch.optim.Optimizer) -> None:  # fmt: skip
    her = (
        None if args.no_her else {"strategy": args.strategy, "k": args.k, "reward_fn": goal_reward}
    )
    batch = reader.sample(args.batch_size, her=her)
    obs = torch.cat([batch["obs"], batch["desired_goal"]], dim=1)
    nxt = torch.cat([batch["next", "obs"], batch["next", "desired_goal"]], dim=1)
    reward = batch["reward"]
    # a relabelled step that reaches its new goal ends the task, whatever was stored
    done = batch["terminated"] | (reward == 0)
    with torch.no_grad():
        value = target(nxt).max(dim=1).values
        # Q is in [-1 / (1 - gamma), 0]: clipping the target keeps early estimates sane
        goal = (reward + args.gamma * value * (~done)).clamp(-1 / (1 - args.gamma), 0)
    chosen = q(obs).gather(1, batch["action"].long().unsqueeze(1)).squeeze(1)
    loss = F.smooth_l1_loss(chosen, goal)
    opt.zero_grad()
    loss.backward()
    opt.step()


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    args.buffer_name = unique_name("her-bitflip")
    ctx = mp.get_context("spawn")
    shared = {
        "stop": ctx.Event(), "greedy": ctx.Queue(),
        "env_steps": ctx.Value("q", 0), "budget": ctx.Value("q", args.learning_starts),
    }  # fmt: skip
    q = q_network(args.bits)
    target = copy.deepcopy(q)
    opt = torch.optim.Adam(q.parameters(), lr=args.lr)
    began = time.monotonic()
    successes: deque[bool] = deque(maxlen=LAST_N)
    updates, episodes, shown = 0, 0, began
    mode = "without HER" if args.no_her else f"HER {args.strategy}, k={args.k}"
    print(f"bit flipping, {args.bits} bits, {mode}, {args.workers} workers", flush=True)
    with (
        Daemon.own(args.buffer_name, args.capacity, "transition") as daemon,
        WeightsPublisher(weights_name(args.buffer_name), q) as weights,
    ):
        procs = [
            ctx.Process(target=worker, args=(i, args, weights.name, shared), daemon=True)
            for i in range(args.workers)
        ]
        for p in procs:
            p.start()
        try:
            daemon.wait_ready()
            with shmbuffer.Reader(args.buffer_name, timeout=30.0) as reader:
                while time.monotonic() < began + args.minutes * 60:
                    while True:
                        try:
                            successes.append(shared["greedy"].get_nowait())
                            episodes += 1
                        except queue.Empty:
                            break
                    if len(successes) == LAST_N and np.mean(successes) >= args.target:
                        break
                    if any(p.exitcode not in (None, 0) for p in procs):
                        raise RuntimeError("an env worker died")
                    steps = shared["env_steps"].value
                    if steps < args.learning_starts or len(reader) < args.batch_size:
                        time.sleep(0.05)
                        continue
                    update(args, reader, q, target, opt)
                    updates += 1
                    shared["budget"].value = args.learning_starts + int(
                        updates * args.env_steps_per_update
                    )
                    if updates % args.target_update == 0:
                        target.load_state_dict(q.state_dict())
                    if updates % 20 == 0:
                        weights.publish(q)
                    if time.monotonic() - shown > 10:
                        shown = time.monotonic()
                        rate = np.mean(successes) if successes else 0.0
                        print(
                            f"{shown - began:6.0f} s  env steps {steps:8,d}  updates "
                            f"{updates:7,d}  greedy success (last {len(successes)}) {rate:.2f}",
                            flush=True,
                        )
        finally:
            shared["stop"].set()
            for p in procs:
                p.join(15)
                if p.is_alive():
                    p.kill()
                    p.join()
    rate = float(np.mean(successes)) if successes else 0.0
    print(f"{time.monotonic() - began:.0f} s, {shared['env_steps'].value:,d} env steps, "
          f"{updates:,d} updates, {episodes:,d} greedy episodes")  # fmt: skip
    print(f"final success rate (last {LAST_N} greedy episodes): {rate:.2f}")


if __name__ == "__main__":
    main()
