"""``python -m bench [SCENARIO ...] [--quick] [--out DIR] [--plot] [--list]``."""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from bench import core, daemon, report, sampling  # noqa: F401  (register the scenarios)
from bench.registry import SCENARIOS, Context, Row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("scenarios", nargs="*", help="names or prefixes (default: all)")
    parser.add_argument("--quick", action="store_true", help="sizes shrunk about 20x")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--plot", action="store_true", help="a PNG bar chart per scenario")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument("--tmpdir", default=tempfile.gettempdir(), help="scratch for memmap peers")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: copies are "
        "compared single-threaded, and 2 OpenMP threads collapse on a busy 2-core machine)",
    )
    parser.add_argument("--max-op-seconds", type=float, default=5.0, help="cap per timed op")
    args = parser.parse_args(argv)

    if args.list:
        for name, fn in SCENARIOS.items():
            print(f"{name:24} {(fn.__doc__ or '').strip().splitlines()[0]}")
        return 0
    wanted = args.scenarios or list(SCENARIOS)
    names = [n for n in SCENARIOS if any(n == w or n.startswith(w + ".") for w in wanted)]
    unknown = [w for w in wanted if not any(n == w or n.startswith(w + ".") for n in SCENARIOS)]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; known: {list(SCENARIOS)}")

    import torch

    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()[0]
    ctx = Context(quick=args.quick, tmpdir=args.tmpdir, max_op_seconds=args.max_op_seconds)
    rows: list[Row] = []
    for name in names:
        t0 = time.perf_counter()
        rows += SCENARIOS[name](ctx)
        print(f"# {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    report.add_ratios(rows)
    load = f"{load0:.2f},{os.getloadavg()[0]:.2f}"
    info = report.meta(args.quick, args.tmpdir, args.threads, load)
    report.print_tables(rows, ctx.notes, info)
    report.write(args.out, rows, ctx.notes, info)
    if args.plot:
        from bench.plot import plot

        for path in plot(rows, args.out):
            print(f"plot: {path}")
    print(f"results: {args.out / 'results.json'}, {args.out / 'results.md'}")
    return 0
