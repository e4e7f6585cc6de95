"""What journaling a sample costs: CPU time per ``sample`` request through
``BufferService.handle`` in-process (no sockets), with and without what keeps samples across
``--resume`` (SAMPLE and lease records, use counters in a file on /dev/shm).

    .venv/bin/python -m bench.sample_journal [--blocks 40] [--block 100]

Each case fills a 100k-row buffer (episodes of 100 rows, obs f32[8]) on /dev/shm, then
alternates blocks of ``--block`` requests with the journal's sample hooks off (the container's
table and the lease table tell nobody, use counters in anonymous memory: what a daemon did before)
and on, in one process, so both halves see the same machine load; it prints the median and
the minimum over blocks of the CPU microseconds per request (``time.process_time``: the
daemon thread's CPU, not the machine's). The cases are what a daemon serves most:
``sample(256)`` rows under the uniform and the prioritized sampler, 16 leased episodes
(``sample_episodes``, released in the next request as the Reader does) and a consume-once FIFO
stream (``max_times_sampled=1``, 256 rows a call, refilled by a writer outside the timing).
The buffer is small (a few MB) and removed.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from shmbuffer.daemon.config import DaemonConfig
from shmbuffer.daemon.service import BufferService
from shmbuffer.wire.protocol import request, validate_request

SPEC = {"obs": {"dtype": "float32", "shape": [8]}}
CAPACITY = 100_000
EPISODE = 100
W, R = b"bench-writer", b"bench-reader"


class Service:
    def __init__(self, storage: str, **config: Any) -> None:
        name = f"bench-{uuid.uuid4().hex[:8]}"
        cfg = DaemonConfig(name=name, storage_dir=storage, capacity=CAPACITY, seed=0, **config)
        self.service = BufferService(cfg)
        self.now = 0.0
        for who, role in ((W, "writer"), (R, "reader")):
            self("hello", who, role=role, pid=1, host="bench")
        self("define_schema", W, schema=SPEC)

    def __call__(self, op: str, who: bytes, **fields: Any) -> dict[str, Any]:
        checked = validate_request(request(op, 1, **fields))
        return self.service.handle(who, op, checked, [], self.now)[0]

    def write(self, episodes: int) -> None:
        for _ in range(episodes):
            rid = self("reserve", W, rows=EPISODE)["reservation"]
            self("commit", W, reservation=rid)

    def close(self) -> None:
        if self.service.journal is not None:
            self.service.journal.close()
        if self.service.segment is not None:
            self.service.segment.close()


def timed(step: Callable[[], None], between: Callable[[], None] | None, n: int) -> float:
    """CPU microseconds per ``step`` (``between`` runs outside the timing)."""
    total = 0.0
    for _ in range(n):
        if between is not None:
            between()
        t0 = time.process_time()
        step()
        total += time.process_time() - t0
    return total / n * 1e6


class Hooks:
    """Turns what the journal hooks into the container's table and the lease table off and
    on."""

    def __init__(self, service: BufferService) -> None:
        self.table, self.leases = service.container.table, service.leases
        self.on = (self.table.sample_log, self.leases.log, self.table.use_counts)
        self.anonymous = np.array(self.table.use_counts)

    def set(self, on: bool) -> None:
        if on:
            log, lease_log, counts = self.on
            self.on[2][:] = self.anonymous  # the counts go on where the other half left them
        else:
            log, lease_log, counts = None, None, self.anonymous
            counts[:] = self.on[2]
        self.table.sample_log, self.leases.log, self.table.use_counts = (
            log,
            lease_log,
            counts,
        )


def case(name: str, storage: str, blocks: int, block: int) -> dict[bool, list[float]]:
    config: dict[str, Any] = {}
    if name == "prioritized rows(256)":
        config = {"sampler": "prioritized"}
    elif name == "fifo consume rows(256)":
        config = {"sampler": "fifo", "max_times_sampled": 1}
    svc = Service(storage, **config)
    step: Callable[[], None]
    between: Callable[[], None] | None = None
    try:
        if name.startswith("fifo"):
            svc.write(CAPACITY // EPISODE // 2)
            sampler = svc.service.container.sampler

            def refill() -> None:
                if sampler.stats()["unconsumed_episodes"] < 4:
                    svc.write(3)

            between = refill

            def step() -> None:
                svc("sample", R, kind="rows", n=256)

        elif name.startswith("leased"):
            svc.write(CAPACITY // EPISODE)
            held: list[int] = []

            def step() -> None:
                fields: dict[str, Any] = {"kind": "episodes", "n": 16, "lease": True}
                if held:
                    fields["release"] = held.pop()
                held.append(svc("sample", R, **fields)["lease"])

        else:
            svc.write(CAPACITY // EPISODE)

            def step() -> None:
                svc("sample", R, kind="rows", n=256)

        hooks = Hooks(svc.service)
        out: dict[bool, list[float]] = {False: [], True: []}
        timed(step, between, block)  # warm up
        for i in range(2 * blocks):
            on = bool(i % 2) if i // 2 % 2 else not i % 2  # off-on, then on-off, ...
            hooks.set(on)
            out[on].append(timed(step, between, block))
        hooks.set(True)
        return out
    finally:
        svc.close()


CASES = [
    "uniform rows(256)",
    "prioritized rows(256)",
    "leased episodes(16)",
    "fifo consume rows(256)",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--block", type=int, default=100)
    args = parser.parse_args()
    storage = tempfile.mkdtemp(prefix="shmbuffer-bench-", dir="/dev/shm")
    try:
        print(
            f"CPU us per sample request, {args.blocks} blocks of {args.block} each way "
            "(median / min over blocks):"
        )
        print(f"  {'case':26s} {'hooks off':>15s} {'hooks on':>15s} {'extra (median)':>15s}")
        for name in CASES:
            got = case(name, storage, args.blocks, args.block)
            off, on = got[False], got[True]
            extra = statistics.median(b - a for a, b in zip(off, on, strict=True))
            print(
                f"  {name:26s} {statistics.median(off):7.1f} / {min(off):5.1f} "
                f"{statistics.median(on):7.1f} / {min(on):5.1f} {extra:+15.1f}"
            )
    finally:
        shutil.rmtree(storage, ignore_errors=True)


if __name__ == "__main__":
    main()
