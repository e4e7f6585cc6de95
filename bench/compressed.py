"""Compressed columns: what a column stored with zstd or lz4 saves in memory and costs a
sample, against the same column stored plain (``docs/compression.md``).

The payload looks recorded: 84x84 u8 frames with a fixed background (score bar, walls), a
paddle and a ball that move a few pixels a step, episodes of ``LENGTH`` steps. Random bytes
would not compress at all, and real Atari frames compress about this well (pytorch/rl #2983:
20 GB of frames in under 1 GB). The cost of a compressed sample is one decompression per
distinct episode drawn (a chunk is an episode), so it falls as episodes get shorter.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from bench.registry import Context, Row, make_row, scenario

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


def _filled(codec: str | None, rows: int) -> Any:
    from shmbuffer import Buffer

    column: dict[str, Any] = {"dtype": "uint8", "shape": [84, 84]}
    if codec is not None:
        column["compress"] = codec
    spec = {"obs": column, "reward": {"dtype": "float32", "shape": []}}
    extra = {} if codec is None else {"compressed_bytes": rows * 84 * 84 // 4}
    buffer = Buffer(rows, unit="episode", schema=spec, seed=0, **extra)
    for episode in range(rows // LENGTH):
        reward = np.zeros(LENGTH, np.float32)
        buffer.add_episode({"obs": frames(episode, LENGTH), "reward": reward})
    return buffer


@scenario(NAME)
def compressed(ctx: Context) -> list[Row]:
    """``sample(256)`` of u8[84,84] frames stored plain, with zstd (level 3) and with lz4,
    in process; the stored bytes and the ratio beside each."""
    rows_total = 2_000 if ctx.quick else 20_000
    seconds = 0.2 if ctx.quick else 2.0
    ctx.note(
        NAME,
        f"in-process Buffer, unit='episode', {rows_total:,} rows of u8[84,84] recorded-looking "
        f"frames in episodes of {LENGTH}; sample({BATCH}) median over {seconds}s; ratio = raw / "
        "stored bytes of the column (rows of chunk references included); zstd level 3, lz4 "
        "level 0; the byte store a quarter of the raw frames",
    )
    out: list[Row] = []
    for codec in (None, "zstd", "lz4"):
        try:
            buffer = _filled(codec, rows_total)
        except Exception as exc:  # the optional codec missing: say so, measure the others
            ctx.note(NAME, f"{codec}: failed ({exc})")
            continue
        with buffer:
            buffer.sample(BATCH)
            times = []
            deadline = time.perf_counter() + seconds
            while time.perf_counter() < deadline or len(times) < 3:
                start = time.perf_counter()
                buffer.sample(BATCH)
                times.append(time.perf_counter() - start)
            us = float(np.median(times)) * 1e6
            raw = buffer.num_rows * 84 * 84
            stats = buffer.stats().get("compressed")
            stored = raw if stats is None else stats["used"] + buffer.num_rows * 24
            out.append(
                make_row(
                    NAME,
                    "shmbuffer" if codec is None else f"shmbuffer-{codec}",
                    "sample",
                    rows=BATCH * len(times),
                    nbytes=BATCH * 84 * 84 * len(times),
                    seconds=us * len(times) / 1e6,
                    pass_="steady",
                    calls=len(times),
                    us_per_call=us,
                    stored_bytes=stored,
                    ratio=raw / stored,
                )
            )
    return out
