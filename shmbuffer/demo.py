"""``shmbuffer-daemon demo``: a daemon, N writer processes and learners on synthetic data.

Every row carries who wrote it (``writer``), which of its episodes (``episode``), the step and
an observation filled with a value derived from those three, so a learner can prove each
episode it samples is whole. The same worker functions drive the end-to-end tests and the
daemon benchmarks.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from shmbuffer.schema import Schema


def payload_value(writer: int, episode: int, step: np.ndarray | int) -> Any:
    return (writer * 7 + episode * 13 + step) % 251


def make_episode(
    writer: int, episode: int, length: int, obs_shape: tuple[int, ...]
) -> dict[str, np.ndarray]:
    steps = np.arange(length, dtype=np.int64)
    values = payload_value(writer, episode, steps).astype(np.uint8)
    obs = np.empty((length, *obs_shape), dtype=np.uint8)
    obs.reshape(length, -1)[:] = values[:, None]
    done = np.zeros(length, dtype=bool)
    done[-1] = True
    return {
        "obs": obs,
        "writer": np.full(length, writer, dtype=np.int64),
        "episode": np.full(length, episode, dtype=np.int64),
        "step": steps,
        "reward": steps.astype(np.float32),
        "done": done,
    }


def check_episode(ep: TensorDict) -> None:
    """Raise AssertionError unless ``ep`` is one whole episode written by make_episode."""
    writer, episode = int(ep["writer"][0]), int(ep["episode"][0])
    steps = ep["step"].numpy()
    length = len(steps)
    assert (ep["writer"] == writer).all() and (ep["episode"] == episode).all(), "mixed episodes"
    assert np.array_equal(steps, np.arange(length)), f"steps not 0..{length - 1}: torn"
    assert bool(ep["done"][-1]) and not ep["done"][:-1].any(), "done flags torn"
    expected = payload_value(writer, episode, steps).astype(np.uint8)
    obs = ep["obs"].reshape(length, -1).numpy()
    assert np.array_equal(obs[:, 0], expected) and np.array_equal(obs[:, -1], expected), "torn obs"


def check_rows(batch: TensorDict) -> None:
    """Each sampled row's observation matches its (writer, episode, step) stamp."""
    expected = payload_value(batch["writer"], batch["episode"], batch["step"]).to(torch.uint8)
    obs = batch["obs"].reshape(len(expected), -1)
    assert torch.equal(obs[:, 0], expected) and torch.equal(obs[:, -1], expected), "torn row"


def writer_loop(
    target: str,
    writer_id: int,
    episodes: int,
    length: int,
    obs_shape: tuple[int, ...],
    seconds: float | None = None,
) -> int:
    """Write ``episodes`` episodes (or until ``seconds`` pass); return how many were written."""
    from shmbuffer import Writer

    with Writer(target) as writer:
        # from here: attaching (and compiling the streaming copy, seconds the first time
        # after an install without its cache) is not the writer's run
        deadline = time.monotonic() + seconds if seconds else None
        written = 0
        for episode in range(episodes):
            if deadline is not None and time.monotonic() > deadline:
                break
            writer.add_episode(make_episode(writer_id, episode, length, obs_shape))
            written += 1
        writer.flush()
    return written


def learner_loop(
    target: str, seconds: float, batch: int = 8, wait: float | None = None
) -> dict[str, int]:
    """Sample episodes and rows for ``seconds`` from the first data (waiting for it up to
    ``wait`` seconds, :data:`STARTUP_S` by default); verify every one. Returns counts."""
    from shmbuffer import Reader
    from shmbuffer.errors import EmptyBufferError

    checked = rows = 0
    # The clock starts at the first data: writers that are still starting (importing torch,
    # compiling the streaming copy) must not use up the learner's run.
    deadline = time.monotonic() + (STARTUP_S if wait is None else wait)
    waiting = True
    with Reader(target) as reader:
        while time.monotonic() < deadline:
            try:
                with reader.sample_episodes(batch) as episodes:
                    if waiting:
                        deadline, waiting = time.monotonic() + seconds, False
                    for ep in episodes:
                        check_episode(ep)
                        checked += 1
                sample = reader.sample(256)
            except EmptyBufferError:
                time.sleep(0.01)
                continue
            check_rows(sample)
            rows += len(sample)
    return {"episodes_checked": checked, "rows_checked": rows}


# -- the CLI command ------------------------------------------------------------------------

#: Seconds the demo allows its spawned children to start (each imports torch) besides its run.
STARTUP_S = 120.0


def _writer_proc(target: str, wid: int, length: int, shape: tuple[int, ...], secs: float) -> None:
    writer_loop(target, wid, 10**9, length, shape, seconds=secs)


def _learner_proc(target: str, secs: float, out: Any) -> None:
    out.put(learner_loop(target, secs))


def cmd_demo(args: argparse.Namespace) -> int:
    from shmbuffer.runtime import read
    from shmbuffer.statusview import format_status

    shape = tuple(int(x) for x in args.obs_shape.split(","))
    name = args.name or f"demo-{os.getpid()}"
    # Declaring the schema lets the daemon allocate and prefault the segment before it is
    # ready, instead of stalling every client when the first writer defines it.
    spec = Schema.from_batch(make_episode(0, 0, 1, shape)).to_spec()
    schema_file = Path(tempfile.mkdtemp(prefix="shmbuffer-demo-")) / "schema.json"
    schema_file.write_text(json.dumps(spec))
    cli = [sys.executable, "-m", "shmbuffer.cli", "--log-level", "WARNING", "start"]
    options = ["--capacity", str(args.capacity), "--unit", "episode", "--schema", str(schema_file)]
    daemon = subprocess.Popen([*cli, "--name", name, *options])
    ctx = mp.get_context("spawn")
    procs: list[Any] = []
    try:
        deadline = time.monotonic() + 30
        while (read(name) or {}).get("pid") != daemon.pid:
            if time.monotonic() > deadline or daemon.poll() is not None:
                print("the daemon did not start", file=sys.stderr)
                return 1
            time.sleep(0.05)
        print(
            f"daemon {name!r} up (pid {daemon.pid}); {args.writers} writers, "
            f"{args.learners} learners, {args.seconds}s, obs uint8{list(shape)}"
        )
        results = ctx.Queue()
        for w in range(args.writers):
            procs.append(
                ctx.Process(
                    target=_writer_proc,
                    args=(name, w, args.episode_len, shape, args.seconds),
                    name=f"writer-{w}",
                )
            )
        for i in range(args.learners):
            learner = ctx.Process(
                target=_learner_proc, args=(name, args.seconds, results), name=f"learner-{i}"
            )
            procs.append(learner)
        for p in procs:
            p.start()
        from shmbuffer.clients.connection import Connection

        admin = Connection(name, "admin")
        row_bytes = int(np.prod(shape)) + 8 * 3 + 4 + 1
        # The children's clocks start once they are up, and spawning them imports torch in
        # each at once: ~9 s apiece on a slow 2-core machine, so the wait allows for that.
        end = time.monotonic() + args.seconds + STARTUP_S
        peak = [0.0, 0.0]  # GB/s in and out: the last screen comes after the children ended
        started = False  # has any child connected yet
        while any(p.is_alive() for p in procs) and time.monotonic() < end:
            time.sleep(1.0)
            s = admin.call("stats")["stats"]
            rates = [s[k] * row_bytes / 1e9 for k in ("insert_rows_per_s", "sample_rows_per_s")]
            peak = [max(a, b) for a, b in zip(peak, rates, strict=True)]
            started = started or s["writers"] + s["readers"] > 0
            print(
                f"\x1b[H\x1b[2J{format_status(s)}\n"
                f"throughput  {rates[0]:.2f} GB/s in, {rates[1]:.2f} GB/s out"
                + ("" if started else f"\n(starting {len(procs)} processes: each imports torch)"),
                flush=True,
            )
        admin.close()
        late = [p.name for p in procs if p.is_alive()]
        if late:
            print(
                f"{', '.join(late)} still running after {args.seconds + STARTUP_S:.0f}s",
                file=sys.stderr,
            )
            return 1
        try:
            checked = [results.get(timeout=10) for _ in range(args.learners)]
        except queue.Empty:
            print("a learner ended without its counts: its traceback is above", file=sys.stderr)
            return 1
        total = sum(c["episodes_checked"] for c in checked)
        print(f"peak throughput {peak[0]:.2f} GB/s in, {peak[1]:.2f} GB/s out")
        print(
            f"learners verified {total:,} sampled episodes and "
            f"{sum(c['rows_checked'] for c in checked):,} rows: none torn"
        )
        return 0
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        daemon.terminate()
        try:
            daemon.wait(timeout=10)
        except subprocess.TimeoutExpired:
            daemon.kill()
        shutil.rmtree(schema_file.parent, ignore_errors=True)
