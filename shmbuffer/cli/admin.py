"""The commands that talk to a running daemon as an admin client: ``stop``, ``status``
(``--watch``: a live view on a terminal), ``configure`` (the rate limiter) and ``checkpoint``
(with a progress bar on a terminal).

Each opens one admin :class:`~shmbuffer.clients.connection.Connection`, imported when the
command runs (the other commands, ``start`` above all, never load the client side). Part of
the command line (:mod:`shmbuffer.cli`), above both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from shmbuffer import runtime
from shmbuffer.cli.statusview import LiveStatus, format_status
from shmbuffer.errors import ShmBufferError


def _admin(name: str, timeout: float = 5.0) -> Any:
    from shmbuffer.clients.connection import Connection

    return Connection(name, "admin", timeout=timeout)


# -- stop ---------------------------------------------------------------------------------


def cmd_stop(args: argparse.Namespace) -> int:
    """Ask the daemon to shut down; ``--name`` is a buffer name or an endpoint, as for
    ``status``. A daemon found by name that refuses (tcp without CURVE) or does not answer is
    sent SIGTERM; one found by endpoint only is not (its pid may be another host's)."""
    from shmbuffer.clients.connection import is_remote_target

    target, pid, by_name = args.name, None, "://" not in args.name
    if by_name:
        info = runtime.read(target)
        if info is None or runtime.is_stale(info):
            print(f"no daemon serves {target!r}", file=sys.stderr)
            return 1
        pid = int(info["pid"])
    refused: ShmBufferError | None = None
    try:
        conn = _admin(target)
        try:
            pid = conn.daemon_pid if pid is None else pid
            conn.call("shutdown", keep=args.keep)
        finally:
            conn.close()
    except ShmBufferError as exc:
        refused = exc
    if refused is not None:
        if not by_name or pid is None:
            print(f"cannot stop {target}: {refused}", file=sys.stderr)
            return 1
        print(f"the daemon did not stop on request ({refused}); sending SIGTERM", file=sys.stderr)
        os.kill(pid, signal.SIGTERM)
    assert pid is not None
    if not by_name and is_remote_target(target):
        print(f"asked the daemon at {target} (pid {pid} on its host) to stop")
        return 0
    deadline = time.monotonic() + args.timeout
    while runtime.pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if runtime.pid_alive(pid):
        print(f"pid {pid} still running after {args.timeout}s", file=sys.stderr)
        return 1
    print(f"stopped {target!r} (pid {pid})")
    return 0


# -- status -------------------------------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    """One status; with ``--watch`` one every SECONDS: a live rich view on a terminal, plain
    text frames otherwise (a pipe, a log file), JSON lines with ``--json``."""
    live = args.watch is not None and not args.json and sys.stdout.isatty()
    if live:
        try:
            import rich  # noqa: F401
        except ImportError:
            print(
                "shmbuffer-daemon status --watch: the live view needs rich, which is not "
                "installed: pip install 'shmbuffer[live]' (piped, --watch prints plain text)",
                file=sys.stderr,
            )
            return 1
    try:
        conn = _admin(args.name, timeout=args.timeout)
    except ShmBufferError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    try:
        if live:
            return _watch_live(conn, args.watch)
        while True:
            stats = conn.call("stats")["stats"]
            if args.json:
                print(json.dumps(stats))
            else:
                text = format_status(stats)
                print(f"\x1b[H\x1b[2J{text}" if args.watch else text, flush=True)
            if not args.watch:
                return 0
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
    except ShmBufferError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    finally:
        conn.close()


def _watch_live(conn: Any, every: float) -> int:
    """Redraw the live view (statusview.LiveStatus) in place every ``every`` seconds until
    Ctrl-C; the last frame stays on the screen."""
    from rich.console import Console
    from rich.live import Live

    view = LiveStatus()
    with Live(
        view.render(conn.call("stats")["stats"]), console=Console(), auto_refresh=False
    ) as live:
        while True:
            time.sleep(every)
            live.update(view.render(conn.call("stats")["stats"]), refresh=True)


# -- configure ----------------------------------------------------------------------------


def cmd_configure(args: argparse.Namespace) -> int:
    """Change a table's rate limiter's settings live (``--table``; the default table's
    without it); prints the limiter as it is now."""
    settings = {
        name: value
        for name, value in (
            ("samples_per_insert", args.samples_per_insert),
            ("min_size", args.min_size),
            ("error_buffer", args.error_buffer),
        )
        if value is not None
    }
    if not settings:
        print(
            "shmbuffer-daemon configure: give at least one of --samples-per-insert, "
            "--min-size, --error-buffer",
            file=sys.stderr,
        )
        return 2
    if args.table is not None:
        settings["table"] = args.table
    conn = _admin(args.name, timeout=args.timeout)
    try:
        limiter = conn.call("configure", **settings)["rate_limiter"]
    except ShmBufferError as exc:  # the wire names each setting by its field: say the flag
        message = str(exc)
        for name in settings:
            if name != "table":  # the word of the message, not the flag's
                message = message.replace(name, "--" + name.replace("_", "-"))
        raise type(exc)(message) from None
    finally:
        conn.close()
    changed = ", ".join(f"{k}={v:g}" for k, v in limiter["settings"].items())
    table = "" if args.table is None else f", table {args.table!r}"
    print(f"rate limiter of {args.name!r}{table}: {limiter['kind']}({changed})")
    return 0


# -- checkpoint ---------------------------------------------------------------------------


def cmd_checkpoint(args: argparse.Namespace) -> int:
    from shmbuffer.clients.admin import checkpoint
    from shmbuffer.storage import progress

    dest = os.path.abspath(args.to)
    total, measure = _checkpoint_measure(args, dest) if progress.enabled() else (0, lambda: 0)
    reply = progress.wait_with_progress(
        "checkpoint", total, measure, lambda: checkpoint(args.name, dest, timeout=args.timeout)
    )
    print(
        f"checkpoint of {args.name!r} at {reply['path']}: {reply['bytes'] / 1e6:.1f} MB "
        f"in {reply['seconds']:.2f}s ({reply['copied_bytes'] / 1e6:.1f} MB copied, "
        f"{reply['linked_bytes'] / 1e6:.1f} MB unchanged and linked; the daemon paused at most "
        f"{reply['max_pause_ms']:.1f} ms)"
    )
    return 0


def _checkpoint_measure(args: argparse.Namespace, dest: str) -> tuple[int, Callable[[], int]]:
    """(bytes to copy, bytes copied so far) of a checkpoint the daemon is writing to ``dest``:
    its segment's rows and stamps against the chunk files in the checkpoint's temp folder
    (linked chunks count whole at once). (0, ...) when either cannot be read (no bar then)."""
    from pathlib import Path

    from shmbuffer.daemon.checkpoint import CHUNKS
    from shmbuffer.storage.segment import MANIFEST

    try:
        conn = _admin(args.name, timeout=args.timeout)
        try:
            segment = conn.call("stats")["stats"]["segment"]
        finally:
            conn.close()
        manifest = json.loads((Path(segment["path"]) / MANIFEST).read_text())
        regions = [*manifest["columns"].values(), manifest["generations"]]
        total = sum(int(region["nbytes"]) for region in regions)
    except (ShmBufferError, OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0, lambda: 0

    def measure() -> int:
        try:
            return sum(p.stat().st_size for p in Path(dest).glob(f".tmp-*/{CHUNKS}/*"))
        except OSError:  # renamed into place between the glob and the stat
            return total

    return total, measure
