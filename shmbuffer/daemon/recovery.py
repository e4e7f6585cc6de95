"""After a daemon is gone: ``start --resume``, ``start --restore``, ``cleanup``.

* **resume** re-attaches the segment a SIGKILLed (or ``stop --keep``-ed) daemon left on tmpfs
  and rebuilds its registry, ring pointer, counters, sampler and limiter state (samples
  included), use counters and leases from the journal (see ``journal.py``). Reservations that
  were open at the crash are gone: their rows were evicted when reserved and never committed,
  so they are never published. Leases are kept until their TTL passes: a reader of views the
  dead daemon leased keeps them unchanged, whichever writers reconnect. A daemon that died
  before its first write (no schema, so no segment) stored nothing but its settings, kept in
  its runtime record (the rate limiter as ``configure`` left it): resume starts it again,
  empty, with them.
* **restore** creates a fresh segment from a checkpoint folder (see ``checkpoint.py``), copies
  the rows in and rebuilds the same state, sampler state (priorities, epochs, consumed
  marks), rate limiter counts, generator state and use counters included.
* **cleanup** removes every segment folder and runtime file (logs included) whose daemon is
  gone, and nothing else; what it cannot read (another user's) it skips.

Settings on ``start --resume/--restore``: capacity, unit, mode and schema come from what is
resumed; values given on the command line or in the config file must agree with them (a clear
error names the conflict). So do the sampler and its settings (``--sampler``,
``--priority-exponent``, ...): the saved priorities, epochs and consumed marks belong to that
sampler. The rate limiter is the saved one (kind, and settings as ``configure`` last left
them) unless any limiter setting is given: then the command line wins, and the saved counts
are kept.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shmbuffer import runtime
from shmbuffer.daemon.config import LIMITER_OPTIONS, SAMPLER_OPTIONS, DaemonConfig
from shmbuffer.daemon.journal import STATE_FILE, Journal
from shmbuffer.daemon.saved_state import restore_container
from shmbuffer.errors import CheckpointError, JournalError, RecoveryError, ShmBufferError
from shmbuffer.runtime import runtime_dir
from shmbuffer.storage.schema import Schema
from shmbuffer.storage.segment import (
    MANIFEST,
    Segment,
    default_storage_dir,
    segment_path,
)
from shmbuffer.wire.unix import LANE_SUFFIX

if TYPE_CHECKING:
    from shmbuffer.daemon.service import BufferService

log = logging.getLogger("shmbuffer.daemon")

SETTINGS = ("capacity", "unit", "mode", "schema")
#: The sampler's settings must match what was saved; the limiter's are adopted unless given.
SAMPLER_SETTINGS = ("sampler", *SAMPLER_OPTIONS)
LIMITER_SETTINGS = ("rate_limiter", *LIMITER_OPTIONS)


# -- settings ---------------------------------------------------------------------------------


def _saved_settings(manifest: dict[str, Any], state: dict[str, Any] | None) -> dict[str, Any]:
    extra = manifest.get("extra") or {}
    return {
        "capacity": manifest["capacity"],
        "unit": (state or {}).get("unit", extra.get("unit")),
        "mode": (state or {}).get("mode", extra.get("mode")),
        "schema": manifest["schema"],
    }


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((path / MANIFEST).read_text()))
    except FileNotFoundError:
        raise RecoveryError(f"nothing to resume: no segment manifest at {path}") from None
    except (OSError, ValueError) as exc:
        raise RecoveryError(f"unreadable manifest {path / MANIFEST}: {exc}") from exc


def saved_settings(config: DaemonConfig, restore: str | None) -> dict[str, Any]:
    """capacity/unit/mode/schema of what ``--resume`` (restore None) or ``--restore`` loads,
    and the sampler and limiter settings it was saved with (none for a state saved before
    samplers existed)."""
    if restore is not None:
        from shmbuffer.daemon.checkpoint import read_checkpoint

        _, manifest, state = read_checkpoint(restore)
        return {**_saved_settings(manifest, state), **_saved_parts(state)}
    path = segment_path(config.name, _storage_dir(config))
    if not (path / MANIFEST).exists() and (unwritten := _unwritten_settings(config)):
        return {**unwritten, "schema": None, **_saved_parts(unwritten)}
    manifest = _read_manifest(path)
    try:  # the journal's last snapshot: the sampler never changes, configure snapshots
        snapshot = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError):
        snapshot = None  # resume_service reports what is wrong with the journal
    return {**_saved_settings(manifest, None), **_saved_parts(snapshot)}


def _unwritten_settings(config: DaemonConfig) -> dict[str, Any] | None:
    """The settings a dead daemon that never created its segment (no schema yet: nothing
    written) left in its runtime record (``BufferService.resume_settings``); None if there
    is no such record."""
    info = runtime.read(config.name)
    if info is None or not runtime.is_stale(info) or not isinstance(info.get("settings"), dict):
        return None
    settings = dict(info["settings"])
    keys = ("capacity", "unit", "mode", "sampler", "rate_limiter", "table", "tables")
    return {k: settings[k] for k in keys if k in settings}


def _saved_parts(state: dict[str, Any] | None) -> dict[str, Any]:
    """The sampler and rate limiter settings of a saved container state, as config fields;
    with several tables (a state with ``"tables"``), every table's as the ``tables`` field."""
    if state and isinstance(state.get("tables"), dict):
        return {"tables": _saved_tables(state)}
    out: dict[str, Any] = {}
    for part, options in (("sampler", SAMPLER_OPTIONS), ("rate_limiter", LIMITER_OPTIONS)):
        saved = (state or {}).get(part) or {}
        if isinstance(saved, dict) and "name" in saved:
            settings = saved.get("settings") or {}
            out[part] = saved["name"]
            out.update({name: settings.get(name) for name in options})
    return out


def _saved_tables(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each saved table's options (sampler and limiter kinds and settings), by name, the
    default table first: the ``tables`` setting that builds them again."""
    tables = {str(state.get("table", "default")): state, **state["tables"]}
    out = {}
    for name, entry in tables.items():
        options: dict[str, Any] = {}
        for part in ("sampler", "rate_limiter"):
            saved = entry.get(part) or {}
            if "name" in saved:
                options[part] = saved["name"]
                settings = saved.get("settings") or {}
                options.update({k: v for k, v in settings.items() if v is not None})
        out[name] = options
    return out


def _table_conflicts(mine: dict[str, Any] | None, theirs: dict[str, Any] | None) -> list[str]:
    """Where tables asked for differ from the saved ones: their names and order, and each
    one's sampler kind (its saved state belongs to that sampler)."""
    if mine is None or theirs is None:
        return [] if mine == theirs else [f"tables: requested {mine}, saved one table"]
    if list(mine) != list(theirs):
        return [f"tables: requested {', '.join(mine)}, saved {', '.join(theirs)}"]
    out = []
    for name, options in mine.items():
        kind, saved = options.get("sampler", "uniform"), theirs[name].get("sampler", "uniform")
        if kind != saved:
            out.append(f"table {name!r}: requested the {kind} sampler, saved {saved}")
    return out


def adopt_settings(
    config: DaemonConfig, args: argparse.Namespace, restore: str | None
) -> DaemonConfig:
    """``config`` with the saved capacity/unit/mode/schema; RecoveryError if a setting given
    explicitly (command line or config file) disagrees."""
    saved = saved_settings(config, restore)
    from_file = DaemonConfig.load(args.config) if getattr(args, "config", None) else DaemonConfig()
    defaults = DaemonConfig()

    def given(key: str) -> bool:
        flag = "table" if key == "tables" else key  # --table, repeated, makes the tables
        return getattr(args, flag, None) is not None or (
            getattr(from_file, key) != getattr(defaults, key)
        )

    conflicts = []
    if given("tables"):  # not given: the saved tables are adopted below
        conflicts += _table_conflicts(config.tables, saved.get("tables"))
    for key in (*SETTINGS, *SAMPLER_SETTINGS):
        if not given(key) or saved.get(key) is None:
            continue
        mine, theirs = getattr(config, key), saved[key]
        if key == "schema":
            mine, theirs = Schema.from_spec(mine), Schema.from_spec(theirs)
        if mine != theirs:
            conflicts.append(f"{key}: requested {mine}, saved {theirs}")
    what = f"checkpoint {restore}" if restore is not None else f"segment of {config.name!r}"
    if conflicts:
        raise RecoveryError(f"settings conflict with the {what}: " + "; ".join(conflicts))
    adopted = {k: v for k, v in saved.items() if v is not None and k in SETTINGS}
    if "tables" in saved and not given("tables"):  # as the dead daemon had them
        adopted["tables"] = saved["tables"]
    if "sampler" in saved:  # every setting of the saved sampler, None ones included
        adopted.update({k: saved[k] for k in SAMPLER_SETTINGS})
    if "rate_limiter" in saved and not any(given(k) for k in LIMITER_SETTINGS):
        adopted.update({k: saved[k] for k in LIMITER_SETTINGS})
    if restore is None:  # resume: the segment stays where the dead daemon had it
        adopted["storage_dir"] = _storage_dir(config)
    return dataclasses.replace(config, **adopted)


def _check_settings(config: DaemonConfig, saved: dict[str, Any], what: str) -> None:
    for key in SETTINGS:
        mine, theirs = getattr(config, key), saved[key]
        if key == "schema":
            mine = None if mine is None else Schema.from_spec(mine)
            theirs = Schema.from_spec(theirs)
            if mine is None:
                continue
        if theirs is not None and mine != theirs:
            raise RecoveryError(f"{what}: {key} is {theirs}, the daemon is configured for {mine}")


def _storage_dir(config: DaemonConfig) -> str | None:
    if config.storage_dir is not None:
        return config.storage_dir
    info = runtime.read(config.name)
    return None if info is None else info.get("storage_dir")


# -- resume -----------------------------------------------------------------------------------


def _owner_pid(manifest: dict[str, Any]) -> int:
    extra = manifest.get("extra") or {}
    return int(extra.get("daemon_pid", manifest.get("pid", 0)) or 0)


def _rewrite_manifest(segment: Segment) -> None:
    """Record this daemon as the segment's owner (atomically; attachers read it once)."""
    manifest = {**segment.manifest}
    manifest["extra"] = {**(manifest.get("extra") or {}), "daemon_pid": os.getpid()}
    tmp = segment.path / f".{MANIFEST}.{os.getpid()}.tmp"
    mode = (segment.path / MANIFEST).stat().st_mode & 0o777
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "w") as f:
        json.dump(manifest, f, indent=2)
    os.replace(tmp, segment.path / MANIFEST)
    segment.manifest = manifest


def resume_service(config: DaemonConfig) -> BufferService:
    """A BufferService over the surviving segment of ``config.name``, in the state its journal
    records. RecoveryError when there is nothing to resume or it is still in use."""
    from shmbuffer.daemon.service import BufferService

    t0 = time.perf_counter()
    storage_dir = _storage_dir(config)
    path = segment_path(config.name, storage_dir)
    if not (path / MANIFEST).exists() and _unwritten_settings(config) is not None:
        log.warning(  # its settings came in through adopt_settings
            "resumed %r: its daemon died before its first write and stored nothing; starting "
            "empty with its settings (sampler, rate limiter as last configured)",
            config.name,
        )
        return BufferService(config)
    manifest = _read_manifest(path)
    owner = _owner_pid(manifest)
    here = manifest.get("host") == socket.gethostname()
    if owner and owner != os.getpid() and here and runtime.pid_alive(owner):
        raise RecoveryError(f"segment {path} still belongs to live pid {owner}")
    journal = Journal(path)
    if not journal.exists():
        raise RecoveryError(f"nothing to resume: {path} has no journal (not a daemon's segment)")
    _check_settings(config, _saved_settings(manifest, None), f"segment {path}")
    try:
        state = journal.load()
    except JournalError as exc:
        raise RecoveryError(f"cannot resume {path}: {exc}") from exc
    # not mapped in here: as at creation (state.py), the clients map their own
    segment = Segment.attach(config.name, storage_dir=storage_dir, prefault=False)
    _rewrite_manifest(segment)
    config = dataclasses.replace(config, storage_dir=storage_dir, schema=manifest["schema"])
    if config.seed is None and state.get("iterate_seed") is not None:
        # iterate's shuffles go on as the dead daemon's (its generator comes from the state)
        config = dataclasses.replace(config, seed=state["iterate_seed"])
    service = BufferService.from_state(config, segment, state)
    # Leases of readers that may still be reading views: pinned until their TTL passes,
    # journaled again in the new generation (before any client is served).
    leases = service.leases.restore(state["leases"], time.monotonic())
    if state["diverged"]:
        log.warning(
            "resume: %d journaled samples did not draw the same again; the %s sampler's "
            "state may differ from the dead daemon's",
            state["diverged"],
            service.container.sampler.name,
        )
    log.warning(
        "resumed %s: %d episodes, %d rows, pointer %d, %d leases held on (snapshot + %d "
        "journal records, %d torn bytes ignored) in %.3fs",
        path,
        service.container.num_episodes,
        service.container.num_rows,
        service.container.pointer,
        len(leases),
        state["replayed"],
        state["torn"],
        time.perf_counter() - t0,
    )
    return service


# -- restore ----------------------------------------------------------------------------------


def restore_service(config: DaemonConfig, source: str | Path) -> BufferService:
    """A BufferService with a fresh segment holding the checkpoint at ``source``."""
    import numpy as np

    from shmbuffer.daemon.checkpoint import (
        USE_COUNTS,
        checkpoint_format,
        read_checkpoint,
        restore_rows,
    )
    from shmbuffer.daemon.service import BufferService
    from shmbuffer.storage.progress import copy_progress

    t0 = time.perf_counter()
    folder, manifest, state = read_checkpoint(source)
    _check_settings(config, _saved_settings(manifest, state), f"checkpoint {folder}")
    config = dataclasses.replace(config, schema=manifest["schema"])
    service = BufferService(config)  # creates the segment (and a journal) from the schema
    segment = service.segment
    assert segment is not None and service.journal is not None
    if segment.nbytes != manifest["size"]:
        raise RecoveryError(f"checkpoint {folder}: layout differs from this version's segment")
    rows_bytes = segment.capacity * (segment.schema.row_nbytes + 8)  # and their stamps
    total = segment.nbytes if checkpoint_format(state) == 1 else rows_bytes
    update, done = copy_progress("restore", total)  # a bar on a terminal only
    try:
        # rows and stamps (format 2: chunk by chunk; the chunk table kept beside the segment)
        restore_rows(folder, manifest, state, segment, update)
        # registry, ring, sampler state, limiter counts and generator state
        restore_container(state, service.container)
    except (JournalError, CheckpointError, OSError) as exc:  # the fresh segment goes again
        service.journal.close()
        segment.close()
        Segment.unlink(config.name, config.storage_dir)
        raise RecoveryError(f"cannot restore checkpoint {folder}: {exc}") from exc
    finally:
        done()
    service.counters.restore(state.get("counters", {}))
    counts = folder / USE_COUNTS
    if counts.is_file():
        saved = np.load(counts)  # with several tables, one row per table in their order
        for table, row in zip(
            service.container.tables.values(), np.atleast_2d(saved), strict=False
        ):
            table.use_counts[:] = row
    service.journal.snapshot(service.persistent_state())
    log.warning(
        "restored %s: %d episodes, %d rows, %.1f MB in %.3fs",
        folder,
        service.container.num_episodes,
        service.container.num_rows,
        segment.nbytes / 1e6,
        time.perf_counter() - t0,
    )
    return service


# -- cleanup ----------------------------------------------------------------------------------


#: The files a daemon keeps in the runtime dir beside its ``<name>.json``: its pid, its ipc
#: socket and the local lane's socket beside it (``protocol_unix.lane_path``), its log.
RUNTIME_SUFFIXES = (".pid", ".sock", ".sock" + LANE_SUFFIX, ".log")
#: A log with no runtime file beside it is removed once it has been quiet this long: a daemon
#: that ``--detach`` is still starting (or resuming) has a log but no runtime file yet.
ORPHAN_LOG_AGE_S = 60.0


def cleanup(storage_dir: str | Path | None = None, dry_run: bool = False) -> list[str]:
    """Remove the runtime files (``.json`` and :data:`RUNTIME_SUFFIXES`) and segment folders of
    daemons that are gone; return what was (or, with ``dry_run``, would be) removed. A log
    alone (its daemon stopped, or never started) goes once it is ``ORPHAN_LOG_AGE_S`` old.
    Live daemons' files, segments of other hosts and folders that are not segments (no
    manifest) are left alone, and so is whatever cannot be read (another user's folder, a
    runtime file another user could have written): skipped, never a crash."""
    removed: list[str] = []
    host = socket.gethostname()
    live: set[tuple[str, Path]] = set()
    roots = {Path(storage_dir) if storage_dir is not None else default_storage_dir()}

    def remove(path: Path) -> None:
        removed.append(str(path))
        if dry_run:
            return
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

    rdir = runtime_dir()
    for path in sorted(rdir.glob("*.json")):
        try:
            info = runtime.read(path.stem)
        except (ShmBufferError, ValueError, OSError) as exc:  # untrusted, or not a buffer name
            log.warning("cleanup: skipping %s: %s", path, exc)
            continue
        if info is None:
            continue
        seg_root = Path(info.get("storage_dir") or default_storage_dir())
        if not runtime.is_stale(info):
            live.add((path.stem, seg_root.absolute()))
            continue
        remove(path)
        for suffix in RUNTIME_SUFFIXES:
            if os.path.lexists(rdir / f"{path.stem}{suffix}"):
                remove(rdir / f"{path.stem}{suffix}")
        if storage_dir is None or seg_root.absolute() == Path(storage_dir).absolute():
            roots.add(seg_root)
    now = time.time()
    for path in sorted(rdir.glob("*.log")):
        others = [rdir / f"{path.stem}{s}" for s in (".json", *RUNTIME_SUFFIXES) if s != ".log"]
        if str(path) in removed or any(os.path.lexists(p) for p in others):
            continue
        with contextlib.suppress(OSError):
            if now - path.stat().st_mtime >= ORPHAN_LOG_AGE_S:
                remove(path)
    for root in sorted(roots):
        try:
            entries = sorted(root.iterdir()) if root.is_dir() else []
        except OSError as exc:  # another user's root: not ours to clean
            log.warning("cleanup: skipping %s: %s", root, exc)
            continue
        for seg in entries:
            try:
                if not seg.is_dir() or seg.is_symlink() or str(seg) in removed:
                    continue
                manifest = json.loads((seg / MANIFEST).read_text())
            except (OSError, ValueError):
                continue  # not a segment, one being created right now, or not readable
            if not isinstance(manifest, dict) or manifest.get("host", host) != host:
                continue
            if (seg.name, root.absolute()) in live:
                continue
            pid = _owner_pid(manifest)
            if pid and runtime.pid_alive(pid):
                continue
            remove(seg)
    return removed
