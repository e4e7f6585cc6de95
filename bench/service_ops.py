"""The daemon's own CPU per write: ``reserve`` carrying the previous write's commit, run
through :class:`~shmbuffer.daemon.service.BufferService` (what the daemon's loop runs per
request, validation included, without sockets), plain and with metadata attached.

Each write is a reservation of one 10-row episode into a full ring (so each also evicts one),
journaled as the daemon journals it. No peer has a daemon: this is the control plane's cost
that every local write pays, what ``rollout`` and ``contention`` spend on the daemon's core.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from typing import Any

from bench.registry import Context, Row, make_row, scenario

NAME = "daemon.service"
ROWS = 10  # per write
META = {"ret": 1.5, "policy_version": 3, "env_id": "e1"}


@scenario(NAME)
def service(ctx: Context) -> list[Row]:
    """CPU microseconds per reserve+commit, plain and with three metadata values."""
    writes = 2_000 if ctx.quick else 20_000
    ctx.note(
        NAME,
        f"BufferService (no sockets), unit=episode, capacity {100 * ROWS * 100:,} rows, "
        f"{ROWS}-row episodes into a full ring, each reserve carrying the last one's commit, "
        f"journaled; {writes:,} writes per repetition, best of 5, CPU time (process_time); "
        f"with-meta: the commit attaches {META}",
    )
    rows: list[Row] = []
    for op, meta in (("reserve+commit", None), ("reserve+commit-with-meta", META)):
        us = _best_us(writes, meta)
        rows.append(
            make_row(
                NAME,
                "shmbuffer-daemon",
                op,
                rows=writes * ROWS,
                nbytes=0,
                seconds=us * writes / 1e6,
                pass_="steady",
                calls=writes,
                us_per_call=us,
            )
        )
    return rows


def _best_us(writes: int, meta: dict[str, Any] | None) -> float:
    from shmbuffer.daemon.config import DaemonConfig
    from shmbuffer.daemon.service import BufferService
    from shmbuffer.wire.protocol import request, validate_request

    storage = tempfile.mkdtemp(prefix="bench-service-", dir="/dev/shm")
    config = DaemonConfig(
        name=f"bench-{uuid.uuid4().hex[:8]}",
        storage_dir=storage,
        capacity=100 * ROWS * 100,
        unit="episode",
        seed=0,
    )
    service = BufferService(config)
    try:

        def call(op: str, **fields: Any) -> dict[str, Any]:
            checked = validate_request(request(op, 1, **fields))
            return service.handle(b"w", op, checked, [], 0.0)[0]

        call("hello", role="writer", pid=1, host="bench")
        call("define_schema", schema={"obs": {"dtype": "float32", "shape": [4]}})
        previous = call("reserve", rows=ROWS)["reservation"]
        for _ in range(config.capacity // ROWS):  # fill the ring: every later write evicts
            fields: dict[str, Any] = {"rows": ROWS, "commit": previous}
            previous = call("reserve", **fields)["reservation"]
        best = float("inf")
        for _ in range(5):
            start = time.process_time()
            for _ in range(writes):
                fields = {"rows": ROWS, "commit": previous}
                if meta is not None:
                    fields["metas"] = [[previous, meta]]
                previous = call("reserve", **fields)["reservation"]
            best = min(best, (time.process_time() - start) / writes * 1e6)
        return best
    finally:
        if service.segment is not None:
            service.segment.close()
        shutil.rmtree(storage, ignore_errors=True)
