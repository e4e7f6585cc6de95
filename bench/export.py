"""A live buffer exported to Parquet, beside the disk's own ``dd`` figure, in the same run.

``python -m bench.export [--gb 0.1] [--to /var/tmp] [--rounds 2] [--json FILE]``

A daemon owns a ``--gb`` buffer of Atari-like rows (``bench.data.ATARI_SPEC``, 28 KB a row)
under /dev/shm, filled once round. Then, ``--rounds`` times, alternating: ``dd
if=/dev/zero bs=64M oflag=direct conv=fsync`` of as many bytes as the buffer's rows into
``--to``, and ``export_live`` of the buffer to ``parquet:<--to>/...`` (what ``shmbuffer-daemon
export --name N --to parquet:DIR`` runs: the daemon's cut into a spool beside its segment,
each chunk file converted as the copy finishes it, one Parquet file per 64 MB of episodes,
each fsynced behind the next). The figure is the rows' bytes over the export's whole time,
cut included; the target is >= 0.8x dd's (a 1 GB buffer at >= 0.8x the disk's own dd
figure): ``--gb 1`` for that. Everything it
wrote is removed at the end, also after an error. Needs about 2x ``--gb`` free in /dev/shm
and ``--gb`` in ``--to``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import data
from bench.checkpoint import EPISODE, SPEC, write_rows
from bench.harness import running_daemon, standalone

BS = 64 << 20


def dd_gb_s(folder: str, nbytes: int) -> float:
    """GB/s of ``dd`` writing ``nbytes`` (whole 64 MB blocks, at least 4) into ``folder``."""
    target = os.path.join(folder, f"ddtest-{os.getpid()}")
    count = max(4, -(-nbytes // BS))
    argv = ["dd", "if=/dev/zero", f"of={target}", "bs=64M", f"count={count}"]
    argv += ["oflag=direct", "conv=fsync"]
    try:
        t0 = time.perf_counter()
        out = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=600)
        seconds = time.perf_counter() - t0
    finally:
        if os.path.exists(target):
            os.unlink(target)
    match = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", out.stderr)
    if match:  # dd's own timing, without its start-up
        return int(match.group(1)) / float(match.group(2)) / 1e9
    return count * BS / seconds / 1e9


def run(args: argparse.Namespace) -> dict[str, Any]:
    from shmbuffer.offline.export import export_live

    row = data.row_bytes(SPEC)
    capacity = max(EPISODE, int(args.gb * 1e9) // (row + 8) // EPISODE * EPISODE)
    storage = tempfile.mkdtemp(prefix="shmbuffer-bench-export-", dir="/dev/shm")
    runtime = tempfile.mkdtemp(prefix="sbex-", dir="/tmp")
    os.environ["SHMBUFFER_RUNTIME_DIR"] = runtime
    out = Path(tempfile.mkdtemp(prefix="shmbuffer-export-", dir=args.to))
    result: dict[str, Any] = {"gb": capacity * row / 1e9, "to": args.to, "rounds": []}
    try:
        with running_daemon(storage, capacity, "transition", spec=SPEC) as name:
            write_rows(name, capacity)
            for k in range(args.rounds):
                dd = dd_gb_s(args.to, capacity * row)
                done = export_live(name, f"parquet:{out / f'round{k}'}")
                shutil.rmtree(out / f"round{k}", ignore_errors=True)
                result["rounds"].append(
                    {
                        "dd_gb_s": dd,
                        "export_gb_s": done["bytes"] / done["seconds"] / 1e9,
                        "seconds": done["seconds"],
                        "cut_seconds": done["cut_seconds"],
                        "episodes": done["episodes"],
                    }
                )
    finally:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(storage, ignore_errors=True)
        shutil.rmtree(runtime, ignore_errors=True)
    best = max(result["rounds"], key=lambda r: r["export_gb_s"])
    result["ratio"] = best["export_gb_s"] / max(r["dd_gb_s"] for r in result["rounds"])
    return result


def report(result: dict[str, Any]) -> str:
    lines = [
        f"export of a {result['gb']:.2f} GB buffer to Parquet in {result['to']} "
        "(python -m bench.export), beside dd to the same folder:"
    ]
    for k, r in enumerate(result["rounds"]):
        lines.append(
            f"  round {k}: export {r['export_gb_s']:.3f} GB/s ({r['seconds']:.2f} s, the cut's "
            f"copy {r['cut_seconds']:.2f} s under it, {r['episodes']} episodes); "
            f"dd {r['dd_gb_s']:.3f} GB/s"
        )
    lines.append(f"  best export / best dd: {result['ratio']:.2f}x (target >= 0.8x)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.export", description=__doc__)
    parser.add_argument("--gb", type=float, default=0.1, help="buffer size, GB (1 for the target)")
    parser.add_argument("--to", default="/var/tmp", help="folder on the disk measured")
    parser.add_argument("--rounds", type=int, default=2)
    return standalone(parser, argv, run, report)


if __name__ == "__main__":
    raise SystemExit(main())
