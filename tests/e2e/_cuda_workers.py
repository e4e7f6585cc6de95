"""Worker functions of tests/e2e/test_cuda.py, run in spawned processes (no pytest here).

Every row carries a pattern its reader can check: ``ep`` (a unique episode id), ``t`` (its
step) and ``obs[t, j] = (ep * 131 + t * 7 + j) mod 65536`` (exact in float32), so a row
mixed from two writes, or an episode from two episodes, is found.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import numpy as np
import torch

DIM = 16
SCHEMA = {
    "ep": {"dtype": "int64", "shape": []},
    "t": {"dtype": "int32", "shape": []},
    "obs": {"dtype": "float32", "shape": [DIM]},
}


def episode(ep: int, length: int, device: str | None) -> dict[str, Any]:
    """One episode's rows: numpy arrays (``device`` None) or tensors on ``device``."""
    t = np.arange(length)
    obs = (ep * 131 + t[:, None] * 7 + np.arange(DIM)) % 65536
    batch = {"ep": np.full(length, ep), "t": t.astype(np.int32), "obs": obs.astype(np.float32)}
    if device is None:
        return batch
    return {key: torch.from_numpy(value).to(device) for key, value in batch.items()}


def bad_rows(ep: torch.Tensor, t: torch.Tensor, obs: torch.Tensor) -> int:
    """How many rows break the pattern (any device)."""
    j = torch.arange(DIM, device=obs.device)
    want = ((ep[:, None] * 131 + t[:, None].long() * 7 + j) % 65536).to(obs.dtype)
    return int((obs != want).any(dim=1).sum())


def entry(runtime_dir: str, results: Any, fn: str, args: tuple[Any, ...]) -> None:
    os.environ["SHMBUFFER_RUNTIME_DIR"] = runtime_dir
    try:
        results.put(("ok", globals()[fn](*args)))
    except BaseException:
        results.put(("error", traceback.format_exc()))


def write(name: str, writer_id: int, episodes: int, length: int, on_gpu: bool) -> int:
    """Write ``episodes`` episodes from the host (numpy) or from the GPU (tensors)."""
    from shmbuffer import Writer

    device = "cuda" if on_gpu else None
    # GPU rows go device -> device at once (batch_bytes=0: no host staging of small writes)
    with Writer(name, batch_bytes=0 if on_gpu else 1 << 20) as writer:
        for i in range(episodes):
            writer.add_episode(episode(writer_id * 100_000 + i, length, device))
        writer.flush()
        return writer.rows_committed
