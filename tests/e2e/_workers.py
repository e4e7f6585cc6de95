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


def learn_tolerating_torn(name: str, seconds: float, say: Any) -> dict[str, int]:
    """``learner_loop`` for a ring that laps under the reader: whole leased episodes must
    always check out; a row sample may give up with TornReadError (documented for a ring far
    too small for the write rate), which is counted, never a wrong row."""
    from shmbuffer import Reader
    from shmbuffer.demo import check_episode, check_rows
    from shmbuffer.errors import EmptyBufferError, TornReadError

    checked = rows = torn = 0
    deadline = time.monotonic() + seconds
    with Reader(name) as reader:
        while time.monotonic() < deadline:
            try:
                with reader.sample_episodes(4) as episodes:
                    for ep in episodes:
                        check_episode(ep)
                        checked += 1
                sample = reader.sample(64)
            except EmptyBufferError:
                time.sleep(0.01)
                continue
            except TornReadError:
                torn += 1
                continue
            check_rows(sample)
            rows += len(sample)
    return {"episodes_checked": checked, "rows_checked": rows, "torn": torn}
