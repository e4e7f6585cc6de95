"""Compressed columns: what a column stored with zstd or lz4 saves in memory and costs a
sample, against the same column stored plain (``docs/compression.md``).

The payload looks recorded: 84x84 u8 frames with a fixed background (score bar, walls), a
paddle and a ball that move a few pixels a step, episodes of ``LENGTH`` steps. Random bytes
would not compress at all, and real Atari frames compress about this well (pytorch/rl #2983:
20 GB of frames in under 1 GB). The cost of a compressed sample is one decompression per
distinct episode drawn (a chunk is an episode), so it falls as episodes get shorter.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import numpy as np

from bench.registry import Context, Row, make_row, median_us, scenario

NAME = "compressed.frames"
LENGTH = 100  # steps per episode
BATCH = 256


def frames(episode: int, length: int) -> np.ndarray:
    """Recorded-looking frames: a fixed background, a paddle and a ball that move."""
    obs = np.zeros((length, 84, 84), np.uint8)
    obs[:, :8, :] = 40 + episode % 7  # score bar
    obs[:, 8:12, :] = 142  # wall
    obs[:, 12:, :4] = obs[:, 12:, 80:] = 142
    t = np.arange(length)
    for i in range(length):
        x = (3 * t[i] + episode) % 68 + 4
        obs[i, 78:80, x : x + 8] = 200  # paddle
        y = 20 + (t[i] * 5) % 50
        obs[i, y : y + 2, (x + 20) % 72 + 4 : (x + 20) % 72 + 6] = 255  # ball
        obs[i, 24:30, 4 + (episode % 10) * 7 : 4 + (episode % 10) * 7 + 6] = 0  # a brick gone
    return obs


def breakout(steps: int, seed: int = 0) -> list[np.ndarray] | None:
    """Each Breakout episode's frames (a random policy, frameskip 4, grayscale cut to 84x84
    by nearest pixels), about ``steps`` in all; None where ale-py or gymnasium is missing."""
    try:
        import ale_py
        import gymnasium as gym
    except ImportError:
        return None
    gym.register_envs(ale_py)
    env = gym.make("ALE/Breakout-v5", obs_type="grayscale", frameskip=4)
    rows = (np.arange(84) * 210 // 84).astype(np.intp)
    cols = (np.arange(84) * 160 // 84).astype(np.intp)
    rng = np.random.default_rng(seed)
    episodes: list[np.ndarray] = []
    total = 0
    try:
        while total < steps:
            obs, _ = env.reset(seed=int(rng.integers(1 << 31)))
            shots, done = [obs[rows][:, cols]], False
            while not done and total + len(shots) < steps:
                obs, _, term, trunc, _ = env.step(int(rng.integers(env.action_space.n)))
                shots.append(obs[rows][:, cols])
                done = term or trunc
            episodes.append(np.stack(shots))
            total += len(shots)
    finally:
        env.close()
    return episodes


def _spec(codec: str | None) -> dict[str, Any]:
    column: dict[str, Any] = {"dtype": "uint8", "shape": [84, 84]}
    if codec is not None:
        column["compress"] = codec
    return {"obs": column, "reward": {"dtype": "float32", "shape": []}}


def _filled(codec: str | None, episodes: list[np.ndarray]) -> Any:
    from shmbuffer import Buffer

    rows = sum(len(e) for e in episodes)
    extra = {} if codec is None else {"compressed_bytes": rows * 84 * 84 // 4}
    buffer = Buffer(rows, unit="episode", schema=_spec(codec), seed=0, **extra)
    for obs in episodes:
        buffer.add_episode({"obs": obs, "reward": np.zeros(len(obs), np.float32)})
    return buffer


def _row(impl: str, us: float, calls: int, stored: int, raw: int) -> Row:
    return make_row(
        NAME,
        impl,
        "sample",
        rows=BATCH * calls,
        nbytes=BATCH * 84 * 84 * calls,
        seconds=us * calls / 1e6,
        pass_="steady",
        calls=calls,
        us_per_call=us,
        stored_bytes=stored,
        ratio=raw / stored,
    )


def _in_process(codec: str | None, episodes: list[np.ndarray], seconds: float) -> Row:
    with _filled(codec, episodes) as buffer:
        us, calls = median_us(lambda: buffer.sample(BATCH), seconds)
        raw = buffer.num_rows * 84 * 84
        stats = buffer.stats().get("compressed")
        stored = raw if stats is None else stats["used"] + buffer.num_rows * 24
    return _row("shmbuffer" if codec is None else f"shmbuffer-{codec}", us, calls, stored, raw)


def _through_daemon(
    ctx: Context, codec: str | None, episodes: list[np.ndarray], seconds: float
) -> Row:
    """A daemon filled by a Writer (which compresses) and sampled by a Reader (which
    decompresses): ``start --schema`` with the column compressed, ``--compressed-bytes``."""
    from bench.harness import running_daemon
    from shmbuffer import Reader, Writer

    rows = sum(len(e) for e in episodes)
    folder = tempfile.mkdtemp(prefix="bench-compressed-", dir=ctx.shm_dir or "/dev/shm")
    try:
        path = os.path.join(folder, "schema.json")
        with open(path, "w") as f:
            json.dump(_spec(codec), f)
        args = ("--schema", path)
        if codec is not None:
            args += ("--compressed-bytes", str(rows * 84 * 84 // 4))
        with running_daemon(folder, rows, "episode", args=args) as name:
            with Writer(name, timeout=30) as w:
                for obs in episodes:
                    w.add_episode({"obs": obs, "reward": np.zeros(len(obs), np.float32)})
            with Reader(name, timeout=30) as r:
                us, calls = median_us(lambda: r.sample(BATCH), seconds)
                stats = r.stats()
        raw = stats["rows"] * 84 * 84
        packed = stats.get("compressed")
        stored = raw if packed is None else packed["used"] + stats["rows"] * 24
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    impl = "shmbuffer-daemon" if codec is None else f"shmbuffer-daemon-{codec}"
    return _row(impl, us, calls, stored, raw)


@scenario(NAME)
def compressed(ctx: Context) -> list[Row]:
    """``sample(256)`` of u8[84,84] frames stored plain, with zstd (level 3) and with lz4,
    in process and through a daemon; the stored bytes and the ratio beside each."""
    rows_total = 2_000 if ctx.quick else 20_000
    seconds = 0.2 if ctx.quick else 2.0
    episodes = breakout(rows_total)
    if episodes is None:
        what = f"recorded-looking synthetic frames in episodes of {LENGTH}"
        episodes = [frames(e, LENGTH) for e in range(rows_total // LENGTH)]
    else:
        what = "real Breakout frames (ale-py, random policy, frameskip 4, 84x84 grayscale)"
    ctx.note(
        NAME,
        f"unit='episode', {rows_total:,} rows of u8[84,84] {what}; sample({BATCH}) median over "
        f"{seconds}s, in process (Buffer) and through a daemon (Writer + Reader); ratio = raw "
        "/ stored bytes of the column (rows of chunk references included); zstd level 3, lz4 "
        "level 0; the byte store a quarter of the raw frames",
    )
    out: list[Row] = []
    for codec in (None, "zstd", "lz4"):
        for measure in (_in_process, _through_daemon):
            try:
                if measure is _in_process:
                    out.append(_in_process(codec, episodes, seconds))
                else:
                    out.append(_through_daemon(ctx, codec, episodes, seconds))
            except Exception as exc:  # the optional codec missing: say so, measure the others
                ctx.note(NAME, f"{codec} ({measure.__name__}): failed ({exc})")
    return out
