"""A writer process for tests/e2e/test_checkpoint_live.py (no pytest imports here)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

LENGTH = 10
OBS = (2, 3)


def write_until_stopped(
    runtime_dir: str, name: str, stop_file: str, limit_s: float, results: Any
) -> None:
    """Write episodes 0, 1, 2, ... (each carries its number in every row) until ``stop_file``
    exists or ``limit_s`` passes; put how many were committed on ``results``."""
    os.environ["SHMBUFFER_RUNTIME_DIR"] = runtime_dir
    from shmbuffer import Writer
    from shmbuffer.cli.demo_loops import make_episode

    deadline = time.monotonic() + limit_s
    written = 0
    with Writer(name, timeout=20) as writer:
        while not Path(stop_file).exists() and time.monotonic() < deadline:
            writer.add_episode(make_episode(0, written, LENGTH, OBS))
            written += 1
        writer.flush()
    results.put(written)
