"""Atari frames stored once: what a DQN's replay of Breakout holds and what its ``sample(256)``
costs, shmbuffer through a daemon against cpprb's in-process ``ReplayBuffer(next_of="obs",
stack_compress="obs")``, the one peer that stores a frame once (in one process only).

Frames are real: Breakout from the emulator (``ale-py``, whose ROMs come with it; the
``atari`` extra), a random policy, every 4th frame, grayscale, cut to 84x84 (nearest pixels:
no OpenCV), recorded once into a pool of whole episodes that the fill cycles through. A
transition's observation is the stack of its last 4 frames (the episode's first frame
repeated before its start, as Gymnasium's ``FrameStackObservation`` pads), its next
observation the stack one step on.

- **shmbuffer**: a daemon whose schema stores one frame per row (``obs = {stack = 4}``) and
  nothing for the next observation (``next.obs = {next_of = "obs"}``): each episode takes one
  row more, for its last next frame (``docs/frames.md``). One Writer fills it with whole
  episodes; a Reader samples. Memory: the segment's files in tmpfs (every process maps them;
  nothing else grows with the rows).
- **cpprb**: ``ReplayBuffer(N, obs (84, 84, 4) uint8, next_of="obs", stack_compress="obs")``
  in this process, filled an episode at a time (``on_episode_end`` after each, as its docs
  ask). Memory: this process's resident set after the fill, less before.
- **as stored today** (no stack, no next_of): ``N * (2 * 4 * 84 * 84 + the small columns)``
  bytes, computed, not allocated.

One after the other in one run, each freed before the next (the 1M case needs ~7 GB each on
a 24 GB machine). ``--atari-transitions N`` sets the size (default 100,000;
``python -m bench images.atari --atari-transitions 1000000 --repeat 1`` for the 1M figure).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.adapters import missing_module
from bench.harness import bench_dirs, running_daemon
from bench.registry import Context, Row, make_row, median_us, scenario

NAME = "images.atari"
STACK = 4
FRAME = (84, 84)
FRAME_BYTES = FRAME[0] * FRAME[1]
SMALL_BYTES = 8 + 4 + 1 + 1  # action int64, reward float32, terminated, truncated
BATCH = 256
POOL_STEPS = 20_000  # recorded from the emulator, then cycled; --quick: a tenth
QUICK_TRANSITIONS = 10_000
SCHEMA = {
    "obs": {"dtype": "uint8", "shape": list(FRAME), "stack": STACK},
    "next.obs": {"next_of": "obs"},
    "action": {"dtype": "int64", "shape": []},
    "reward": {"dtype": "float32", "shape": []},
    "terminated": {"dtype": "bool", "shape": []},
    "truncated": {"dtype": "bool", "shape": []},
}


@dataclass
class Episode:
    frames: np.ndarray  # uint8 [T + 1, 84, 84]: the observation before each step, and the last
    action: np.ndarray
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray

    @property
    def length(self) -> int:
        return len(self.action)


def record(steps: int, seed: int = 0) -> list[Episode]:
    """Whole Breakout episodes of about ``steps`` steps in all, a random policy's."""
    import ale_py
    import gymnasium as gym

    gym.register_envs(ale_py)
    env = gym.make("ALE/Breakout-v5", obs_type="grayscale", frameskip=4)
    rows = (np.arange(FRAME[0]) * 210 // FRAME[0]).astype(np.intp)
    cols = (np.arange(FRAME[1]) * 160 // FRAME[1]).astype(np.intp)
    rng = np.random.default_rng(seed)
    episodes: list[Episode] = []
    total = 0
    try:
        while total < steps:
            obs, _ = env.reset(seed=int(rng.integers(1 << 31)))
            frames, actions, rewards, terms, truncs = [obs[rows][:, cols]], [], [], [], []
            done = False
            while not done:
                action = int(rng.integers(env.action_space.n))
                obs, reward, term, trunc, _ = env.step(action)
                frames.append(obs[rows][:, cols])
                actions.append(action)
                rewards.append(reward)
                terms.append(term)
                truncs.append(trunc)
                done = term or trunc
            episodes.append(
                Episode(
                    np.stack(frames),
                    np.asarray(actions, np.int64),
                    np.asarray(rewards, np.float32),
                    np.asarray(terms, bool),
                    np.asarray(truncs, bool),
                )
            )
            total += len(actions)
    finally:
        env.close()
    return episodes


def cycle(pool: list[Episode], transitions: int) -> Iterator[Episode]:
    """The pool's episodes over and over, the last one cut to make ``transitions`` in all."""
    left = transitions
    while left > 0:
        for whole in pool:
            if left <= 0:
                return
            ep = whole if whole.length <= left else _cut(whole, left)
            left -= ep.length
            yield ep


def _cut(ep: Episode, k: int) -> Episode:
    """The first ``k`` steps of ``ep``, truncated there."""
    truncated = ep.truncated[:k].copy()
    truncated[-1] = True
    return Episode(ep.frames[: k + 1], ep.action[:k], ep.reward[:k], ep.terminated[:k], truncated)


def stacks(frames: np.ndarray, last_axis: bool = False) -> np.ndarray:
    """``[T, 4, 84, 84]`` stacks of each step's last 4 frames of ``frames`` (the first
    repeated before it), or ``[T, 84, 84, 4]`` (cpprb's layout) with ``last_axis``."""
    t = np.arange(len(frames))[:, None] + np.arange(-STACK + 1, 1)[None, :]
    out = frames[np.maximum(t, 0)]
    return np.moveaxis(out, 1, -1) if last_axis else out


def _segment_bytes(folder: Path) -> int:
    """Bytes the files under ``folder`` take in tmpfs (allocated blocks, not their sizes)."""
    return sum(p.stat().st_blocks * 512 for p in folder.rglob("*") if p.is_file())


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _shmbuffer(ctx: Context, pool: list[Episode], n: int, seconds: float) -> tuple[int, float, int]:
    """Segment bytes, and microseconds per ``sample(256)`` (median) over ``calls``."""
    from shmbuffer import Reader, Writer

    episodes = sum(1 for _ in cycle(pool, n))
    with (
        bench_dirs(ctx) as root,
        running_daemon(root, n + episodes, "transition", schema_json=SCHEMA) as name,
    ):
        with Writer(name, timeout=120) as writer:
            for ep in cycle(pool, n):
                writer.add_episode(
                    {
                        "obs": ep.frames[:-1],
                        "next": {"obs": ep.frames[1:]},
                        "action": ep.action,
                        "reward": ep.reward,
                        "terminated": ep.terminated,
                        "truncated": ep.truncated,
                    }
                )
            writer.flush()
        nbytes = _segment_bytes(Path(root) / name)
        with Reader(name, timeout=120) as reader:
            batch = reader.sample(BATCH)
            _check(batch["obs"].numpy(), batch["next", "obs"].numpy(), batch["terminated"].numpy())
            us, calls = median_us(lambda: reader.sample(BATCH), seconds, warm=3)
    return nbytes, us, calls


def _cpprb(pool: list[Episode], n: int, seconds: float) -> tuple[int, float, int]:
    """cpprb's resident growth over its fill, and microseconds per ``sample(256)``."""
    import cpprb

    gc.collect()
    before = _rss()
    rb: Any = cpprb.ReplayBuffer(
        n,
        {
            "obs": {"shape": (*FRAME, STACK), "dtype": np.uint8},
            "action": {"dtype": np.int64},
            "reward": {"dtype": np.float32},
            "done": {"dtype": np.bool_},
        },
        next_of="obs",
        stack_compress="obs",
    )
    for ep in cycle(pool, n):
        obs = stacks(ep.frames, last_axis=True)
        rb.add(
            obs=obs[:-1],
            next_obs=obs[1:],
            action=ep.action,
            reward=ep.reward,
            done=ep.terminated | ep.truncated,
        )
        rb.on_episode_end()
    nbytes = _rss() - before
    batch = rb.sample(BATCH)
    _check(
        np.moveaxis(batch["obs"], -1, 1),
        np.moveaxis(batch["next_obs"], -1, 1),
        batch["done"].reshape(-1),
    )
    us, calls = median_us(lambda: batch if rb is None else rb.sample(BATCH), seconds, warm=3)
    rb = batch = None  # freed before the next implementation fills
    gc.collect()
    return nbytes, us, calls


def _check(obs: np.ndarray, nxt: np.ndarray, done: np.ndarray) -> None:
    """A sample's stacks are stacks: the next observation is the observation one frame on
    (the bench measures a read that gives the right frames, not just as many bytes)."""
    if not (obs[:, 1:] == nxt[:, :-1]).all():
        raise AssertionError("a sampled next observation is not its observation one frame on")


@scenario(NAME)
def atari(ctx: Context) -> list[Row]:
    """Breakout frames, stack 4, 100k transitions (--atari-transitions): memory and
    sample(256) of stacked frames, shmbuffer through a daemon vs cpprb's stack_compress."""
    for module in ("ale_py", "gymnasium", "cpprb"):
        why = missing_module(module)
        if why is not None:
            ctx.note(NAME, f"skipped: {why} (pip install 'shmbuffer[bench,atari]')")
            return []
    n = QUICK_TRANSITIONS if ctx.quick else ctx.atari_transitions
    seconds = 0.3 if ctx.quick else 3.0
    pool = record(POOL_STEPS // 10 if ctx.quick else POOL_STEPS)
    steps = sum(ep.length for ep in pool)
    ctx.note(
        NAME,
        f"{n:,} transitions of Breakout (ale-py, random policy, frameskip 4, 84x84 grayscale), "
        f"cycled from {len(pool)} recorded episodes ({steps:,} steps); obs = the last 4 "
        "frames, next obs one frame on; shmbuffer: a daemon, schema obs stack=4 + next.obs "
        "next_of, one Writer, Reader.sample(256), memory = the segment's files in tmpfs; "
        "cpprb: ReplayBuffer(next_of='obs', stack_compress='obs') in this process, memory = "
        "its resident growth over the fill; as-stored-today: computed, obs and next.obs "
        f"[4, 84, 84] each; one after the other, each freed before the next",
    )
    rows: list[Row] = []
    today = n * (2 * STACK * FRAME_BYTES + SMALL_BYTES)
    rows.append(_memory_row("as-stored-today", n, today))
    order = ctx.rotate(["shmbuffer", "cpprb"])
    for impl in order:
        if impl == "shmbuffer":
            nbytes, us, calls = _shmbuffer(ctx, pool, n, seconds)
        else:
            nbytes, us, calls = _cpprb(pool, n, seconds)
        rows.append(_memory_row(impl, n, nbytes))
        rows.append(
            make_row(
                NAME,
                impl,
                "sample(256)",
                rows=BATCH * calls,
                nbytes=2 * BATCH * STACK * FRAME_BYTES * calls,
                seconds=us * calls / 1e6,
                pass_="steady",
                calls=calls,
                us_per_call=us,
            )
        )
    return rows


def _memory_row(impl: str, n: int, nbytes: int) -> Row:
    return make_row(
        NAME,
        impl,
        f"memory@{n // 1000}k",
        rows=n,
        nbytes=nbytes,
        seconds=1.0,
        pass_="first",  # what the fill left: read once
        memory_gb=nbytes / 1e9,
    )
