"""``shmbuffer-daemon``: start, stop, status, configure, checkpoint, cleanup, keygen, demo.

The command line sits above both sides: it launches the daemon and talks to it as a client.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from shmbuffer import curve, runtime
from shmbuffer.daemon import security
from shmbuffer.daemon.config import DaemonConfig, load_schema_file
from shmbuffer.errors import ConfigError, ShmBufferError
from shmbuffer.protocol import PROTOCOL_VERSION
from shmbuffer.runtime import runtime_dir
from shmbuffer.samplers import RATE_LIMITERS, SAMPLERS
from shmbuffer.statusview import LiveStatus, format_status

if TYPE_CHECKING:
    from shmbuffer.daemon.metrics import MetricsServer

log = logging.getLogger("shmbuffer.daemon")


def _admin(name: str, timeout: float = 5.0) -> Any:
    from shmbuffer.clients.connection import Connection

    return Connection(name, "admin", timeout=timeout)


# -- start --------------------------------------------------------------------------------


def cmd_start(args: argparse.Namespace) -> int:
    config = DaemonConfig.load(
        args.config,
        name=args.name,
        capacity=args.capacity,
        unit=args.unit,
        mode=args.mode,
        schema=load_schema_file(args.schema) if args.schema else None,
        endpoint=args.endpoint,
        storage_dir=args.storage_dir,
        lease_ttl=args.lease_ttl,
        reservation_ttl=args.reservation_ttl,
        group=args.group,
        curve_secret=args.curve_secret,
        curve_clients=args.curve_clients,
        insecure_tcp=args.insecure_tcp,
        insecure_tcp_admin=args.insecure_tcp_admin,
        seed=args.seed,
        sampler=args.sampler,
        priority_exponent=args.priority_exponent,
        importance_exponent=args.importance_exponent,
        priority_eps=args.priority_eps,
        max_times_sampled=args.max_times_sampled,
        rate_limiter=args.rate_limiter,
        min_size=args.min_size,
        samples_per_insert=args.samples_per_insert,
        error_buffer=args.error_buffer,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        device=args.device,
        pin_memory=args.pin_memory,
    )
    if config.device != "cpu" and (args.resume or args.restore):
        flag = "--resume" if args.resume else "--restore"
        raise ConfigError(
            f"--device {config.device} cannot be combined with {flag}: GPU memory does not "
            "outlive the daemon that allocated it, and checkpoints of a GPU buffer are not "
            "written (docs/cuda.md); start it afresh"
        )
    if args.resume or args.restore:  # capacity/unit/mode/schema come from what is loaded
        from shmbuffer.daemon.recovery import adopt_settings

        config = adopt_settings(config, args, args.restore)
    if args.detach:
        return _detach(args, config)
    return run_daemon(config, keep=args.keep, resume=args.resume, restore=args.restore)


def _claim_name(config: DaemonConfig, keep_segment: bool = False) -> None:
    """Refuse a name a live daemon serves; clear what a dead one left behind (its segment
    too, unless ``keep_segment``: ``--resume`` re-attaches it)."""
    info = runtime.read(config.name)
    if info is None:
        return
    if not runtime.is_stale(info):
        raise ShmBufferError(
            f"buffer {config.name!r} is already served by pid {info.get('pid')} at "
            f"{info.get('endpoint')}; stop it first (`shmbuffer-daemon stop --name {config.name}`)"
        )
    if keep_segment:
        log.warning(
            "replacing the stale runtime file of dead daemon pid %s; its segment and journal "
            "are kept and resumed, committed rows included",
            info.get("pid"),
        )
    else:
        log.warning(
            "removing the stale runtime file and segment of dead daemon pid %s, with the rows "
            "it had committed (`start --resume` would have served them again)",
            info.get("pid"),
        )
    runtime.remove(config.name)
    if not keep_segment:
        from shmbuffer.segment import Segment

        Segment.unlink(config.name, info.get("storage_dir"))


def run_daemon(
    config: DaemonConfig, keep: bool = False, resume: bool = False, restore: str | None = None
) -> int:
    """Serve ``config`` in this process until stopped; with ``metrics_port``, Prometheus
    metrics too (listening first: a busy port fails before a segment is allocated)."""
    if config.metrics_port is None:
        return _serve(config, keep, resume, restore, None)
    from shmbuffer.daemon.metrics import serve_metrics

    metrics = serve_metrics(config.metrics_host, config.metrics_port)
    try:
        return _serve(config, keep, resume, restore, metrics)
    finally:
        metrics.close()


def _serve(
    config: DaemonConfig,
    keep: bool,
    resume: bool,
    restore: str | None,
    metrics: MetricsServer | None,
) -> int:
    from shmbuffer.daemon.server import Server
    from shmbuffer.daemon.service import BufferService

    for warning in security.check_daemon_access(config):  # refuses an exposed tcp endpoint
        log.warning("%s", warning)
    _claim_name(config, keep_segment=resume)
    if resume or restore:  # see recovery.py
        from shmbuffer.daemon import recovery

        if resume:
            service = recovery.resume_service(config)
        else:
            assert restore is not None
            service = recovery.restore_service(config, restore)
    else:
        service = BufferService(config)
    server = Server(service, config.resolved_endpoint, metrics.metrics if metrics else None)
    server.install_signal_handlers()
    info = {
        "name": config.name,
        "endpoint": server.endpoint,
        "pid": os.getpid(),
        "storage_dir": config.storage_dir,
        "protocol": PROTOCOL_VERSION,
    }
    if metrics is not None:  # the port 0 chose is found here
        info["metrics"] = metrics.url
    runtime.write(config.name, info)
    _write_private(runtime_dir() / f"{config.name}.pid", f"{os.getpid()}\n".encode())
    security.share_runtime(config)  # with --group: the runtime dir and file become group-readable
    log.info(
        "buffer %r: %d rows, unit=%s, mode=%s, device=%s%s; listening on %s (pid %d)",
        config.name,
        config.capacity,
        config.unit,
        config.mode,
        config.device,
        " (pinned)" if config.pin_memory else "",
        server.endpoint,
        os.getpid(),
    )
    try:
        server.serve_forever()
    finally:
        server.close()
        keep = keep or server.keep_segment
        if not keep:
            from shmbuffer.segment import Segment

            Segment.unlink(config.name, config.storage_dir)
        runtime.remove(config.name, os.getpid())
        (runtime_dir() / f"{config.name}.pid").unlink(missing_ok=True)
        log.info("stopped%s", " (segment kept)" if keep else "")
    return 0


def _write_private(path: os.PathLike[str], data: bytes) -> None:
    """Write ``path`` owner-only (``0600``) whatever the umask; an existing file is tightened."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(data)


def _log_tail(path: os.PathLike[str], offset: int, lines: int = 20) -> str:
    """The last ``lines`` lines written to ``path`` after ``offset`` (what one run logged)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read()[-65536:].decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


def _detach(args: argparse.Namespace, config: DaemonConfig) -> int:
    argv = [a for a in sys.argv[1:] if a != "--detach"]
    logfile = runtime_dir() / f"{config.name}.log"
    fd = os.open(logfile, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)  # an older log made 0644 is tightened too: it names paths and clients
    with os.fdopen(fd, "ab") as out:
        offset = out.seek(0, os.SEEK_END)
        child = subprocess.Popen(
            [sys.executable, "-m", "shmbuffer.cli", *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    deadline = time.monotonic() + args.ready_timeout
    while time.monotonic() < deadline:
        if child.poll() is not None:
            tail = _log_tail(logfile, offset)
            print(f"the daemon exited with {child.returncode}; see {logfile}", file=sys.stderr)
            if tail:
                print(tail, file=sys.stderr)
            return 1
        info = runtime.read(config.name)
        if info is not None and info.get("pid") == child.pid:
            print(f"shmbuffer daemon {config.name!r} ready: pid {child.pid}, {info['endpoint']}")
            print(f"log: {logfile}")
            return 0
        time.sleep(0.05)
    child.terminate()
    print(f"the daemon did not become ready in {args.ready_timeout}s; see {logfile}")
    return 1


# -- keygen -------------------------------------------------------------------------------


def cmd_keygen(args: argparse.Namespace) -> int:
    public, secret = curve.keygen(args.out, args.name, force=args.force)
    print(f"public key:  {public}  (give to the other side)")
    print(f"secret key:  {secret}  (mode 0600; keep private)")
    return 0


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
    """Change the rate limiter's settings live; prints the limiter as it is now."""
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
    conn = _admin(args.name, timeout=args.timeout)
    try:
        limiter = conn.call("configure", **settings)["rate_limiter"]
    finally:
        conn.close()
    changed = ", ".join(f"{k}={v:g}" for k, v in limiter["settings"].items())
    print(f"rate limiter of {args.name!r}: {limiter['kind']}({changed})")
    return 0


# -- checkpoint, cleanup ------------------------------------------------------------------


def cmd_checkpoint(args: argparse.Namespace) -> int:
    from shmbuffer import progress
    from shmbuffer.clients.admin import checkpoint

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
    from shmbuffer.segment import MANIFEST

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
    from shmbuffer.demo import cmd_demo as run_demo  # torch is imported only when needed

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


def _add_sampler_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=None, help="seeds every draw")
    parser.add_argument(
        "--sampler", choices=tuple(SAMPLERS), default=None, help="how reads pick (default uniform)"
    )
    parser.add_argument(
        "--priority-exponent", type=_finite, default=None, help="prioritized: alpha (0.6)"
    )
    parser.add_argument(
        "--importance-exponent",
        type=_finite,
        default=None,
        help="prioritized: beta of the weights (0.4; per call too)",
    )
    parser.add_argument(
        "--priority-eps", type=_finite, default=None, help="prioritized: added to priorities"
    )
    parser.add_argument(
        "--max-times-sampled",
        type=int,
        default=None,
        help="retire an item after K samples; with fifo writers wait for unconsumed rows",
    )
    parser.add_argument(
        "--rate-limiter",
        choices=tuple(RATE_LIMITERS),
        default=None,
        help="flow control between inserts and samples (default none)",
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
    _add_sampler_flags(start)
    recover = start.add_mutually_exclusive_group()
    recover.add_argument(
        "--resume",
        action="store_true",
        help="re-attach the segment and registry a dead daemon of this name left behind",
    )
    recover.add_argument("--restore", metavar="DIR", help="start from the checkpoint in DIR")
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

    configure = sub.add_parser("configure", help="change a running daemon's rate limiter (admin)")
    configure.add_argument("--name", default="default", help="buffer name, or an endpoint")
    _add_limiter_flags(configure)
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
        return int(args.func(args))
    except (ShmBufferError, ValueError, OSError) as exc:
        print(f"shmbuffer-daemon: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
