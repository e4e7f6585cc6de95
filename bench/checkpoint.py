"""Checkpoints of a loaded daemon: the longest pause a client sees, throughput, incremental.

``python -m bench.checkpoint [--gb 4] [--targets /var/tmp /dev/shm] [--baseline-s 10]
[--writer-mb-s R] [--json FILE]``

A daemon owns a ``--gb`` buffer of Atari-like rows (``bench.data.ATARI_SPEC``, 28 KB a row)
under /dev/shm; a writer process keeps adding 100-row episodes (as fast as it can, or at most
``--writer-mb-s``) and a reader process keeps sampling 32 rows (copies, stamp-checked). Both
time every call. Then, under that load:

1. a window without a checkpoint (the baseline: the longest call, p99, p50);
2. a full checkpoint to each target folder, timed by its reply; the same figures for the calls
   that overlapped it, and the daemon's own ``max_pause_ms``;
3. with the writer paused (the reader goes on): a checkpoint that catches up, then one with
   nothing changed, per target; then one per target after 10% of the rows were written again;
4. the daemon stopped: each target's last checkpoint restored into a fresh segment under
   /dev/shm, one at a time (``restore_service``, what ``start --restore`` runs before it
   listens: every chunk read, checked against its checksum and written; the journal's first
   snapshot included);
5. the disk's own figure: ``dd if=/dev/zero of=/var/tmp/ddtest bs=64M count=32 oflag=direct
   conv=fsync``.

The buffer, every checkpoint folder and the dd file are removed at the end (also after an
error); the daemon and both children are stopped. It needs about 2x ``--gb`` free in /dev/shm
(the buffer, and a checkpoint there) and ``--gb`` on each other target: run ONE at a time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import data
from bench.harness import running_daemon

EPISODE = 100  # rows per writer call
SAMPLE = 32  # rows per reader call
SPEC = data.ATARI_SPEC
DD = ["dd", "if=/dev/zero", "bs=64M", "count=32", "oflag=direct", "conv=fsync"]


# -- the load (child processes) ---------------------------------------------------------------


def _writer(
    runtime: str, name: str, rate: float, writing: Any, idle: Any, stop: Any, out: Any
) -> None:
    """Add episodes while ``writing`` is set (flushed and ``idle`` set while it is not), at
    most ``rate`` bytes a second (0: as fast as it can); put ``(start, seconds)`` of every
    call on ``out`` at the end."""
    os.environ["SHMBUFFER_RUNTIME_DIR"] = runtime
    from shmbuffer import Writer

    rng = np.random.default_rng(1)
    pool = [
        {k: rng.integers(0, 255, (EPISODE, *shape)).astype(dt) for k, (shape, dt) in SPEC.items()}
        for _ in range(4)
    ]
    calls: list[tuple[float, float]] = []
    size = EPISODE * data.row_bytes(SPEC)
    with Writer(name, timeout=120) as writer:
        i = 0
        while not stop.is_set():
            if not writing.is_set():
                writer.flush()
                idle.set()
                writing.wait(0.1)
                continue
            idle.clear()
            t0 = time.perf_counter()
            writer.add_episode(pool[i % len(pool)])
            calls.append((t0, time.perf_counter() - t0))
            i += 1
            if rate:
                time.sleep(max(0.0, t0 + size / rate - time.perf_counter()))
        writer.flush()
    out.put(("writer", calls))


def _reader(runtime: str, name: str, stop: Any, out: Any) -> None:
    os.environ["SHMBUFFER_RUNTIME_DIR"] = runtime
    from shmbuffer import Reader
    from shmbuffer.errors import EmptyBufferError

    calls: list[tuple[float, float]] = []
    with Reader(name, timeout=120) as reader:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                reader.sample(SAMPLE)
            except EmptyBufferError:
                time.sleep(0.01)
                continue
            calls.append((t0, time.perf_counter() - t0))
    out.put(("reader", calls))


# -- measuring --------------------------------------------------------------------------------


def _admin(name: str) -> Any:
    from shmbuffer.clients.connection import Connection

    return Connection(name, "admin", timeout=30)


def checkpoint(name: str, to: Path) -> dict[str, Any]:
    conn = _admin(name)
    try:
        t0 = time.perf_counter()
        reply = dict(conn.call("checkpoint", timeout=1800, to=str(to)))
        reply["t0"], reply["t1"] = t0, time.perf_counter()
        return reply
    finally:
        conn.close()


def stats(name: str) -> dict[str, Any]:
    conn = _admin(name)
    try:
        return dict(conn.call("stats")["stats"])
    finally:
        conn.close()


def latencies(calls: np.ndarray, t0: float, t1: float) -> dict[str, float]:
    """Figures (ms) of the calls that overlapped [t0, t1]."""
    if not len(calls):
        return {"calls": 0, "max_ms": float("nan"), "p99_ms": float("nan"), "p50_ms": float("nan")}
    start, took = calls[:, 0], calls[:, 1]
    inside = took[(start <= t1) & (start + took >= t0)] * 1e3
    if not len(inside):
        return {"calls": 0, "max_ms": float("nan"), "p99_ms": float("nan"), "p50_ms": float("nan")}
    return {
        "calls": len(inside),
        "per_s": len(inside) / max(t1 - t0, 1e-9),
        "max_ms": float(inside.max()),
        "p99_ms": float(np.percentile(inside, 99)),
        "p50_ms": float(np.median(inside)),
    }


def dd_figure(folder: str) -> str:
    target = os.path.join(folder, "ddtest")
    try:
        argv = [*DD, f"of={target}"]
        out = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=600)
        return out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.stdout
    finally:
        if os.path.exists(target):
            os.unlink(target)


def write_rows(name: str, rows: int) -> None:
    from shmbuffer import Writer

    rng = np.random.default_rng(2)
    episode = {k: rng.integers(0, 255, (EPISODE, *s)).astype(d) for k, (s, d) in SPEC.items()}
    with Writer(name, timeout=120) as writer:
        for _ in range(-(-rows // EPISODE)):
            writer.add_episode(episode)
        writer.flush()


def restore_seconds(storage: str, capacity: int, folder: Path) -> float:
    """Seconds to restore the checkpoint in ``folder`` into a fresh segment (then removed)."""
    from shmbuffer.daemon.config import DaemonConfig
    from shmbuffer.daemon.recovery import restore_service
    from shmbuffer.storage.segment import Segment

    name = f"bench-restore-{os.getpid()}"
    config = DaemonConfig(name=name, capacity=capacity, unit="transition", storage_dir=storage)
    t0 = time.perf_counter()
    service = restore_service(config, folder)
    seconds = time.perf_counter() - t0
    if service.journal is not None:
        service.journal.close()
    if service.segment is not None:
        service.segment.close()
    Segment.unlink(name, storage)
    return seconds


def run(args: argparse.Namespace) -> dict[str, Any]:
    row = data.row_bytes(SPEC) + 8
    capacity = int(args.gb * 1e9) // row
    storage = tempfile.mkdtemp(prefix="shmbuffer-bench-ckpt-", dir="/dev/shm")
    runtime = tempfile.mkdtemp(prefix="sbck-", dir="/tmp")
    os.environ["SHMBUFFER_RUNTIME_DIR"] = runtime
    folders = [Path(t) / f"shmbuffer-bench-ckpt-{os.getpid()}" for t in args.targets]
    ctx = mp.get_context("spawn")
    stop, writing, idle, out = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
    procs: list[Any] = []
    result: dict[str, Any] = {
        "gb": args.gb,
        "capacity": capacity,
        "row_bytes": row,
        "writer_mb_s": args.writer_mb_s,
        "load_before": os.getloadavg(),
    }
    try:
        with running_daemon(storage, capacity, "transition", SPEC) as name:
            writing.set()
            procs = [
                ctx.Process(
                    target=_writer,
                    args=(runtime, name, args.writer_mb_s * 1e6, writing, idle, stop, out),
                ),
                ctx.Process(target=_reader, args=(runtime, name, stop, out)),
            ]
            for p in procs:
                p.start()
            t_fill = time.perf_counter()
            while stats(name)["rows_committed"] < capacity:  # one lap: every row written
                if time.perf_counter() - t_fill > 600:
                    raise TimeoutError("the writer did not fill the buffer in 600 s")
                time.sleep(0.5)
            result["fill_s"] = time.perf_counter() - t_fill
            t0 = time.perf_counter()
            time.sleep(args.baseline_s)
            windows: dict[str, tuple[float, float]] = {"baseline": (t0, time.perf_counter())}
            replies: dict[str, dict[str, Any]] = {}
            for folder in folders:  # full checkpoints under load
                key = f"full {folder.parent}"
                replies[key] = checkpoint(name, folder)
                windows[key] = (replies[key]["t0"], replies[key]["t1"])
                print(f"{key}: {replies[key]}", file=sys.stderr)
                if folder != folders[-1]:
                    time.sleep(2)
            writing.clear()
            if not idle.wait(60):
                raise TimeoutError("the writer did not pause")
            # Incremental, the writer paused; the last target first: its catch-up (what the
            # writer changed since its full checkpoint) is small, so a /dev/shm target holds
            # about one checkpoint's worth beside the buffer, not two.
            for folder in reversed(folders):
                checkpoint(name, folder)
                replies[f"unchanged {folder.parent}"] = checkpoint(name, folder)
            write_rows(name, capacity // 10)  # the same rows changed for every target
            for folder in folders:
                replies[f"10% changed {folder.parent}"] = checkpoint(name, folder)
            stop.set()
            calls = {}
            for _ in procs:
                role, got = out.get(timeout=120)
                calls[role] = np.array(got, dtype=np.float64).reshape(-1, 2)
            for p in procs:
                p.join(30)
            log = Path(storage) / f"{name}.log"  # the daemon's own figures, one line each
            result["daemon_log"] = [
                line.split(" WARNING ", 1)[-1]
                for line in log.read_text(errors="replace").splitlines()
                if "cut paused" in line
            ]
        result["restores"] = {  # the buffer is gone: room for one restored copy at a time
            str(folder.parent): restore_seconds(storage, capacity, folder) for folder in folders
        }
        result["dd_var_tmp"] = dd_figure("/var/tmp")
        result["load_after"] = os.getloadavg()
        result["windows"] = {
            key: {role: latencies(c, *span) for role, c in calls.items()}
            for key, span in windows.items()
        }
        result["checkpoints"] = {
            key: {
                "seconds": r["seconds"],
                "gb_per_s": r["bytes"] / r["seconds"] / 1e9,
                "copied_gb": r["copied_bytes"] / 1e9,
                "linked_gb": r["linked_bytes"] / 1e9,
                "daemon_max_pause_ms": r["max_pause_ms"],
            }
            for key, r in replies.items()
        }
        return result
    finally:
        stop.set()
        writing.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(storage, ignore_errors=True)
        shutil.rmtree(runtime, ignore_errors=True)


def report(result: dict[str, Any]) -> str:
    lines = [
        f"buffer {result['gb']:g} GB ({result['capacity']:,} rows of {result['row_bytes']} B), "
        f"filled in {result['fill_s']:.1f}s; writer cap {result['writer_mb_s'] or 'none'} MB/s; "
        f"load average before {result['load_before'][0]:.1f}, "
        f"after {result['load_after'][0]:.1f}",
        "",
        "| window | writer MB/s | writer max ms | writer p99 ms | reader calls/s | reader max ms "
        "| reader p99 ms |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    episode_mb = EPISODE * data.row_bytes(SPEC) / 1e6
    for key, roles in result["windows"].items():
        w, r = roles.get("writer", {}), roles.get("reader", {})
        lines.append(
            f"| {key} | {w.get('per_s', 0) * episode_mb:.0f} | {w.get('max_ms', 0):.1f} "
            f"| {w.get('p99_ms', 0):.1f} | {r.get('per_s', 0):.0f} | {r.get('max_ms', 0):.1f} "
            f"| {r.get('p99_ms', 0):.1f} |"
        )
    lines += [
        "",
        "| checkpoint | seconds | GB/s | copied GB | linked GB | daemon max pause ms |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for key, c in result["checkpoints"].items():
        lines.append(
            f"| {key} | {c['seconds']:.2f} | {c['gb_per_s']:.2f} | {c['copied_gb']:.2f} "
            f"| {c['linked_gb']:.2f} | {c['daemon_max_pause_ms']:.1f} |"
        )
    lines += ["", "| restore from | seconds | GB/s |", "| --- | --- | --- |"]
    gb = result["capacity"] * result["row_bytes"] / 1e9
    for target, seconds in result.get("restores", {}).items():
        lines.append(f"| {target} | {seconds:.2f} | {gb / seconds:.2f} |")
    lines += ["", f"dd to /var/tmp ({' '.join(DD)}): {result['dd_var_tmp']}", ""]
    lines += ["daemon log:", *result["daemon_log"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.checkpoint", description=__doc__)
    parser.add_argument("--gb", type=float, default=4.0, help="buffer size, GB (1e9 B)")
    parser.add_argument("--targets", nargs="+", default=["/var/tmp", "/dev/shm"])
    parser.add_argument("--baseline-s", type=float, default=10.0)
    parser.add_argument(
        "--writer-mb-s", type=float, default=0.0, help="the writer's rate cap (0: none)"
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    result = run(args)
    text = report(result)
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
