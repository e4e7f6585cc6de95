"""Stored rows changed in place: ``Writer.rewrite`` through a daemon, beside the peers'
in-place writes, in the same run.

``python -m bench.rewrite [--rows 65536] [--row-bytes 1024] [--batches 1,64,1024] [--json F]``

A daemon holds ``--rows`` committed rows of ``--row-bytes`` (one ``uint8`` column and a
``float32`` one, as a relabelled observation and its reward); then batches of random rows are
rewritten, each size for about a second:

- ``shmbuffer``: ``Writer.rewrite(rows, batch)`` from a local writer (the bytes travel in the
  request and the daemon copies them in, after re-stamping the rows' episodes);
- ``torchrl``: TorchRL's ``LazyTensorStorage.set(rows, batch)`` in the process that owns it
  (what ``rb[rows] = batch`` runs; nothing shared, nothing checked);
- ``cpprb``: ``ReplayBuffer``'s only way to change stored rows, ``get_all_transitions``,
  patch, ``clear`` and ``add`` back (cpprb has no in-place write; skipped without it);
- ``copy limit``: numpy's fancy assignment of the batch into an array (the bytes' own cost).

Reported: rows per second and the ratio to TorchRL's. A rewrite is a correction of some rows,
not a write path: its cost is a round trip plus the copy, against TorchRL's one process.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.harness import running_daemon, standalone

SECONDS = 1.0


def per_second(step: Callable[[np.ndarray], None], rows: int, batch: int) -> float:
    """Rows per second ``step`` changes, for batches of ``batch`` random rows, over about
    :data:`SECONDS` (after one warm-up call)."""
    rng = np.random.default_rng(0)
    step(rng.choice(rows, size=batch, replace=False))
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < SECONDS:
        step(rng.choice(rows, size=batch, replace=False))
        done += batch
    return done / (time.perf_counter() - t0)


def batch_of(n: int, width: int) -> dict[str, np.ndarray]:
    return {
        "obs": np.full((n, width), 7, dtype=np.uint8),
        "reward": np.ones(n, dtype=np.float32),
    }


def _rewrite(writer: Any, data: dict[str, np.ndarray], rows: np.ndarray) -> None:
    writer.rewrite(rows, data)


def _torchrl_set(storage: Any, data: Any, rows: np.ndarray) -> None:
    import torch

    storage.set(torch.from_numpy(rows), data)


def shmbuffer_rates(args: argparse.Namespace, width: int) -> dict[int, float]:
    from shmbuffer import Writer

    spec = {"obs": {"dtype": "uint8", "shape": [width]}, "reward": {"dtype": "float32"}}
    storage = tempfile.mkdtemp(prefix="shmbuffer-bench-rewrite-", dir="/dev/shm")
    runtime = tempfile.mkdtemp(prefix="sbrw-", dir="/tmp")
    os.environ["SHMBUFFER_RUNTIME_DIR"] = runtime
    rates = {}
    try:
        daemon = running_daemon(storage, args.rows, "transition", schema_json=spec)
        with daemon as name, Writer(name) as writer:
            for first in range(0, args.rows, 4096):
                writer.extend(batch_of(min(4096, args.rows - first), width))
            writer.flush()
            for b in args.batches:
                data = batch_of(b, width)
                step = functools.partial(_rewrite, writer, data)
                rates[b] = per_second(step, args.rows, b)
    finally:
        shutil.rmtree(storage, ignore_errors=True)
        shutil.rmtree(runtime, ignore_errors=True)
    return rates


def torchrl_rates(args: argparse.Namespace, width: int) -> dict[int, float] | None:
    try:
        import torch
        from tensordict import TensorDict
        from torchrl.data import LazyTensorStorage
    except ImportError:
        return None
    storage = LazyTensorStorage(args.rows)
    whole = {k: torch.from_numpy(v) for k, v in batch_of(args.rows, width).items()}
    storage.set(torch.arange(args.rows), TensorDict(whole, [args.rows]))
    rates = {}
    for b in args.batches:
        data = TensorDict({k: torch.from_numpy(v) for k, v in batch_of(b, width).items()}, [b])
        step = functools.partial(_torchrl_set, storage, data)
        rates[b] = per_second(step, args.rows, b)
    return rates


def cpprb_rates(args: argparse.Namespace, width: int) -> dict[int, float] | None:
    try:
        from cpprb import ReplayBuffer
    except ImportError:
        return None
    env = {"obs": {"shape": width, "dtype": np.uint8}, "reward": {"dtype": np.float32}}
    rb = ReplayBuffer(args.rows, env)
    rb.add(**batch_of(args.rows, width))

    def patch(rows: np.ndarray) -> None:
        stored = rb.get_all_transitions()
        stored["reward"][rows] = 2.0
        rb.clear()
        rb.add(**stored)

    return {b: per_second(patch, args.rows, b) for b in args.batches}


def copy_rates(args: argparse.Namespace, width: int) -> dict[int, float]:
    arrays = batch_of(args.rows, width)
    rates = {}
    for b in args.batches:
        data = batch_of(b, width)

        def put(rows: np.ndarray, data: dict[str, np.ndarray] = data) -> None:
            for key, column in arrays.items():
                column[rows] = data[key]

        rates[b] = per_second(put, args.rows, b)
    return rates


def run(args: argparse.Namespace) -> dict[str, Any]:
    width = args.row_bytes - 4
    result: dict[str, Any] = {"rows": args.rows, "row_bytes": args.row_bytes, "rates": {}}
    result["rates"]["shmbuffer"] = shmbuffer_rates(args, width)
    for peer, rates in (
        ("torchrl", torchrl_rates(args, width)),
        ("cpprb", cpprb_rates(args, width)),
        ("copy limit", copy_rates(args, width)),
    ):
        if rates is not None:
            result["rates"][peer] = rates
    return result


def report(result: dict[str, Any]) -> str:
    rates = result["rates"]
    base = rates.get("torchrl")
    lines = [
        f"rows rewritten in place, per second ({result['rows']:,} stored rows of "
        f"{result['row_bytes']} bytes; python -m bench.rewrite):",
        f"  {'batch':>6}  " + "  ".join(f"{name:>22}" for name in rates),
    ]
    for b in rates["shmbuffer"]:
        cells = []
        for name in rates:
            value = rates[name][b]
            ratio = f" ({value / base[b]:.2f}x trl)" if base else ""
            cells.append(f"{value:>10,.0f}{ratio:>12}")
        lines.append(f"  {b:>6}  " + "  ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.rewrite", description=__doc__)
    parser.add_argument("--rows", type=int, default=65_536)
    parser.add_argument("--row-bytes", type=int, default=1024)
    parser.add_argument(
        "--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64, 1024]
    )
    return standalone(parser, argv, run, report)


if __name__ == "__main__":
    raise SystemExit(main())
