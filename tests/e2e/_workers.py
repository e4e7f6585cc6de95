"""Worker functions run in spawned processes by the e2e tests (no pytest imports here).

:func:`entry` sets ``SHMBUFFER_RUNTIME_DIR`` before anything looks for a daemon, runs one
worker and reports ``(tag, "ok", result)`` or ``(tag, "error", traceback)`` on the queue.
Workers may also post ``(tag, "<message>", value)`` progress lines through ``say``.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any


def entry(runtime_dir: str, results: Any, tag: str, fn: str, args: tuple[Any, ...]) -> None:
    os.environ["SHMBUFFER_RUNTIME_DIR"] = runtime_dir
    try:
        value = globals()[fn](*args, say=lambda msg, v=None: results.put((tag, msg, v)))
    except BaseException:
        results.put((tag, "error", traceback.format_exc()))
        raise SystemExit(1) from None
    results.put((tag, "ok", value))


def write_episodes(
    name: str, writer_id: int, episodes: int, length: int, obs_shape: tuple[int, ...], say: Any
) -> int:
    from shmbuffer.demo import writer_loop

    return writer_loop(name, writer_id, episodes, length, tuple(obs_shape))


def learn(name: str, seconds: float, say: Any) -> dict[str, int]:
    from shmbuffer.demo import learner_loop

    return learner_loop(name, seconds)


def lease_and_hang(name: str, n: int, say: Any) -> None:
    """Take a lease on ``n`` sampled episodes, report their starts, then wait to be killed."""
    from shmbuffer import Reader

    reader = Reader(name)
    with reader.sample_episodes(n) as episodes:
        starts = sorted({_start(reader, ep) for ep in episodes})
        say("leased", starts)
        time.sleep(600)


def _start(reader: Any, ep: Any) -> int:
    """Physical row of a zero-copy episode view inside the reader's segment."""
    base = reader.segment.columns[("step",)]
    return (ep["step"].data_ptr() - base.data_ptr()) // (base.stride(0) * base.element_size())


def write_episodes_retrying(
    name: str, writer_id: int, episodes: int, length: int, obs_shape: tuple[int, ...], say: Any
) -> dict[str, int]:
    """Like ``write_episodes``, but a reservation refused with CapacityError (the ring lapped a
    writer still copying) is retried; returns how many were written and retried."""
    from shmbuffer import Writer
    from shmbuffer.demo import make_episode
    from shmbuffer.errors import CapacityError

    retries = 0
    with Writer(name) as writer:
        for episode in range(episodes):
            data = make_episode(writer_id, episode, length, tuple(obs_shape))
            for _ in range(1000):
                try:
                    writer.add_episode(data)
                    break
                except CapacityError:
                    retries += 1
                    time.sleep(0.005)
            else:
                raise RuntimeError("a reservation kept colliding with another writer's")
        writer.flush()
    return {"written": episodes, "retries": retries}
