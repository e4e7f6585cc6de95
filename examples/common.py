"""What the examples share: the env-worker process, a daemon of their own, the off-policy
update loop and the bookkeeping behind the figures they print. What differs between them —
the env id, the policy network and how it acts — comes in as parameters.

An env worker (:func:`worker_main`, one spawned process each) steps a ``gymnasium`` vector env
of ``WorkerConfig.env_id`` with the learner's current policy and writes what it saw through
``shmbuffer.Writer``. The learner publishes its weights through a
:class:`shmbuffer.weights.WeightsPublisher`; a worker checks the version (one int read) before
every vector step and copies the weights only when they changed. Workers report each finished
episode's return on a ``multiprocessing`` queue (the learner needs returns, not rows, to know
how it is doing) and count their env steps in shared integers.

The policy is two picklable parameters, both defined by the example (spawned workers import
the example's module to unpickle them): ``policy()`` builds the network the weights are loaded
into, and ``act(net, obs, rng, env_steps)`` turns a vector step's observations into actions,
in the dtype and shape the ``action`` column stores, plus any per-step columns of its own
(PPO's ``logp``); ``env_steps`` counts every worker's steps (exploration schedules).

Two ways of writing, chosen by the learner:

* ``rollout_len == 0`` (DQN, SAC): every sub-env step goes to ``Writer.add_transition`` under
  the id ``w<worker>/<sub-env>``; the writer assembles whole episodes and stores each as it
  ends. A budget of env steps set by the learner (:func:`replay_updates`) holds the replay
  ratio (updates per env step) fixed however fast the workers could step: on two shared cores
  a worker left free takes the learner's CPU and the run needs more wall time, not less.
* ``rollout_len == T`` (PPO): each sub-env's next ``T`` steps under policy version ``v`` are
  written as one entry (``Writer.add_episode``) with a ``policy_version`` column; then the
  worker waits for version ``v + 1``. Every entry is thus on-policy for exactly one version, and
  episodes that span entries are bootstrapped by the learner from ``next_obs``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import multiprocessing as mp
import os
import queue
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import shmbuffer
from shmbuffer import runtime
from shmbuffer.errors import DaemonUnavailableError
from shmbuffer.weights import WeightsSubscriber

LAST_N = 20  # "mean return over the last 20 episodes"
DAEMON_START_TIMEOUT_S = 60.0  # a busy 2-core machine imports torch slowly
STOP_TIMEOUT_S = 15.0

#: ``act(net, obs [E, ...], rng, env_steps) -> (actions [E, ...], extra columns {key: [E]})``,
#: called under ``torch.no_grad()``.
ActFn = Callable[
    [nn.Module, np.ndarray, np.random.Generator, int],
    tuple[np.ndarray, Mapping[str, np.ndarray]],
]


# -- the env worker -------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerConfig:
    buffer: str
    weights: str
    env_id: str  # a gymnasium id: "CartPole-v1", "Pendulum-v1"
    policy: Callable[[], nn.Module]  # builds the network the published weights fit
    act: ActFn
    num_envs: int
    seed: int
    rollout_len: int = 0  # 0: transitions as they come (DQN, SAC); T: T-step entries (PPO)
    #: Attach each finished episode's return, policy version and env to it as metadata
    #: (transitions only; docs/metadata.md).
    meta: bool = False


@dataclass
class Shared:
    """What the learner and its workers share besides the buffer and the weights."""

    stop: Any  # mp.Event
    steps: Any  # mp.Array('q', workers): env steps per worker
    budget: Any  # mp.Value('q'): workers step while their total is below it; < 0: no limit
    returns: Any  # mp.Queue of (worker, return, length)
    errors: Any  # mp.Queue of (worker, traceback text)


def worker_main(index: int, cfg: WorkerConfig, shared: Shared) -> None:
    """One env-worker process; returns when ``shared.stop`` is set."""
    import traceback

    # Ctrl-C reaches the whole process group; the learner stops us in order instead.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)  # a tiny MLP: intra-op threads only fight over the 2 cores
    try:
        _worker_loop(index, cfg, shared)
    except Exception:
        shared.errors.put((index, traceback.format_exc()))
    finally:
        shared.returns.cancel_join_thread()  # never hang at exit on an undrained queue
        shared.errors.cancel_join_thread()


def _worker_loop(index: int, cfg: WorkerConfig, shared: Shared) -> None:
    import gymnasium as gym

    envs = gym.make_vec(
        cfg.env_id,
        num_envs=cfg.num_envs,
        vectorization_mode="sync",
        # The final observation of an episode arrives with its last step (info["final_obs"]),
        # not one step later: every step is a real transition.
        # copy=True: each step's arrays are new, so the writer may keep views of them until
        # an episode is stored.
        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP, "copy": True},
    )
    net = cfg.policy()
    rng = np.random.default_rng([cfg.seed, index])
    with (
        WeightsSubscriber(cfg.weights, timeout=DAEMON_START_TIMEOUT_S) as weights,
        _connect_writer(cfg.buffer) as writer,
    ):
        while not weights.poll(net):  # the publisher publishes version 1 as it starts
            time.sleep(0.01)
        obs, _ = envs.reset(seed=cfg.seed * 10_000 + index * cfg.num_envs)  # sub-env i: +i
        ep_return = np.zeros(cfg.num_envs)
        ep_length = np.zeros(cfg.num_envs, dtype=np.int64)
        fragment: dict[str, list[np.ndarray]] = {}
        while not shared.stop.is_set():
            if cfg.rollout_len:
                if len(fragment.get("obs", ())) == cfg.rollout_len:
                    _write_fragments(writer, fragment, weights.seen)
                    fragment = {}
                    _wait(shared, lambda: weights.version > weights.seen)
                    weights.poll(net)
                    continue
            else:
                weights.poll(net)  # one int read unless the learner published
                budget = shared.budget.value
                if budget >= 0 and sum(shared.steps) >= budget:
                    time.sleep(0.001)
                    continue
            with torch.no_grad():
                actions, extra = cfg.act(net, obs, rng, sum(shared.steps))
            next_obs, reward, terminated, truncated, info = envs.step(actions)
            done = terminated | truncated
            real_next = next_obs.copy()
            for j in np.flatnonzero(done):
                real_next[j] = info["final_obs"][j]
            step = {
                "obs": obs,
                "action": actions,
                **extra,
                "reward": reward.astype(np.float32),
                "next_obs": real_next,
                "terminated": terminated,
                "truncated": truncated,
            }
            if cfg.rollout_len:
                for key, value in step.items():
                    fragment.setdefault(key, []).append(value)
            else:
                for i in range(cfg.num_envs):
                    meta = None
                    if cfg.meta and done[i]:  # what the learner and tools select by
                        meta = {
                            "ret": float(ep_return[i] + reward[i]),
                            "steps": int(ep_length[i] + 1),
                            "policy_version": weights.seen,
                            "env_id": f"w{index}/{i}",
                        }
                    writer.add_transition(
                        f"w{index}/{i}", {key: value[i] for key, value in step.items()}, meta=meta
                    )
            ep_return += reward
            ep_length += 1
            for j in np.flatnonzero(done):
                shared.returns.put((index, float(ep_return[j]), int(ep_length[j])))
            ep_return[done], ep_length[done] = 0.0, 0
            obs = next_obs
            shared.steps[index] += cfg.num_envs


def _connect_writer(buffer: str) -> shmbuffer.Writer:
    """A Writer, once the daemon (started alongside the workers) serves ``buffer``."""
    deadline = time.monotonic() + DAEMON_START_TIMEOUT_S
    while True:
        try:
            return shmbuffer.Writer(buffer, timeout=30.0)
        except DaemonUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _write_fragments(writer: Any, fragment: dict[str, list[np.ndarray]], version: int) -> None:
    """One entry per sub-env: its ``T`` steps under policy ``version``, then a flush so the
    learner can see all of them before it waits for more."""
    columns = {key: np.stack(values, axis=1) for key, values in fragment.items()}  # [E, T, ...]
    num_envs, length = columns["obs"].shape[:2]
    versions = np.full(length, version, dtype=np.int64)
    for i in range(num_envs):
        writer.add_episode(
            {**{key: value[i] for key, value in columns.items()}, "policy_version": versions}
        )
    writer.flush()


def _wait(shared: Shared, ready: Any) -> None:
    while not ready() and not shared.stop.is_set():
        time.sleep(0.001)


# -- the worker fleet -----------------------------------------------------------------------


class Rollout:
    """``workers`` env-worker processes (spawned), started and always stopped together."""

    def __init__(self, workers: int, cfg: WorkerConfig) -> None:
        ctx = mp.get_context("spawn")
        self.shared = Shared(
            stop=ctx.Event(),
            steps=ctx.Array("q", workers, lock=False),
            budget=ctx.Value("q", -1, lock=False),
            returns=ctx.Queue(),
            errors=ctx.Queue(),
        )
        self.procs = [
            ctx.Process(target=worker_main, args=(w, cfg, self.shared), daemon=True)
            for w in range(workers)
        ]
        self.started = 0.0
        self._torn = False  # a read of ``returns`` was interrupted (Ctrl-C) part-way
        self._reported: set[int] = set()  # workers whose exit check() has printed

    def start(self) -> None:
        for p in self.procs:
            p.start()
        self.started = time.monotonic()

    @property
    def env_steps(self) -> int:
        return int(sum(self.shared.steps))

    def set_budget(self, steps: int) -> None:
        self.shared.budget.value = steps

    def returns(self) -> list[tuple[int, float, int]]:
        """Episodes finished since the last call: (worker, return, length). After a read that
        an exception (Ctrl-C) cut short, none: the queue's pipe may hold half a message."""
        out: list[tuple[int, float, int]] = []
        if self._torn:
            return out
        self._torn = True
        with contextlib.suppress(queue.Empty):
            while True:
                out.append(self.shared.returns.get_nowait())
        self._torn = False
        return out

    def check(self) -> None:
        """Raise if a worker failed (with its traceback) or every worker is gone. A worker
        killed from outside (``kill -9``) is reported once and the others go on: what it
        committed stays in the buffer, and its steps still count towards the budget."""
        with contextlib.suppress(queue.Empty):
            index, text = self.shared.errors.get_nowait()
            raise RuntimeError(f"env worker {index} failed:\n{text}")
        if self.shared.stop.is_set():
            return
        dead = [i for i, p in enumerate(self.procs) if p.exitcode is not None]
        for i in dead:
            if i not in self._reported:
                self._reported.add(i)
                left = len(self.procs) - len(dead)
                print(
                    f"env worker {i} exited (exit code {self.procs[i].exitcode}); "
                    f"going on with {left}",
                    flush=True,
                )
        if len(dead) == len(self.procs):
            codes = [p.exitcode for p in self.procs]
            raise RuntimeError(f"every env worker exited (exit codes {codes})")

    def stop(self) -> None:
        self.shared.stop.set()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in self.procs:
            if p.pid is not None:
                p.join(max(0.1, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(STOP_TIMEOUT_S)


# -- a daemon of our own --------------------------------------------------------------------


class Daemon:
    """The learner's buffer: one already running (``Daemon(name)``, from ``--buffer``) or one
    of its own (:meth:`own`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None

    @classmethod
    @contextlib.contextmanager
    def own(
        cls, name: str, capacity: int, unit: str, extra: Sequence[str] = ()
    ) -> Iterator[Daemon]:
        """``shmbuffer-daemon start`` in a session of its own (Ctrl-C goes to the learner,
        which stops its workers first and the daemon last), stopped with SIGTERM (then
        SIGKILL) whatever happens. Not waited for here: workers start meanwhile (both import
        torch for seconds) and :meth:`wait_ready` waits."""
        argv = [
            sys.executable, "-m", "shmbuffer.cli", "start",
            "--name", name, "--capacity", str(capacity), "--unit", unit, *extra,
        ]  # fmt: skip
        daemon = cls(name)
        # Beside its runtime file; removed after a clean stop, kept if the daemon died.
        daemon.log_path = runtime.runtime_dir() / f"{name}.daemon.log"
        with open(daemon.log_path, "wb") as log:
            daemon.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        try:
            yield daemon
        finally:
            daemon._stop()

    def wait_ready(self) -> None:
        """Return once our daemon's runtime file names it (at once for a running one)."""
        if self.proc is None:
            return
        deadline = time.monotonic() + DAEMON_START_TIMEOUT_S
        while (runtime.read(self.name) or {}).get("pid") != self.proc.pid:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"daemon {self.name!r} did not start:\n{self._log_tail()}")
            time.sleep(0.05)

    def _log_tail(self) -> str:
        assert self.log_path is not None
        return self.log_path.read_text(errors="replace")[-3000:]

    def _stop(self) -> None:
        assert self.proc is not None and self.log_path is not None
        if self.proc.poll() is not None:  # it died under us: what it said comes first
            print(
                f"daemon {self.name!r} exited with code {self.proc.returncode}; "
                f"{self.log_path}:\n{self._log_tail()}",
                file=sys.stderr,
            )
            return
        self.proc.terminate()
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT_S)
        self.log_path.unlink(missing_ok=True)


# -- figures --------------------------------------------------------------------------------


def common_args(parser: argparse.ArgumentParser, target: float) -> None:
    parser.add_argument("--workers", type=int, default=2, help="env-worker processes")
    parser.add_argument("--envs-per-worker", type=int, default=4)
    parser.add_argument("--minutes", type=float, default=10.0, help="time limit, start to end")
    parser.add_argument(
        "--buffer", default=None, help="a running daemon's buffer name (default: start one)"
    )
    parser.add_argument("--target", type=float, default=target, help="stop once reached")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--curve", help="CSV file: env_steps, seconds, return per episode")


class Progress:
    """Episode returns, env steps and samples: what the learner prints and stops on."""

    def __init__(self, rollout: Rollout, curve: str | None, every_s: float = 5.0) -> None:
        self.rollout = rollout
        self.began = time.monotonic()
        self.last = deque[float](maxlen=LAST_N)
        self.episodes = 0
        self.samples = 0  # rows the learner read from the buffer
        self.acting_since: float | None = None  # the first env step seen (rates start there)
        self.every_s = every_s
        self._printed = self.began
        self._curve_file = open(curve, "w", newline="") if curve else None  # noqa: SIM115
        self._curve = csv.writer(self._curve_file) if self._curve_file else None
        if self._curve:
            self._curve.writerow(["env_steps", "seconds", "return"])

    def update(self, check: bool = True) -> None:
        """Take in the episodes finished since; with ``check``, raise if a worker failed."""
        if check:
            self.rollout.check()
        steps = self.rollout.env_steps
        if steps and self.acting_since is None:
            self.acting_since = time.monotonic()
        for _, ret, _ in self.rollout.returns():
            self.last.append(ret)
            self.episodes += 1
            if self._curve:
                self._curve.writerow([steps, f"{time.monotonic() - self.began:.2f}", ret])

    @property
    def mean_return(self) -> float:
        return float(np.mean(self.last)) if self.last else float("nan")

    def reached(self, target: float) -> bool:
        return len(self.last) == LAST_N and self.mean_return >= target

    def maybe_print(self, extra: str = "") -> None:
        now = time.monotonic()
        if now - self._printed < self.every_s:
            return
        self._printed = now
        wall = now - self.began
        print(
            f"[{wall:6.1f}s] env steps {self.rollout.env_steps:>9,} | samples "
            f"{self.samples:>11,} | episodes {self.episodes:>6,} | mean return (last "
            f"{LAST_N}) {self.mean_return:6.1f}{' | ' + extra if extra else ''}",
            flush=True,
        )

    def finish(self) -> None:
        """The closing figures; the very last line is the one scripts and tests read. Also
        after a failure (which the caller then raises)."""
        self.update(check=False)
        now = time.monotonic()
        wall = now - self.began
        # Rates over the time the workers were stepping, not their start-up (seconds of
        # imports on a busy machine).
        acting = max(1e-9, now - (self.acting_since or now))
        steps = self.rollout.env_steps
        if self._curve_file:
            self._curve_file.close()
        print(f"wall time: {wall:.1f} s ({acting:.1f} s acting); {self.episodes:,} episodes")
        print(f"env steps/s: {steps / acting:,.1f} ({steps:,} env steps)")
        print(f"samples/s: {self.samples / acting:,.1f} ({self.samples:,} rows sampled)")
        print(f"final mean return (last {LAST_N} episodes): {self.mean_return:.1f}", flush=True)


# -- the off-policy loop --------------------------------------------------------------------


def replay_updates(
    reader: shmbuffer.Reader,
    progress: Progress,
    *,
    deadline: float,
    target: float,
    batch_size: int,
    learning_starts: int,
    env_steps_per_update: float,
    status: Callable[[int], str] = lambda updates: f"updates {updates:,}",
    chunk: int = 50,
) -> Iterator[int]:
    """The off-policy learners' loop (DQN, SAC): yields the number of each update the caller
    is to make now (1, 2, ...), ``chunk`` at a time, until the deadline or the target; counts
    ``batch_size`` samples per update and prints ``status(updates)`` with the progress line.

    The workers' env-step budget holds the replay ratio: they may step ``learning_starts``
    plus ``env_steps_per_update`` per update made. Until ``learning_starts`` steps are taken
    and the buffer holds a batch, they step on (episodes are stored as they end). Set the
    budget to ``learning_starts`` before starting the workers: they start stepping long
    before the learner gets here (it waits for the daemon).
    """
    rollout = progress.rollout
    updates = 0
    while time.monotonic() < deadline and not progress.reached(target):
        progress.update()
        progress.maybe_print(status(updates))
        if rollout.env_steps < learning_starts or len(reader) < batch_size:
            # Episodes are stored as they end: let the workers finish some.
            rollout.set_budget(max(learning_starts, rollout.env_steps + 100))
            time.sleep(0.05)
            continue
        # Hold the replay ratio: workers may step this far ahead of the updates.
        # TODO: the daemon's `--rate-limiter sample-to-insert` (it has one now) instead.
        rollout.set_budget(learning_starts + int(updates * env_steps_per_update))
        for _ in range(chunk):
            yield updates + 1
            updates += 1
            progress.samples += batch_size


# -- names ----------------------------------------------------------------------------------


def unique_name(prefix: str) -> str:
    """A buffer name of this process's own: ``<prefix>-<pid>``."""
    return f"{prefix}-{os.getpid()}"


def weights_name(buffer: str) -> str:
    """This learner's weights channel: per process, so learners sharing a buffer never take
    each other's (names are at most 64 characters)."""
    return f"{buffer[:40]}.weights-{os.getpid()}"
