"""Core scenarios (issue "the in-process buffer"): transitions and Atari-like episodes.

Every implementation does the same work on the same pre-generated data, one after another in
one run; setup (buffer creation aside, reported as ``create``) and data conversion are untimed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bench import data
from bench.adapters import Adapter, Shmbuffer, ShmbufferShared, Unsupported, run_each
from bench.copylimit import CopyLimit
from bench.peers import Cpprb, TorchRLMemmap, TorchRLTensor
from bench.registry import Context, Row, make_row, scenario, timed

IMPLS: list[type[Adapter]] = [
    Shmbuffer,
    ShmbufferShared,
    TorchRLTensor,
    TorchRLMemmap,
    Cpprb,
    CopyLimit,
]


class _Recorder:
    """Times calls on one adapter and appends result rows."""

    def __init__(
        self, ctx: Context, scenario_name: str, adapter: Adapter, rows: list[Row], row_bytes: int
    ):
        self.ctx = ctx
        self.scenario, self.adapter, self.rows, self.row_bytes = (
            scenario_name,
            adapter,
            rows,
            row_bytes,
        )

    def add(self, op: str, pass_: str, n_rows: int, seconds: float, **extra: Any) -> None:
        self.rows.append(
            make_row(
                self.scenario,
                self.adapter.name,
                op,
                rows=n_rows,
                nbytes=n_rows * self.row_bytes,
                seconds=seconds,
                pass_=pass_,
                **extra,
            )
        )

    def run(
        self, op: str, pass_: str, fn: Any, items: list[Any], per_call: int, *, cap: bool = True
    ) -> None:
        """Time ``fn`` over ``items`` (each call moves ``per_call`` rows); Unsupported -> note.
        ``cap=False``: no time cap (a first write pass must fill the buffer)."""
        self.adapter.set_pass(pass_)
        try:
            budget = self.ctx.max_op_seconds if cap else float("inf")
            seconds, calls = timed(fn, items, budget)
        except Unsupported as exc:
            if f"{op}: {exc}" not in self.adapter.notes:
                self.adapter.notes.append(f"{op}: {exc}")
            return
        if calls < len(items):
            self.ctx.note(
                self.scenario,
                f"{self.adapter.name} {op} {pass_}: stopped after {calls} of {len(items)} calls "
                f"(> {self.ctx.max_op_seconds:g} s)",
            )
        self.add(op, pass_, per_call * calls, seconds, chunk=per_call, calls=calls)


@scenario("core.transitions")
def transitions(ctx: Context) -> list[Row]:
    """1M transitions (obs f32[64], action i64, reward f32, done bool) into a 1M-row buffer in
    chunks of 1,000; read back in chunks (slices and index arrays); 1,000 samples of 256."""
    name = "core.transitions"
    n, chunk, batches, batch = ctx.size(1_000_000), 1000, ctx.size(1000), 256
    chunks = data.chunks(data.transitions(n), chunk)
    ranges = [(a, min(a + chunk, n)) for a in range(0, n, chunk)]
    index_chunks = [np.arange(a, b) for a, b in ranges]
    row_bytes = data.row_bytes(data.TRANSITION_SPEC)
    ctx.note(
        name,
        "TorchRL's slice read returns a view of its storage (no copy); read-index always copies",
    )

    def body(adapter: Adapter, create_s: float, rows: list[Row]) -> None:
        rec = _Recorder(ctx, name, adapter, rows, row_bytes)
        rec.add("create", "first", n, create_s)
        natives = [adapter.convert(c) for c in chunks]
        rec.run("write", "first", adapter.write, natives, chunk, cap=False)
        rec.run("write", "steady", adapter.write, natives, chunk)
        for pass_ in ("first", "steady"):
            rec.run("read", pass_, lambda r: adapter.read(*r), ranges, chunk)
        for pass_ in ("first", "steady"):
            rec.run("read-index", pass_, adapter.read_index, index_chunks, chunk)
        adapter.prepare_sampling()
        for pass_ in ("first", "steady"):
            rec.run("sample", pass_, lambda _: adapter.sample(batch), range(batches), batch)

    return run_each(
        ctx, name, IMPLS, body, capacity=n, spec=data.TRANSITION_SPEC, unit="transition"
    )


@scenario("core.episodes")
def episodes(ctx: Context) -> list[Row]:
    """2,000 episodes x 200 steps of obs u8[4,84,84] into a 100,000-row buffer (wraps 4x), one
    episode per extend; then 1,000 samples of 256 rows and 200 calls of sample_episodes(32).
    Episodes cycle through a pool of 50 distinct ones (11 GB would not fit in memory)."""
    name = "core.episodes"
    length, capacity = 200, ctx.size(100_000)
    count, batches, ep_calls = ctx.size(2000), ctx.size(1000), ctx.size(200)
    pool = data.episodes(10 if ctx.quick else 50, length)
    order = [pool[i % len(pool)] for i in range(count)]
    fill = capacity // length  # episodes written into the fresh buffer; the rest overwrite
    row_bytes = data.row_bytes(data.ATARI_SPEC)
    ctx.note(
        name,
        "TorchRL has no episode unit: each episode is one extend of 200 rows; "
        "sample_episodes is SliceSampler(num_slices=32, end_key='done')",
    )
    ctx.note(name, "sample ops run once, on the full (wrapped) buffer: pass=steady")

    def body(adapter: Adapter, create_s: float, rows: list[Row]) -> None:
        rec = _Recorder(ctx, name, adapter, rows, row_bytes)
        rec.add("create", "first", capacity, create_s)
        natives = {id(ep): adapter.convert(ep) for ep in pool}
        seq = [natives[id(ep)] for ep in order]
        rec.run("write", "first", adapter.write, seq[:fill], length, cap=False)
        rec.run("write", "steady", adapter.write, seq[fill:], length)
        adapter.prepare_sampling()
        rec.run("sample", "steady", lambda _: adapter.sample(256), range(batches), 256)
        rec.run(
            "sample-episodes",
            "steady",
            lambda _: adapter.sample_episodes(32, length),
            range(ep_calls),
            32 * length,
        )

    return run_each(ctx, name, IMPLS, body, capacity=capacity, spec=data.ATARI_SPEC, unit="episode")
