"""Two tables over one daemon: a DQN learner samples a prioritized "replay" table while an
evaluation process consumes every episode once from a FIFO "eval" table over the same rows
and reports how the newest policy does, from the metadata the env workers attach.

    python examples/dqn_eval_tables.py --workers 2 --minutes 5

The daemon it starts has two tables (``docs/tables.md``)::

    shmbuffer-daemon start --unit transition --table replay:prioritized \
        --table eval:fifo,max-times-sampled=1

Env workers attach each finished episode's return, policy version and env to it
(``docs/metadata.md``). The learner is ``dqn_cartpole.py``'s, on the default (first) table.
The evaluator is a ``Reader(name, table="eval")``: each episode reaches it exactly once, and a
FIFO table holds its rows until it does, so the ring never overwrites an episode it has not
seen. For every batch it looks the episodes' metadata up (``reader.episodes(where="id in
(...)")``), checks that the return a worker attached equals the sum of the rewards stored, and
prints the mean return of the newest policy's episodes; at the end, the best episodes of the
newest policy, asked of the daemon by a filter. The learner's figures follow; the last line is
``final mean return (last 20 episodes): <number>``, as for ``dqn_cartpole.py``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
import time
from typing import Any

import torch
from common import DAEMON_START_TIMEOUT_S, Daemon, unique_name
from dqn_cartpole import parse_args, train

import shmbuffer
from shmbuffer.errors import DaemonUnavailableError, WaitTimeoutError

TABLES = ["--table", "replay:prioritized", "--table", "eval:fifo,max-times-sampled=1"]


def evaluate(buffer: str, stop: Any, every_s: float = 5.0) -> None:
    """The evaluation consumer (its own process): consume the "eval" table, episode by
    episode, until ``stop`` is set; print the newest policy's mean return now and then."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the learner stops us in order
    torch.set_num_threads(1)
    recent: list[tuple[int, float]] = []  # (policy version, return) since the last report
    consumed: set[int] = set()  # every id handed out: a FIFO table hands each out once
    oldest_reported = 0  # the oldest policy version of the last report
    last_print = time.monotonic()
    with _connect(buffer) as reader:
        while not stop.is_set():
            try:
                with reader.sample_episodes(4) as episodes:
                    rewards = {
                        int(i): float(ep["reward"].sum())
                        for i, ep in zip(episodes.ids, episodes, strict=True)
                    }
            except WaitTimeoutError:  # nothing new yet
                continue
            again = consumed & rewards.keys()
            if again:
                raise AssertionError(f"episodes {sorted(again)} were handed out twice")
            consumed |= rewards.keys()
            found = reader.episodes(where=f"id in ({', '.join(map(str, rewards))})")
            for row in found.rows():
                if row["length"] != row["steps"]:  # a part the ring's end cut off
                    continue
                stored = rewards[row["id"]]
                if abs(row["ret"] - stored) > 1e-3 * max(1.0, abs(stored)):
                    raise AssertionError(
                        f"episode {row['id']}: its metadata says return {row['ret']}, "
                        f"its rows {stored}"
                    )
                recent.append((int(row["policy_version"]), float(row["ret"])))
            if recent and time.monotonic() - last_print >= every_s:
                last_print = time.monotonic()
                versions = [v for v, _ in recent]
                mean = sum(r for _, r in recent) / len(recent)
                print(
                    f"eval: {len(consumed)} episodes consumed, each once; the newest "
                    f"{len(recent)}, of policies v{min(versions)}-v{max(versions)}: mean "
                    f"return {mean:.1f}",
                    flush=True,
                )
                oldest_reported, recent = min(versions), []
        print(f"eval: {len(consumed)} episodes consumed, each once", flush=True)
        best = reader.episodes(
            where=f"policy_version >= {oldest_reported}", order_by="-ret", limit=3
        )
        listed = ", ".join(
            f"#{r['id']} {r['ret']:.0f} (v{r['policy_version']}, {r['env_id']})"
            for r in best.rows()
        )
        print(f"eval: best live episodes of policy v{oldest_reported} on: {listed}", flush=True)


def _connect(buffer: str) -> shmbuffer.Reader:
    """A reader of the "eval" table, once the daemon (started beside us) serves it."""
    deadline = time.monotonic() + DAEMON_START_TIMEOUT_S
    while True:
        try:
            return shmbuffer.Reader(buffer, table="eval", timeout=30.0, sample_timeout=0.5)
        except DaemonUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    name = unique_name("cartpole-tables")
    with Daemon.own(name, args.capacity, "transition", TABLES) as daemon:
        print(
            f"daemon {name!r}: {args.capacity:,} rows; tables replay (prioritized), eval (fifo)",
            flush=True,
        )
        evaluator = ctx.Process(target=evaluate, args=(name, stop), daemon=True)
        evaluator.start()

        def stop_evaluator() -> None:  # its last lines before the learner's figures
            stop.set()
            evaluator.join(30)
            if evaluator.is_alive():
                evaluator.kill()
                evaluator.join(5)

        try:
            with contextlib.suppress(KeyboardInterrupt):
                train(
                    args, daemon, prioritized=True, worker_meta=True, after_workers=stop_evaluator
                )
        finally:
            stop_evaluator()
    if evaluator.exitcode != 0:
        raise SystemExit(f"the evaluator failed (exit code {evaluator.exitcode})")


if __name__ == "__main__":
    main()
