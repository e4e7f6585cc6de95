"""The synthetic data of ``shmbuffer-daemon demo`` and the writer and learner loops that
move it (the command itself, which imports none of this, is :mod:`shmbuffer.cli.demo`).

Every row carries who wrote it (``writer``), which of its episodes (``episode``), the step and
an observation filled with a value derived from those three, so a learner can prove each
episode it samples is whole. The same worker functions drive the end-to-end tests and the
daemon benchmarks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

#: Seconds a learner waits for the first data before it gives up (writers still starting).
FIRST_DATA_WAIT_S = 120.0


def payload_value(writer: int, episode: int, step: np.ndarray | int) -> Any:
    return (writer * 7 + episode * 13 + step) % 251


def make_episode(
    writer: int, episode: int, length: int, obs_shape: tuple[int, ...]
) -> dict[str, np.ndarray]:
    steps = np.arange(length, dtype=np.int64)
    values = payload_value(writer, episode, steps).astype(np.uint8)
    obs = np.empty((length, *obs_shape), dtype=np.uint8)
    obs.reshape(length, -1)[:] = values[:, None]
    done = np.zeros(length, dtype=bool)
    done[-1] = True
    return {
        "obs": obs,
        "writer": np.full(length, writer, dtype=np.int64),
        "episode": np.full(length, episode, dtype=np.int64),
        "step": steps,
        "reward": steps.astype(np.float32),
        "done": done,
    }


def check_episode(ep: TensorDict) -> None:
    """Raise AssertionError unless ``ep`` is one whole episode written by make_episode."""
    writer, episode = int(ep["writer"][0]), int(ep["episode"][0])
    steps = ep["step"].numpy()
    length = len(steps)
    assert (ep["writer"] == writer).all() and (ep["episode"] == episode).all(), "mixed episodes"
    assert np.array_equal(steps, np.arange(length)), f"steps not 0..{length - 1}: torn"
    assert bool(ep["done"][-1]) and not ep["done"][:-1].any(), "done flags torn"
    expected = payload_value(writer, episode, steps).astype(np.uint8)
    obs = ep["obs"].reshape(length, -1).numpy()
    assert np.array_equal(obs[:, 0], expected) and np.array_equal(obs[:, -1], expected), "torn obs"


def check_rows(batch: TensorDict) -> None:
    """Each sampled row's observation matches its (writer, episode, step) stamp."""
    expected = payload_value(batch["writer"], batch["episode"], batch["step"]).to(torch.uint8)
    obs = batch["obs"].reshape(len(expected), -1)
    assert torch.equal(obs[:, 0], expected) and torch.equal(obs[:, -1], expected), "torn row"


def writer_loop(
    target: str,
    writer_id: int,
    episodes: int,
    length: int,
    obs_shape: tuple[int, ...],
    seconds: float | None = None,
    start: Callable[[], None] | None = None,
) -> int:
    """Write ``episodes`` episodes (or until ``seconds`` pass); return how many were written.
    ``start``, if given, is called once the writer is connected, and the run (its clock
    included) begins when it returns: the demo's start line for all its processes."""
    from shmbuffer import Writer

    with Writer(target) as writer:
        # from here: attaching (and compiling the streaming copy, seconds the first time
        # after an install without its cache) is not the writer's run
        if start is not None:
            start()
        deadline = time.monotonic() + seconds if seconds else None
        written = 0
        for episode in range(episodes):
            if deadline is not None and time.monotonic() > deadline:
                break
            writer.add_episode(make_episode(writer_id, episode, length, obs_shape))
            written += 1
        writer.flush()
    return written


def learner_loop(
    target: str,
    seconds: float,
    batch: int = 8,
    wait: float | None = None,
    start: Callable[[], None] | None = None,
) -> dict[str, int]:
    """Sample episodes and rows for ``seconds`` from the first data (waiting for it up to
    ``wait`` seconds, :data:`FIRST_DATA_WAIT_S` by default); verify every one. Returns
    counts. ``start``, if given, is called once the reader is connected, and the clock
    starts when it returns, as in :func:`writer_loop`: the writers started with it."""
    from shmbuffer import Reader
    from shmbuffer.errors import EmptyBufferError

    checked = rows = 0
    with Reader(target) as reader:
        if start is not None:
            start()
            deadline, waiting = time.monotonic() + seconds, False
        else:
            # The clock starts at the first data: writers that are still starting (importing
            # torch, compiling the streaming copy) must not use up the learner's run.
            deadline = time.monotonic() + (FIRST_DATA_WAIT_S if wait is None else wait)
            waiting = True
        while time.monotonic() < deadline:
            try:
                with reader.sample_episodes(batch) as episodes:
                    if waiting:
                        deadline, waiting = time.monotonic() + seconds, False
                    for ep in episodes:
                        check_episode(ep)
                        checked += 1
                sample = reader.sample(256)
            except EmptyBufferError:
                time.sleep(0.01)
                continue
            check_rows(sample)
            rows += len(sample)
    return {"episodes_checked": checked, "rows_checked": rows}
