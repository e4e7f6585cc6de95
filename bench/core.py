"""Core scenarios (issue "the in-process buffer"): transitions and Atari-like episodes, and the
creation of a large buffer with every page reserved.

Every implementation does the same work on the same pre-generated data, one after another in
one run; setup (buffer creation aside, reported as ``create``) and data conversion are untimed.
"""

from __future__ import annotations

import gc
import mmap
import os
import resource
import time
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


CREATE_IMPLS: list[type[Adapter]] = [Shmbuffer, ShmbufferShared, Cpprb]
CREATE_PAUSE = 3.0  # s before each creation; see the note in ``create``
QUICK_CREATE_PAUSE = 0.2  # --quick checks that creation works, not its ranking: 4 x 3 s saved
CREATE_TARGET = (10.0, 2.0)  # a 10 GB buffer ready in <= 2 s


def _cpu() -> float:
    """CPU seconds this process has used, all threads, kernel time included."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _resident() -> int:
    """This process's resident bytes, shared memory included (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _available(path: str) -> int:
    """Bytes free on the file system holding ``path`` (its nearest existing ancestor)."""
    while not os.path.exists(path):
        path = os.path.dirname(path)
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        info = {k: v for k, v in (line.split(":", 1) for line in f)}
    return int(info["MemAvailable"].split()[0]) * 1024


def _kernel_floor(nbytes: int) -> float:
    """Seconds for the kernel alone to hand out ``nbytes`` of zeroed anonymous pages, one
    thread: ``mmap(MAP_POPULATE)``, the floor under any allocator that reserves its pages."""
    t0 = time.perf_counter()
    mm = mmap.mmap(-1, nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    seconds = time.perf_counter() - t0
    mm.close()
    return seconds


@scenario("core.create")
def create(ctx: Context) -> list[Row]:
    """Creating a 4 GB buffer of Atari rows (obs u8[4,84,84] + scalars; ``--create-gb``) with
    every page reserved: shmbuffer in private memory and named (tmpfs), vs cpprb, one after
    another, and the kernel's own MAP_POPULATE of the same bytes."""
    name = "core.create"
    gb = ctx.create_gb / 20 if ctx.quick else ctx.create_gb
    row_bytes = data.row_bytes(data.ATARI_SPEC)
    capacity = max(1, int(gb * 1e9) // row_bytes)
    nbytes = capacity * row_bytes
    order = ctx.rotate(CREATE_IMPLS)  # none always runs first across --repeat
    pause = QUICK_CREATE_PAUSE if ctx.quick else CREATE_PAUSE
    ctx.note(
        name,
        f"{capacity:,} rows x {row_bytes:,} B = {nbytes / 1e9:.2f} GB; create = the adapter's "
        "constructor (shmbuffer: Buffer(schema=...), prefaulted; cpprb: ReplayBuffer(N, env)); "
        "resident = VmRSS gained, proof the pages are reserved, not lazily mapped; cpu = CPU "
        "seconds of this process during the create, all threads (what the wall time is made "
        "of on a shared machine). The order rotates with each run (--repeat), and "
        f"each creation starts {pause:g} s after the last buffer was freed (on a VM "
        "with free-page reporting, memory freed moments before is still backed by the host "
        "and cheaper to get: without the pause, the running order would decide the ranking). "
        "The 10 GB figure: --create-gb 10 --repeat 1, alone on the machine",
    )
    best: dict[str, tuple[float, int, float]] = {}  # impl -> seconds, resident, cpu seconds
    for cls in order:
        reason = cls.missing()
        room = _mem_available()
        if cls is ShmbufferShared:
            room = min(room, _available("/dev/shm"))
        if not reason and nbytes * 1.1 > room:
            reason = f"{nbytes:,} B needed, {room:,} B free"
        if reason:
            ctx.note(name, f"{cls.name} skipped: {reason}")
            continue
        gc.collect()
        time.sleep(pause)
        adapter = None
        try:
            rss0, cpu0 = _resident(), _cpu()
            t0 = time.perf_counter()
            adapter = cls(
                capacity=capacity, spec=data.ATARI_SPEC, unit="episode", tmpdir=ctx.tmpdir
            )
            seconds = time.perf_counter() - t0
            best[cls.name] = (seconds, _resident() - rss0, _cpu() - cpu0)
        except Exception as exc:
            ctx.note(name, f"{cls.name} failed: {type(exc).__name__}: {exc}")
        finally:
            if adapter is not None:
                adapter.close()
            del adapter
            gc.collect()
    floor = None
    if nbytes * 1.1 < _mem_available():
        time.sleep(pause)
        floor = _kernel_floor(nbytes)
    rows = [
        make_row(
            name,
            impl,
            "create-reserved",
            rows=capacity,
            nbytes=nbytes,
            seconds=s,
            pass_="first",
            resident_gb=round(res / 1e9, 3),
            cpu_seconds=round(cpu, 3),
        )
        for impl, (s, res, cpu) in best.items()
    ]
    if floor is not None:
        ctx.note(
            name,
            f"kernel floor: mmap(MAP_POPULATE) of {nbytes / 1e9:.2f} GB, one thread: {floor:.2f} s "
            f"({nbytes / floor / 1e9:.2f} GB/s)",
        )
    peer = best.get(Cpprb.name)
    target_gb, target_s = CREATE_TARGET
    for impl in (Shmbuffer.name, ShmbufferShared.name):
        if impl not in best:
            continue
        seconds, res, cpu = best[impl]
        rate = nbytes / seconds / 1e9
        projected = target_gb / rate
        vs = (
            f"; {peer[0] / seconds:.2f}x as fast as cpprb ({peer[0]:.2f} s, cpu {peer[2]:.2f} s)"
            if peer
            else ""
        )
        verdict = "met" if projected <= target_s else "MISSED"
        at = "" if gb >= target_gb else f", {target_gb:g} GB projected {projected:.1f} s"
        ctx.note(
            name,
            f"{impl}: {seconds:.2f} s = {rate:.2f} GB/s (cpu {cpu:.2f} s), {res / 1e9:.2f} GB "
            f"resident{vs}; target {target_gb:g} GB in <= {target_s:g} s: {verdict}{at}",
        )
    return rows
