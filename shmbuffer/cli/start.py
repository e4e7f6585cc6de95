"""``shmbuffer-daemon start``: serve a buffer in this process, or detached in the background.

Runs the daemon's service and ZeroMQ loop (:mod:`shmbuffer.daemon.server`) with its runtime
file and pid file beside the socket, after refusing a name a live daemon serves and clearing
what a dead one left behind; ``--resume``/``--restore`` go through
:mod:`shmbuffer.daemon.recovery`. ``--detach`` starts this same command as a child in a new
session and waits until its runtime file names it. Part of the command line
(:mod:`shmbuffer.cli`), above both sides; it imports no client. The daemon's modules (torch
among them) are imported when ``start`` runs, not with this module: the other commands load
it too, and need none of them.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

from shmbuffer import runtime
from shmbuffer.daemon import security
from shmbuffer.errors import ConfigError, ShmBufferError
from shmbuffer.registry import spans
from shmbuffer.runtime import runtime_dir
from shmbuffer.wire.protocol import PROTOCOL_VERSION

if TYPE_CHECKING:
    from shmbuffer.daemon.config import DaemonConfig
    from shmbuffer.daemon.metrics import MetricsServer
    from shmbuffer.daemon.service import BufferService

log = logging.getLogger("shmbuffer.daemon")


def cmd_start(args: argparse.Namespace) -> int:
    from shmbuffer.daemon.config import (  # imports torch
        SAMPLER_OPTIONS,
        DaemonConfig,
        load_schema_file,
    )
    from shmbuffer.daemon.table_config import parse_table_flag

    tables = None
    for flag in args.table or ():
        name, options = parse_table_flag(flag)
        tables = tables or {}
        if name in tables:
            raise ConfigError(f"--table {flag!r}: a table named {name!r} was given already")
        tables[name] = options

    schema = load_schema_file(args.schema) if args.schema else None
    import_from = getattr(args, "import_from", None)
    if import_from is not None:  # the schema is the dataset's
        schema = _import_schema(import_from, schema)
    config = DaemonConfig.load(
        args.config,
        name=args.name,
        capacity=args.capacity,
        unit=args.unit,
        mode=args.mode,
        schema=schema,
        meta=None if args.meta is None else dict(args.meta),
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
        **{name: getattr(args, name) for name in SAMPLER_OPTIONS},  # as the samplers declare
        rate_limiter=args.rate_limiter,
        min_size=args.min_size,
        samples_per_insert=args.samples_per_insert,
        error_buffer=args.error_buffer,
        tables=tables,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        device=args.device,
        pin_memory=args.pin_memory,
        compressed_bytes=args.compressed_bytes,
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
        refuse_packed_state(config, "--resume" if args.resume else "--restore")
    if args.detach:
        return _detach(args, config)
    return run_daemon(
        config, keep=args.keep, resume=args.resume, restore=args.restore, import_from=import_from
    )


def _import_schema(spec: str, given: dict[str, Any] | None) -> dict[str, Any]:
    """The schema of the dataset ``spec`` names; ConfigError where ``--schema`` differs."""
    from shmbuffer.offline.load import open_dataset
    from shmbuffer.storage.schema import Schema

    schema = open_dataset(spec).schema
    if given is not None and Schema.from_spec(given) != schema:
        raise ConfigError(
            f"--schema {given} differs from the schema of --import {spec}: {schema}; leave "
            "--schema out (the dataset's is taken)"
        )
    return schema.to_spec()


def refuse_packed_state(config: DaemonConfig, flag: str) -> None:
    """ConfigError for ``flag`` on a buffer with compressed columns: saved states do not
    record the byte store, and a restore that brings rows back without their chunks would
    hand out wrong frames (docs/compression.md)."""
    from shmbuffer.storage.packed import packed_fields
    from shmbuffer.storage.schema import Schema

    schema = None if config.schema is None else Schema.from_spec(config.schema)
    names = [".".join(f.key) for f in packed_fields(schema)]
    if names:
        raise ConfigError(
            f"{flag}: column {', '.join(map(repr, names))} is stored compressed, and saved "
            "states (the journal, checkpoints) do not record its byte store: start the buffer "
            "afresh (docs/compression.md)"
        )


def _claim_name(config: DaemonConfig, keep_segment: bool = False) -> None:
    """Refuse a name a live daemon serves; clear what a dead one left behind (its segment
    too). With ``keep_segment`` (``--resume``) the segment and the stale runtime record stay:
    the record holds the settings of a daemon that died before it had a segment, and a
    resume that fails can be tried again; the resumed daemon's own record replaces it."""
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
        return
    log.warning(
        "removing the stale runtime file and segment of dead daemon pid %s, with the rows "
        "it had committed (`start --resume` would have served them again)",
        info.get("pid"),
    )
    runtime.remove(config.name)
    from shmbuffer.storage.segment import Segment

    Segment.unlink(config.name, info.get("storage_dir"))


def run_daemon(
    config: DaemonConfig,
    keep: bool = False,
    resume: bool = False,
    restore: str | None = None,
    import_from: str | None = None,
) -> int:
    """Serve ``config`` in this process until stopped; with ``metrics_port``, Prometheus
    metrics too (listening first: a busy port fails before a segment is allocated)."""
    if config.metrics_port is None:
        return _serve(config, keep, resume, restore, None, import_from)
    from shmbuffer.daemon.metrics import serve_metrics

    metrics = serve_metrics(config.metrics_host, config.metrics_port)
    try:
        return _serve(config, keep, resume, restore, metrics, import_from)
    finally:
        metrics.close()


def _serve(
    config: DaemonConfig,
    keep: bool,
    resume: bool,
    restore: str | None,
    metrics: MetricsServer | None,
    import_from: str | None = None,
) -> int:
    from shmbuffer.daemon.server import Server
    from shmbuffer.daemon.service import BufferService
    from shmbuffer.storage.segment import segment_path

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
    if import_from is not None:
        _load(service, config, import_from)
    server = Server(service, config.resolved_endpoint, metrics.metrics if metrics else None)
    server.install_signal_handlers()
    info = {
        "name": config.name,
        "endpoint": server.endpoint,
        "pid": os.getpid(),
        "storage_dir": config.storage_dir,
        "protocol": PROTOCOL_VERSION,
        # Where its segment is or will be (created with the schema): whether it exists once
        # this daemon is gone says what `--resume` would find.
        "segment": str(segment_path(config.name, config.storage_dir)),
        "settings": service.resume_settings(),  # `--resume` of a daemon with no segment
    }
    if metrics is not None:  # the port 0 chose is found here
        info["metrics"] = metrics.url
    runtime.write(config.name, info)
    service.settings_changed = lambda: runtime.update(
        config.name, settings=service.resume_settings()
    )
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
    # The compiled uniform draws load on a thread once the daemon has drawn 50,000 times, so
    # its loop never pauses for numba (spans.py).
    spans.load_on_a_thread()
    try:
        server.serve_forever()
    finally:
        server.close()
        keep = keep or server.keep_segment
        if not keep:
            from shmbuffer.storage.segment import Segment

            Segment.unlink(config.name, config.storage_dir)
        runtime.remove(config.name, os.getpid())
        (runtime_dir() / f"{config.name}.pid").unlink(missing_ok=True)
        log.info("stopped%s", " (segment kept)" if keep else "")
    return 0


def _load(service: BufferService, config: DaemonConfig, spec: str) -> None:
    """Write the dataset ``spec`` names into ``service`` before it serves anyone; a failure
    removes the fresh segment (nothing was served from it)."""
    from shmbuffer.offline.load import load_into, open_dataset

    try:
        done = load_into(service, open_dataset(spec), f"--import {spec}")
    except BaseException:
        if service.journal is not None:
            service.journal.close()
        if service.segment is not None:
            service.segment.close()
        from shmbuffer.storage.segment import Segment

        Segment.unlink(config.name, config.storage_dir)
        raise
    log.info(
        "imported %d episodes (%d rows) from %s in %.2fs",
        done["episodes"],
        done["rows"],
        spec,
        done["seconds"],
    )


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
