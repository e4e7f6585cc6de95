"""``shmbuffer-daemon``: start, stop, status, configure, checkpoint, cleanup, keygen, demo.

The command line sits above both sides: it launches the daemon and talks to it as a client.
This module is the parser, its flag types and ``main`` (the console entry point), and the
commands that need no daemon; the others live by job, and keep their names here:
:mod:`shmbuffer.cli.start` runs a daemon (``start``, ``run_daemon``),
:mod:`shmbuffer.cli.admin` talks to a running one (``stop``, ``status``, ``configure``,
``checkpoint``), :mod:`shmbuffer.cli.demo` runs a daemon and its demo processes.

Only ``start`` (and the processes ``demo`` starts) import torch, seconds of CPU:
``status``, ``stop``, ``configure`` and ``keygen`` answer in a fraction of a second
(tests/test_import_cost.py pins it).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import select
import signal
import sys
from typing import Any

from shmbuffer.cli.admin import cmd_checkpoint, cmd_configure, cmd_status, cmd_stop
from shmbuffer.cli.episodes import cmd_episodes
from shmbuffer.cli.offline import cmd_export
from shmbuffer.cli.start import cmd_start, run_daemon
from shmbuffer.errors import ShmBufferError
from shmbuffer.samplers import OPTIONS, RATE_LIMITERS, SAMPLERS, Option, takers
from shmbuffer.wire import curve

__all__ = [
    "build_parser",
    "cmd_checkpoint",
    "cmd_cleanup",
    "cmd_configure",
    "cmd_demo",
    "cmd_export",
    "cmd_keygen",
    "cmd_start",
    "cmd_status",
    "cmd_stop",
    "main",
    "run_daemon",
]


# -- the commands that need no daemon -----------------------------------------------------


def cmd_keygen(args: argparse.Namespace) -> int:
    public, secret = curve.keygen(args.out, args.name, force=args.force)
    print(f"public key:  {public}  (give to the other side)")
    print(f"secret key:  {secret}  (mode 0600; keep private)")
    return 0


def cmd_cleanup(args: argparse.Namespace) -> int:
    from shmbuffer.daemon.recovery import cleanup

    removed = cleanup(args.storage_dir, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for path in removed:
        print(f"{verb} {path}")
    if not removed:
        print("nothing to clean up")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from shmbuffer.cli.demo import cmd_demo as run_demo

    return run_demo(args)


# -- parser -------------------------------------------------------------------------------


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (``nan``, ``inf``, 0 and negatives are usage
    errors, not a crash later: ``--watch -1`` used to fail in ``time.sleep``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(
            f"must be a positive, finite number of seconds, got {text!r}"
        )
    return value


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _meta_kind(text: str) -> tuple[str, str]:
    name, sep, kind = text.partition(":")
    if not sep or not name or not kind:
        raise argparse.ArgumentTypeError(f"expected NAME:KIND (ret:float), got {text!r}")
    return name, kind


def _add_limiter_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--min-size", type=int, default=None, help="rows stored before any sample (default 1)"
    )
    parser.add_argument(
        "--samples-per-insert",
        type=_finite,
        default=None,
        help="sample-to-insert: rows sampled per row inserted",
    )
    parser.add_argument(
        "--error-buffer",
        type=_finite,
        default=None,
        help="sample-to-insert: slack around the ratio, in sampled rows (>= max(1, ratio))",
    )


def _sampler_help(option: Option[Any]) -> str:
    """An option's help, led by the samplers that take it (unless every one does) and ended
    by its default (unless that is "not set")."""
    names = takers(option)
    lead = "" if len(names) == len(SAMPLERS) else ", ".join(names) + ": "
    default = "" if option.default is None else f" ({option.default})"
    return lead + option.help + default


def _add_sampler_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=None, help="seeds every draw")
    parser.add_argument(
        "--sampler",
        choices=tuple(SAMPLERS),
        default=None,
        metavar="NAME",
        help="how reads pick: %(choices)s (default uniform)",
    )
    for option in OPTIONS:  # as each sampler declares them; None: the sampler's default
        parser.add_argument(
            option.flag,
            type=_finite if option.type is float else int,
            default=None,
            help=_sampler_help(option),
        )
    parser.add_argument(
        "--rate-limiter",
        choices=tuple(RATE_LIMITERS),
        default=None,
        metavar="NAME",
        help="flow control between inserts and samples: %(choices)s (default none)",
    )
    _add_limiter_flags(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shmbuffer-daemon", description="Run and inspect a shmbuffer replay-buffer daemon."
    )
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    start = sub.add_parser("start", help="start a daemon (foreground unless --detach)")
    start.add_argument("--config", help="TOML file with the settings below")
    start.add_argument("--name", default=None, help="buffer name (default: default)")
    start.add_argument("--capacity", type=int, default=None, help="rows (default: 100000)")
    start.add_argument("--unit", choices=("transition", "episode"), default=None)
    start.add_argument("--mode", choices=("circular", "fixed"), default=None)
    start.add_argument("--schema", help="TOML or JSON file: keys -> dtype, shape")
    start.add_argument(
        "--meta",
        action="append",
        type=_meta_kind,
        default=None,
        metavar="NAME:KIND",
        help="declare an episode metadata name (repeat; kinds int, float, bool, str): then "
        "no other name is taken (default: taken as writers give them)",
    )
    start.add_argument("--endpoint", help="ipc://PATH or tcp://HOST:PORT")
    start.add_argument(
        "--storage-dir", help="folder for the segment (default /dev/shm/shmbuffer-<uid>)"
    )
    start.add_argument("--lease-ttl", type=_seconds, default=None)
    start.add_argument("--reservation-ttl", type=_seconds, default=None)
    start.add_argument("--keep", action="store_true", help="keep the segment when stopping")
    start.add_argument("--detach", action="store_true", help="run in the background")
    start.add_argument("--ready-timeout", type=_seconds, default=30.0)
    start.add_argument(
        "--group", help="group NAME or GID that may use the segment and ipc socket (0660)"
    )
    start.add_argument(
        "--curve-secret", help="CURVE server secret certificate (keygen's NAME.key_secret)"
    )
    start.add_argument("--curve-clients", help="folder of allowed client public keys (*.key)")
    start.add_argument(
        "--insecure-tcp",
        action="store_true",
        default=None,
        help="allow a non-loopback tcp endpoint without CURVE (anyone can connect)",
    )
    start.add_argument(
        "--insecure-tcp-admin",
        action="store_true",
        default=None,
        help="allow clear/shutdown/checkpoint on a tcp endpoint without CURVE (any client)",
    )
    start.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="P",
        help="serve Prometheus metrics on http://HOST:P/metrics (0: any free port; "
        "needs the live extra)",
    )
    start.add_argument(
        "--metrics-host", default=None, help="address for --metrics-port (default 127.0.0.1)"
    )
    start.add_argument(
        "--device",
        default=None,
        metavar="D",
        help="where the rows live: cpu (default), cuda or cuda:N (GPU memory shared with "
        "clients by CUDA IPC; docs/cuda.md)",
    )
    start.add_argument(
        "--pin-memory",
        action="store_true",
        default=None,
        help="CPU buffer page-locked in every reader with CUDA, for full-speed host -> device "
        "copies of its rows",
    )
    start.add_argument(
        "--compressed-bytes",
        type=int,
        default=None,
        metavar="N",
        help='the byte store of the schema\'s compressed columns (compress = "zstd"), in '
        "bytes (docs/compression.md)",
    )
    _add_sampler_flags(start)
    start.add_argument(
        "--table",
        action="append",
        default=None,
        metavar="NAME:SAMPLER[,OPTION=VALUE...]",
        help="a table over the rows, with its own sampler and rate limiter (repeatable; the "
        "first is the default one), e.g. replay:prioritized,priority-exponent=0.6 or "
        "online:fifo,max-times-sampled=1; options as the flags above spell them, without "
        "--, the limiter's too (rate-limiter=sample-to-insert,samples-per-insert=4). Without "
        "it one table, default, of --sampler and its kin, which go inside --table with it "
        "(docs/tables.md)",
    )
    recover = start.add_mutually_exclusive_group()
    recover.add_argument(
        "--resume",
        action="store_true",
        help="re-attach the segment and registry a dead daemon of this name left behind",
    )
    recover.add_argument("--restore", metavar="DIR", help="start from the checkpoint in DIR")
    recover.add_argument(
        "--import",
        dest="import_from",
        metavar="parquet:DIR|minari:ID",
        help="start with a dataset's episodes (its schema and metadata too; docs/offline.md)",
    )
    start.set_defaults(func=cmd_start)

    keygen = sub.add_parser("keygen", help="write a CURVE keypair (NAME.key, NAME.key_secret)")
    keygen.add_argument("--out", required=True, help="folder for the key files")
    keygen.add_argument("--name", default="server", help="file name stem (server, client, ...)")
    keygen.add_argument("--force", action="store_true", help="replace existing key files")
    keygen.set_defaults(func=cmd_keygen)

    ckpt = sub.add_parser("checkpoint", help="write the buffer to DIR/checkpoint")
    ckpt.add_argument("--name", default="default")
    ckpt.add_argument("--to", required=True, help="folder (on the daemon's machine)")
    ckpt.add_argument("--timeout", type=_seconds, default=600.0)
    ckpt.set_defaults(func=cmd_checkpoint)

    export = sub.add_parser(
        "export", help="write a buffer's episodes to Parquet or Minari (docs/offline.md)"
    )
    export.add_argument("--name", default=None, help="a running daemon's buffer (a live cut)")
    export.add_argument("--checkpoint", metavar="DIR", help="or a checkpoint folder")
    export.add_argument("--to", required=True, metavar="parquet:DIR|minari:ID")
    export.add_argument(
        "--spool",
        metavar="DIR",
        help="where the live cut is written first (default: beside "
        "the segment where there is room, else beside the destination)",
    )
    export.add_argument("--timeout", type=_seconds, default=600.0)
    export.set_defaults(func=cmd_export)

    configure = sub.add_parser("configure", help="change a running daemon's rate limiter (admin)")
    configure.add_argument("--name", default="default", help="buffer name, or an endpoint")
    _add_limiter_flags(configure)
    configure.add_argument(
        "--table", default=None, metavar="NAME", help="whose limiter (default: the default table's)"
    )
    configure.add_argument("--timeout", type=_seconds, default=5.0)
    configure.set_defaults(func=cmd_configure)

    clean = sub.add_parser("cleanup", help="remove segments and runtime files of dead daemons")
    clean.add_argument(
        "--storage-dir", help="segment folder root (default /dev/shm/shmbuffer-<uid>)"
    )
    clean.add_argument("--dry-run", action="store_true", help="only print what would go")
    clean.set_defaults(func=cmd_cleanup)

    stop = sub.add_parser("stop", help="stop a daemon cleanly")
    stop.add_argument("--name", default="default", help="buffer name, or an endpoint")
    stop.add_argument("--keep", action="store_true", help="keep the segment")
    stop.add_argument("--timeout", type=_seconds, default=10.0)
    stop.set_defaults(func=cmd_stop)

    status = sub.add_parser("status", help="show a daemon's state")
    status.add_argument("--name", default="default")
    status.add_argument("--json", action="store_true")
    status.add_argument(
        "--watch",
        type=_seconds,
        nargs="?",
        const=1.0,
        default=None,
        metavar="SECONDS",
        help="redraw every SECONDS (1): a live view on a terminal (the live extra), plain "
        "text frames otherwise",
    )
    status.add_argument("--timeout", type=_seconds, default=5.0)
    status.set_defaults(func=cmd_status)

    episodes = sub.add_parser(
        "episodes", help="list the live episodes a metadata filter selects (docs/metadata.md)"
    )
    episodes.add_argument("--name", default="default", help="buffer name, or an endpoint")
    episodes.add_argument(
        "--where", default=None, help="a filter: \"ret > 100 and env_id == 'e3'\" (default: all)"
    )
    episodes.add_argument(
        "--order-by", default=None, metavar="NAME", help="a name, -NAME descending (default: id)"
    )
    episodes.add_argument("--limit", type=int, default=20, help="at most this many (20)")
    episodes.add_argument("--json", action="store_true", help="one JSON object per episode")
    episodes.add_argument("--timeout", type=_seconds, default=5.0)
    episodes.set_defaults(func=cmd_episodes)

    demo = sub.add_parser("demo", help="a daemon, writers and learners on synthetic data")
    demo.add_argument("--name", default=None)
    demo.add_argument("--writers", type=int, default=4)
    demo.add_argument("--learners", type=int, default=1)
    demo.add_argument("--seconds", type=float, default=10.0)
    demo.add_argument("--capacity", type=int, default=50_000)
    demo.add_argument("--episode-len", type=int, default=200)
    demo.add_argument("--obs-shape", default="4,84,84")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # here, not at exit, where a closed pipe would only be reported
        return code
    except BrokenPipeError as exc:
        if not _stdout_reader_gone():
            print(f"shmbuffer-daemon: {exc}", file=sys.stderr)
            return 1
        return _quiet_exit_on_closed_stdout()
    except (ShmBufferError, ValueError, OSError) as exc:
        print(f"shmbuffer-daemon: {exc}", file=sys.stderr)
        return 1


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe nobody reads any more (``| head`` that has its lines): the
    kernel flags its write end with POLLERR. A broken pipe of anything else (a socket to the
    daemon) is an error worth reporting."""
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _quiet_exit_on_closed_stdout() -> int:
    """End as a Unix tool killed by SIGPIPE looks to its shell: nothing on stderr, status
    128 + SIGPIPE. Python ignores SIGPIPE so that sockets raise instead of killing the
    process, and it must stay so; stdout is pointed at /dev/null so that the interpreter's
    last flush of the unwritten text does not report the pipe again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
