"""Ray tasks of tests/e2e/test_cluster.py: env workers that write through their node's shard.

A module apart (not the test module) so that Ray workers import it by name: the tests put the
repository on ``PYTHONPATH`` before the simulated cluster starts.
"""

from __future__ import annotations

from typing import Any

import ray
import torch


@ray.remote(num_cpus=0)
def write_episodes(buffer: Any, marker: int, count: int, base_length: int = 5) -> dict[str, Any]:
    """``count`` episodes of ``base_length + i % 3`` steps through this node's shard: ``step``
    counts 0..L-1, ``episode`` is i, ``marker`` the caller's tag, ``done`` on the last step."""
    writer = buffer.writer()
    try:
        for i in range(count):
            length = base_length + i % 3
            writer.add_episode(
                {
                    "obs": torch.full((length, 4), float(marker)),
                    "step": torch.arange(length),
                    "episode": torch.full((length,), i),
                    "marker": torch.full((length,), marker),
                    "done": torch.arange(length) == length - 1,
                }
            )
        writer.flush()
        remote = writer.remote
    finally:
        writer.close()
    return {"node": ray.get_runtime_context().get_node_id(), "remote": remote}


@ray.remote(num_cpus=0)
def write_rows(
    buffer: Any, marker: int, first: int, count: int, priority: float | None = None
) -> dict[str, Any]:
    """``count`` transitions with ids ``first..first+count-1`` (``row``) and ``marker``, in
    chunks of 10, each with ``priority`` (None: the daemon's default)."""
    writer = buffer.writer()
    try:
        for start in range(first, first + count, 10):
            ids = torch.arange(start, min(start + 10, first + count))
            batch = {
                "obs": ids.float()[:, None].repeat(1, 4),
                "row": ids,
                "marker": torch.full((len(ids),), marker),
                "done": torch.zeros(len(ids), dtype=torch.bool),
            }
            writer.extend(batch, priority=priority)
        writer.flush()
        remote = writer.remote
    finally:
        writer.close()
    return {"node": ray.get_runtime_context().get_node_id(), "remote": remote}
