"""``python -m bench [SCENARIO ... | --all] [--quick] [--repeat K] [--workers N,N,...] [--out DIR]
[--plot] [--readme [--force]] [--list]``.

``python -m bench --all --readme`` runs every scenario and writes the JSON, the markdown, the
plots and the README's benchmark section (:mod:`bench.readme`) from that one run."""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import signal
import sys
import tempfile
from pathlib import Path

from bench import (  # noqa: F401  (register the scenarios)
    atari,
    cluster,
    compressed,
    contention,
    core,
    daemon,
    memory,
    queries,
    report,
    rollout,
    runs,
    sampling,
    service_ops,
)
from bench.registry import QUICK_WORKER_COUNTS, SCENARIOS, WORKER_COUNTS, Context

#: The scenarios whose worker (writer) process counts ``--workers`` sets.
WORKER_SCENARIOS = ("rollout", "contention")
MAX_OP_SECONDS = 5.0
#: --quick's cap: a peer's slow op (TorchRL's sample of image rows, ~0.1-1 s a call on two
#: busy cores) would otherwise spend 5 s apiece of a run that only checks it works.
QUICK_MAX_OP_SECONDS = 1.0


def worker_counts(text: str) -> tuple[int, ...]:
    """``--workers``'s value: distinct positive integers separated by commas, in rising order
    (``"4,8,14"`` -> ``(4, 8, 14)``)."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isascii() and p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(
            f"expected positive integers separated by commas (e.g. 4,8,14), got {text!r}"
        )
    counts = [int(p) for p in parts]
    twice = sorted({n for n in counts if counts.count(n) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{text!r} gives {twice[0]} more than once")
    return tuple(sorted(counts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("scenarios", nargs="*", help="names or prefixes (default: all)")
    parser.add_argument("--quick", action="store_true", help="sizes shrunk about 20x")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for results.{json,md} and plots (default bench/results; with --readme "
        "docs/bench, tracked, since the README links its plots)",
    )
    parser.add_argument("--plot", action="store_true", help="a PNG figure per scenario")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument("--all", action="store_true", help="every scenario (as giving none)")
    parser.add_argument(
        "--repeat",
        type=int,
        default=None,
        metavar="K",
        help="runs of each scenario, folded into median and min-max (default 3; 1 with --quick)",
    )
    parser.add_argument(
        "--workers",
        type=worker_counts,
        default=None,
        metavar="N,N,...",
        help="worker (writer) process counts of "
        f"{' and '.join(WORKER_SCENARIOS)}, one timed pass each (default "
        f"{','.join(map(str, WORKER_COUNTS))}; {','.join(map(str, QUICK_WORKER_COUNTS))} "
        "with --quick)",
    )
    parser.add_argument(
        "--readme",
        action="store_true",
        help="also write the README's benchmark section (needs every scenario; implies --plot; "
        "refused when the machine is busy, see bench/machine.py)",
    )
    parser.add_argument(
        "--readme-file", type=Path, default=Path("README.md"), help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--force", action="store_true", help="--readme even when busy or with --quick"
    )
    parser.add_argument("--tmpdir", default=tempfile.gettempdir(), help="scratch for memmap peers")
    parser.add_argument(
        "--shm-dir",
        default=None,
        help="folder for the daemons' segments (default /dev/shm): a tmpfs mounted "
        "huge=within_size measures shared rows on 2 MiB pages (docs/architecture.md)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: copies are "
        "compared single-threaded, and 2 OpenMP threads collapse on a busy 2-core machine)",
    )
    parser.add_argument(
        "--max-op-seconds",
        type=float,
        default=None,
        help=f"cap per timed op (default {MAX_OP_SECONDS:g} s; {QUICK_MAX_OP_SECONDS:g} s with "
        "--quick, which checks that each op runs and is sane, not how fast)",
    )
    parser.add_argument(
        "--create-gb",
        type=float,
        default=4.0,
        help="GB (1e9 B) of the buffer core.create makes, default 4; for the 10 GB target: "
        "`python -m bench core.create --create-gb 10 --repeat 1`, with nothing else big running",
    )
    parser.add_argument(
        "--atari-transitions",
        type=int,
        default=100_000,
        help="transitions images.atari stores, default 100,000; for the 1M figure: "
        "`python -m bench images.atari --atari-transitions 1000000 --repeat 1` (~7 GB each)",
    )
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = Path("docs/bench" if args.readme else "bench/results")
    if args.max_op_seconds is None:
        args.max_op_seconds = QUICK_MAX_OP_SECONDS if args.quick else MAX_OP_SECONDS
    if args.max_op_seconds <= 0:
        parser.error(f"--max-op-seconds must be positive, got {args.max_op_seconds:g}")
    if args.create_gb <= 0:
        parser.error(f"--create-gb must be positive, got {args.create_gb:g}")
    if args.atari_transitions < 1:
        parser.error(f"--atari-transitions must be positive, got {args.atari_transitions}")

    if args.list:
        for name, fn in SCENARIOS.items():
            print(f"{name:24} {(fn.__doc__ or '').strip().splitlines()[0]}")
        return 0
    wanted = args.scenarios or list(SCENARIOS)
    names = [n for n in SCENARIOS if any(n == w or n.startswith(w + ".") for w in wanted)]
    unknown = [w for w in wanted if not any(n == w or n.startswith(w + ".") for n in SCENARIOS)]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; known: {list(SCENARIOS)}")
    if args.all and args.scenarios:
        parser.error(f"--all runs every scenario: give --all or names, not both ({args.scenarios})")
    if args.workers and not any(n.split(".")[0] in WORKER_SCENARIOS for n in names):
        parser.error(
            f"--workers sets the worker counts of {' and '.join(WORKER_SCENARIOS)}, and "
            f"neither is among the scenarios to run ({names})"
        )
    repeat = args.repeat if args.repeat is not None else (1 if args.quick else 3)
    if repeat < 1:
        parser.error(f"--repeat must be >= 1, got {repeat}")
    from bench import harness, machine

    harness.FORK_DAEMONS = args.quick  # see harness.FORK_DAEMONS

    load0 = os.getloadavg()[0]
    if args.readme:
        if args.scenarios:
            parser.error("--readme writes the table of every scenario: use --all, not names")
        if args.quick and not args.force:
            parser.error("--readme with --quick would put shrunk sizes in the README (--force)")
        busy = machine.too_busy(load0, {})
        if busy and not args.force:
            print(
                f"refusing --readme: {busy}; wait for a quiet machine or --force", file=sys.stderr
            )
            return 2

    # SIGTERM unwinds like Ctrl-C: every daemon and child is stopped by its with block.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    import torch

    torch.set_num_threads(args.threads)
    ctx = Context(
        quick=args.quick,
        tmpdir=args.tmpdir,
        max_op_seconds=args.max_op_seconds,
        create_gb=args.create_gb,
        atari_transitions=args.atari_transitions,
        workers=args.workers,
        shm_dir=args.shm_dir,
    )
    if args.shm_dir:
        ctx.note("all", f"the daemons' segments in {args.shm_dir} (--shm-dir), not /dev/shm")
    started = datetime.datetime.now(datetime.UTC)
    rows, scenarios = runs.run(names, ctx, repeat)
    report.add_ratios(rows)
    report.add_winners(rows)
    load = f"{load0:.2f},{os.getloadavg()[0]:.2f}"
    argv_shown = sys.argv[1:] if argv is None else argv
    info = report.meta(
        args.quick,
        args.tmpdir,
        args.threads,
        load,
        command=shlex.join(["python", "-m", "bench", *argv_shown]),
        date=started.strftime("%Y-%m-%d %H:%M UTC"),
        repeat=repeat,
        scenarios=scenarios,
    )
    report.print_tables(rows, ctx.notes, info)
    report.write(args.out, rows, ctx.notes, info)
    plots = []
    if args.plot or args.readme:
        from bench.plot import plot

        plots = plot(rows, args.out)
        for path in plots:
            print(f"plot: {path}")
    print(f"results: {args.out / 'results.json'}, {args.out / 'results.md'}")
    if args.readme:
        busy = machine.too_busy(load0, scenarios)
        if busy and not args.force:
            print(f"README not written: {busy} (--force writes it anyway)", file=sys.stderr)
            return 2
        from bench import readme

        readme.write(
            args.readme_file, readme.section(rows, info, args.out, plots, args.readme_file)
        )
        print(f"readme: {args.readme_file}")
    return 0
