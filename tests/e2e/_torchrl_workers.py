"""Worker functions for tests/e2e/test_torchrl.py, run in spawned (or forked) processes.

They take a TorchRL ReplayBuffer built in the test process and pickled into the child (so the
child opens its own shmbuffer clients), as a job's env workers and learners would. :func:`entry`
is tests/e2e/_workers.py's, for this module's functions.
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


def episode(episode_id: int, first_id: int, length: int) -> Any:
    """One episode's rows: ``id`` counts steps, ``obs`` repeats it (a torn or mixed row shows
    as ``obs != id``), ``episode`` names it and ``("next", "done")`` ends it."""
    import torch
    from tensordict import TensorDict

    ids = torch.arange(first_id, first_id + length)
    done = torch.zeros(length, 1, dtype=torch.bool)
    done[-1] = True
    return TensorDict(
        {
            "id": ids,
            "obs": ids.to(torch.float32)[:, None].expand(length, 3).clone(),
            "episode": torch.full((length,), episode_id),
            "next": {"done": done},
        },
        batch_size=[length],
    )


def lengths(episodes: int) -> list[int]:
    """Unequal episode lengths, 5 to 12 rows."""
    return [5 + (7 * e) % 8 for e in range(episodes)]


def fork_extend(rb: Any, episode_id: int, first_id: int, length: int) -> None:
    """A forked child writing through the parent's (already used) buffer."""
    rb.extend(episode(episode_id, first_id, length))
    rb.storage.close()


def worker_then_learner(rb: Any, prioritized: Any, go: Any, episodes: int, say: Any) -> Any:
    """First an env worker (``extend`` episodes through ``rb``), then, once the test says
    which row, a second learner: sample through ``prioritized`` (a DaemonSampler buffer),
    then give that row a priority 10**12 times every other row's."""
    import torch

    try:
        written = 0
        for e, length in enumerate(lengths(episodes)):
            index = rb.extend(episode(e, written, length))
            assert index.tolist() == [-1] * length, index  # the daemon placed them
            written += length
            time.sleep(0.01)  # an env's pace: the learner samples meanwhile
        rb.storage.flush()  # DaemonWriter(flush=False) leaves the last commits to ride later
        say("written", written)
        hot = go.get(timeout=60)
        data, info = prioritized.sample(return_info=True)
        size = len(prioritized)
        priority = torch.full((size,), 1e-6)
        priority[hot] = 1e6
        prioritized.update_priority(torch.arange(size), priority)
        return {"len": size, "sampled": len(data), "index_max": int(info["index"].max())}
    finally:
        rb.storage.close()
