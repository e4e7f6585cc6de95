"""Sampling scenario (issue "sampling and flow control"): what one sample request costs the
daemon, by buffer size, against the peers' samplers.

Timed is the code the daemon runs per request, called in this process — the container's table's
``sample_rows`` / ``sample_slices`` / ``update_priorities`` (sampler, weights, use counts,
generation check), no socket and no row copy (``daemon.sample`` measures the wire) — at 10k,
100k, 1M and 10M stored rows: uniform ``sample(256)``, prioritized ``sample(256)`` followed by
``update_priorities(256)``, and uniform ``sample_slices(32, 16)``. The peers are called the same
way, indices only: TorchRL ``RandomSampler`` / ``SliceSampler`` ``.sample(storage, n)`` on a
``LazyTensorStorage``, TorchRL's ``PrioritizedSampler`` and cpprb's ``PrioritizedReplayBuffer``
(whose ``sample`` also gathers its one float column: 256 values). Beside the daemon's uniform
draw, ``shmbuffer-reader-draw`` times what a learner's default ``Reader`` runs instead on its own
core: a draw over the live runs the daemon publishes and a read of the rows' stamps (their use
counts are raised by the daemon, in bulk).

Every buffer holds the same episodes (uniform random lengths 100-1000, the last one cut to fit)
in one float column, filled untimed; the prioritized ones then get the same random priorities.
At each size the implementations compared on one op are built together (shmbuffer's uniform
buffer with TorchRL's samplers; shmbuffer's prioritized buffer with cpprb's and TorchRL's), at
most ~1 GB at 10M rows, and freed before the next group. An op runs a few untimed calls
(first-use work such as a slice index), then ``reps`` repetitions of ``calls`` calls each
(sized to about ``rep_seconds`` per implementation), *interleaved*: one repetition of each
implementation in turn, so that a burst of load from other processes on a shared machine
lands on all of them rather than on whichever was being timed. A row reports the median
repetition, with the min and max per-call cost beside it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.adapters import missing_module
from bench.registry import Context, Row, make_row, scenario

NAME = "sampling.scaling"
SIZES = (10_000, 100_000, 1_000_000, 10_000_000)
QUICK_SIZES = (10_000, 100_000)
SHM = "shmbuffer"
#: A Reader's own uniform draw of 256 rows and their stamps, no round trip (the default for a
#: uniform table): what a learner's core spends per ``sample(256)`` before its gather.
READER_DRAW = "shmbuffer-reader-draw"

#: op -> (what one call does, rows it hands out)
OPS: dict[str, tuple[str, int]] = {
    "sample": ("uniform sample(256)", 256),
    "sample+update": ("prioritized sample(256) + update_priorities(256)", 256),
    "slices": ("uniform sample_slices(32, 16)", 32 * 16),
}
#: Bytes per handed-out row in the ``bytes`` column: its int64 index (no row data moves).
INDEX_BYTES = 8
PRIORITY_POOL = 64  # distinct update vectors, cycled

Call = Callable[[int], Any]
#: What one build offers: ``(impl, op, call)`` for each op it runs.
Offer = list[tuple[str, str, Call]]


@dataclass(frozen=True)
class Layout:
    """The episodes every implementation stores at one size, and the update priorities."""

    size: int
    lengths: np.ndarray  # int64, sums to size
    done: np.ndarray  # bool [size], True on each episode's last row
    priorities: np.ndarray  # float64 [size], set on prioritized buffers before timing
    updates: np.ndarray  # float64 [PRIORITY_POOL, 256], cycled by the timed updates

    @classmethod
    def make(cls, size: int, seed: int = 0) -> Layout:
        rng = np.random.default_rng(seed)
        lengths = rng.integers(100, 1001, size=size // 100 + 1)
        ends = np.cumsum(lengths)
        count = int(np.searchsorted(ends, size)) + 1
        lengths = lengths[:count].copy()
        lengths[-1] -= int(ends[count - 1]) - size
        done = np.zeros(size, dtype=np.bool_)
        done[np.cumsum(lengths) - 1] = True
        return cls(
            size=size,
            lengths=lengths.astype(np.int64),
            done=done,
            priorities=rng.uniform(0.05, 2.0, size),
            updates=rng.uniform(0.05, 2.0, (PRIORITY_POOL, 256)),
        )


# -- shmbuffer ------------------------------------------------------------------------------


def _container(layout: Layout, sampler_name: str) -> Any:
    from shmbuffer.registry.spans import load_compiled_draws
    from shmbuffer.ring.container import Container
    from shmbuffer.samplers import make_sampler

    load_compiled_draws()  # as a daemon has after its first LOAD_AFTER draws (spans.py)

    container = Container(layout.size, unit="transition", sampler=make_sampler(sampler_name))
    lengths = layout.lengths.tolist()
    for i in range(0, len(lengths), 2000):  # one reservation per 2,000 episodes: a fast fill
        part = lengths[i : i + 2000]
        container.commit(container.reserve_rows(sum(part), part).id)
    return container


@contextlib.contextmanager
def shm_uniform(layout: Layout) -> Iterator[Offer]:
    from shmbuffer.registry.shared_spans import SPANS_FILE, SpansFile, SpansView
    from shmbuffer.registry.spans import loaded_draws
    from shmbuffer.ring.publisher import SpansPublisher

    container = _container(layout, "uniform")
    # A learner's Reader draws a uniform table's rows itself over the runs the daemon
    # publishes, reading their stamps (clients/local_draws.py); its use counts reach the daemon
    # in bulk (READER_DRAW's note).
    folder = tempfile.mkdtemp(prefix="bench-spans-", dir=_shm_or_tmp())
    out = SpansFile(Path(folder) / SPANS_FILE)
    SpansPublisher(container.table, out)
    view = SpansView(Path(folder) / SPANS_FILE)
    stamps = np.zeros(layout.size, dtype=np.int64)  # the segment's generation stamps
    rng, kernels = np.random.default_rng(0), loaded_draws()
    try:
        yield [
            (SHM, "sample", lambda _: container.table.sample_rows(256)),
            (READER_DRAW, "sample", lambda _: view.draw(rng, 256, stamps, kernels)),
            (SHM, "slices", lambda _: container.table.sample_slices(32, 16)),
        ]
    finally:
        view.close()
        out.close()
        shutil.rmtree(folder, ignore_errors=True)


def _shm_or_tmp() -> str:
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


@contextlib.contextmanager
def shm_prioritized(layout: Layout) -> Iterator[Offer]:
    container = _container(layout, "prioritized")
    rows = np.arange(layout.size, dtype=np.int64)
    container.update_priorities(rows, layout.priorities)
    # The daemon's per-row generation stamps: a sample replies with them, an update is
    # checked against them (stale rows skipped), so both are part of its per-request work.
    stamps = np.zeros(layout.size, dtype=np.int64)
    updates = layout.updates

    table = container.table

    def sample_update(i: int) -> None:
        drawn = table.sample_rows(256)
        seen = stamps[drawn.rows]
        table.update_priorities(drawn.rows, updates[i % PRIORITY_POOL], seen, stamps)

    yield [(SHM, "sample+update", sample_update)]


# -- peers ----------------------------------------------------------------------------------


def _torchrl_storage(layout: Layout, sampler: Any = None) -> Any:
    import torch
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    logging.getLogger("torchrl").setLevel(logging.WARNING)
    storage = LazyTensorStorage(layout.size)
    rb = ReplayBuffer(storage=storage, **({} if sampler is None else {"sampler": sampler}))
    data = {"obs": torch.zeros(layout.size), "done": torch.from_numpy(layout.done)}
    rb.extend(TensorDict(data, batch_size=[layout.size]))  # tells the sampler too
    return storage


@contextlib.contextmanager
def torchrl_samplers(layout: Layout) -> Iterator[Offer]:
    from torchrl.data.replay_buffers.samplers import RandomSampler, SliceSampler

    storage = _torchrl_storage(layout)
    uniform = RandomSampler()
    slices = SliceSampler(num_slices=32, end_key="done")
    cached = SliceSampler(num_slices=32, end_key="done", cache_values=True)
    yield [
        ("torchrl-RandomSampler", "sample", lambda _: uniform.sample(storage, 256)),
        ("torchrl-SliceSampler", "slices", lambda _: slices.sample(storage, 512)),
        ("torchrl-SliceSampler-cached", "slices", lambda _: cached.sample(storage, 512)),
    ]


@contextlib.contextmanager
def torchrl_prioritized(layout: Layout) -> Iterator[Offer]:
    import torch
    from torchrl.data.replay_buffers.samplers import PrioritizedSampler

    sampler = PrioritizedSampler(max_capacity=layout.size, alpha=0.6, beta=0.4, eps=1e-6)
    storage = _torchrl_storage(layout, sampler)
    # TorchRL's sum tree is float32, and its update_priority refuses float64 tensors
    priorities = torch.from_numpy(layout.priorities).to(torch.float32)
    sampler.update_priority(torch.arange(layout.size), priorities)
    updates = torch.from_numpy(layout.updates).to(torch.float32)

    def sample_update(i: int) -> None:
        index, _ = sampler.sample(storage, 256)
        sampler.update_priority(index, updates[i % PRIORITY_POOL])

    yield [("torchrl-PrioritizedSampler", "sample+update", sample_update)]


@contextlib.contextmanager
def cpprb_prioritized(layout: Layout) -> Iterator[Offer]:
    import cpprb

    rb = cpprb.PrioritizedReplayBuffer(
        layout.size, {"obs": {"dtype": np.float32}}, alpha=0.6, eps=1e-6
    )
    rb.add(obs=np.zeros(layout.size, dtype=np.float32))
    rb.update_priorities(np.arange(layout.size), layout.priorities)
    updates = layout.updates

    def sample_update(i: int) -> None:
        drawn = rb.sample(256, beta=0.4)
        rb.update_priorities(drawn["indexes"], updates[i % PRIORITY_POOL])

    yield [("cpprb-PrioritizedReplayBuffer", "sample+update", sample_update)]


#: Built together at each size, their repetitions interleaved: shmbuffer first, then the peers
#: it is compared with. The module is imported (by the availability check) before a build is
#: timed, so imports (tensordict's: 1.5 s) stay out of ``build_s`` and ``build_mb``.
Build = tuple[str, Callable[[Layout], contextlib.AbstractContextManager[Offer]], str]
GROUPS: list[list[Build]] = [
    [
        ("shmbuffer uniform", shm_uniform, "shmbuffer.ring.container"),
        ("torchrl RandomSampler/SliceSampler", torchrl_samplers, "torchrl.data"),
    ],
    [
        ("shmbuffer prioritized", shm_prioritized, "shmbuffer.ring.container"),
        ("cpprb PrioritizedReplayBuffer", cpprb_prioritized, "cpprb"),
        # its sum tree is torchrl's C++ extension, which a torch of another ABI cannot load
        ("torchrl PrioritizedSampler", torchrl_prioritized, "torchrl._torchrl"),
    ],
]
BUILDS: list[Build] = [build for group in GROUPS for build in group]


# -- timing ---------------------------------------------------------------------------------


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _calls_per_rep(call: Call, reps: int, rep_seconds: float, cap: float) -> int:
    """Calls per repetition for ~``rep_seconds`` (after an untimed first call: first-use work
    such as a slice index, caches, lazy imports)."""
    call(0)
    one = float("inf")
    for i in range(1, 4):  # the fastest of three sizes the repetitions
        t0 = time.perf_counter()
        call(i)
        one = min(one, time.perf_counter() - t0)
    one = max(one, 1e-7)
    return int(min(max(3, rep_seconds / one), 5000, max(1, cap / reps / one)))


def _interleaved(
    calls: list[Call], reps: int, rep_seconds: float, cap: float
) -> list[tuple[list[float], int]]:
    """Seconds of each of ``reps`` repetitions of every call, and its calls per repetition:
    round ``r`` times repetition ``r`` of each call in turn."""
    counts = [_calls_per_rep(call, reps, rep_seconds, cap) for call in calls]
    times: list[list[float]] = [[] for _ in calls]
    i = 4
    for _ in range(reps):
        for call, count, out in zip(calls, counts, times, strict=True):
            gc.collect()
            t0 = time.perf_counter()
            for _ in range(count):
                call(i)
                i += 1
            out.append(time.perf_counter() - t0)
    return list(zip(times, counts, strict=True))


@dataclass(frozen=True)
class Timing:
    impl: str
    op: str
    seconds: list[float]  # per repetition
    calls: int  # per repetition
    us: list[float]  # per call, each repetition, ascending
    build: str  # the title of the build that offered it
    build_s: float  # creating and filling the buffer (untimed in the rows)
    build_mb: float  # resident memory gained while it was built and first used (approximate)


def _time_group(
    group: list[tuple[str, Callable[[Layout], contextlib.AbstractContextManager[Offer]]]],
    layout: Layout,
    reps: int,
    rep_seconds: float,
    cap: float,
    failed: Callable[[str, Exception], None],
) -> list[Timing]:
    """Build a group's implementations, time each op they offer with the repetitions of every
    implementation interleaved, free them (their calls die with this frame). A build that
    fails is reported through ``failed`` and left out; the others still run."""
    built: list[tuple[str, str, str, Call, float, float]] = []  # title, impl, op, call, s, MB
    with contextlib.ExitStack() as stack:
        for title, build in group:
            gc.collect()
            rss0 = _rss_mb()
            t0 = time.perf_counter()
            try:
                offers = stack.enter_context(build(layout))
            except Exception as exc:  # one build failing leaves the others to run
                failed(title, exc)
                continue
            build_s = time.perf_counter() - t0
            for _, _, call in offers:
                call(0)  # first-use work (a slice index) counts in this build's memory
            grown = _rss_mb() - rss0
            built += [(title, impl, op, call, build_s, grown) for impl, op, call in offers]
        out = []
        for op in dict.fromkeys(b[2] for b in built):
            mine = [b for b in built if b[2] == op]
            try:
                measured = _interleaved([b[3] for b in mine], reps, rep_seconds, cap)
            except Exception as exc:
                failed(f"{op} of {', '.join(b[1] for b in mine)}", exc)
                continue
            for b, (times, calls) in zip(mine, measured, strict=True):
                us = sorted(t / calls * 1e6 for t in times)
                out.append(Timing(b[1], op, times, calls, us, b[0], b[4], b[5]))
        del built
    gc.collect()
    return out


def _label(size: int) -> str:
    return f"{size // 1_000_000}M" if size >= 1_000_000 else f"{size // 1000}k"


@scenario(NAME)
def scaling(ctx: Context) -> list[Row]:
    """Daemon-side cost of uniform sample(256), prioritized sample(256) + update_priorities(256)
    and sample_slices(32, 16) at 10k, 100k, 1M and 10M stored rows (in-process container calls,
    no wire, no row copy); vs TorchRL RandomSampler/SliceSampler/PrioritizedSampler and cpprb
    PrioritizedReplayBuffer."""
    sizes = QUICK_SIZES if ctx.quick else SIZES
    reps, rep_seconds = (3, 0.01) if ctx.quick else (9, 0.03)
    ctx.note(
        NAME,
        f"per op and size: {reps} repetitions of N calls (N sized to ~{rep_seconds * 1e3:g} ms, "
        "max 5,000), shmbuffer's and its peers' interleaved (one repetition of each in turn); "
        "us_per_call is the median repetition, us_min/us_max the fastest and "
        "slowest; rows = rows handed out (256 per sample, 512 per slice call), bytes = their "
        f"int64 indices ({INDEX_BYTES} B each: no row data moves); pass=steady",
    )
    from shmbuffer.registry.spans import load_compiled_draws
    from shmbuffer.samplers.sumtree import jit_available

    loops = "compiled (numba)" if jit_available() else "numpy loops (numba not installed)"
    draws = "compiled (numba)" if load_compiled_draws() else "numpy (numba not installed)"
    ctx.note(
        NAME, f"shmbuffer's prioritized sum tree: {loops}; uniform draws and use counts: {draws}"
    )
    ctx.note(
        NAME,
        "episodes of uniform random length 100-1000 in one float column (TorchRL: plus its "
        "done flags); prioritized buffers hold random priorities in [0.05, 2); shmbuffer "
        "prioritized: alpha 0.6, beta 0.4, eps 1e-6 (peers the same)",
    )
    ctx.note(
        NAME,
        "shmbuffer = Container.sample_rows/sample_slices/update_priorities in transition unit "
        "(what the daemon runs per request: sampler, weights, use counts; update with "
        "generation stamps checked). TorchRL RandomSampler draws randint(len(storage)) with "
        "no notion of episodes or uncommitted rows; SliceSampler(num_slices=32, "
        "end_key='done') finds episode ends from the done column on every call, picks an "
        "episode then a start (not uniform over starts); -cached is cache_values=True, valid "
        "only while nothing is written (an extend clears it); cpprb's sample includes its "
        "256-value gather and weights",
    )
    ctx.note(
        NAME,
        f"{READER_DRAW} = what a learner's default Reader runs per sample(256) of a uniform "
        "table before its gather: a draw over the live runs the daemon publishes (spans.bin, "
        "seqlocked) and a read of the 256 rows' generation stamps, no round trip; the rows' "
        "use counts are raised by the daemon from the reader's bulk reports, on the daemon's "
        "core (that count's cost is the difference from the shmbuffer row at 10M)",
    )
    out: list[Row] = []
    per_op: dict[tuple[str, str, int], list[float]] = {}
    memory: list[str] = []
    for size in sizes:
        layout = Layout.make(size)
        for group in GROUPS:
            ready = []
            for title, build, module in group:
                reason = missing_module(module)
                if reason:
                    if size == sizes[0]:  # an ImportError can quote a whole mangled C++ symbol
                        ctx.note(NAME, f"{title} skipped: {reason[:160]}")
                    continue
                ready.append((title, build))

            def failed(what: str, exc: Exception, size: int = size) -> None:
                ctx.note(NAME, f"{what} at {_label(size)} failed: {type(exc).__name__}: {exc}")

            timings = _time_group(ready, layout, reps, rep_seconds, ctx.max_op_seconds, failed)
            if size == sizes[-1]:
                seen = dict.fromkeys((t.build, t.build_mb) for t in timings)
                memory += [f"{title} {mb:.0f} MB" for title, mb in seen]
            for t in timings:
                per_op[(t.impl, t.op, size)] = t.us
                per_call = OPS[t.op][1]
                out.append(
                    make_row(
                        NAME,
                        t.impl,
                        f"{t.op}@{_label(size)}",
                        rows=per_call * t.calls,
                        nbytes=per_call * t.calls * INDEX_BYTES,
                        seconds=statistics.median(t.seconds),
                        pass_="steady",
                        chunk=per_call,
                        calls=t.calls,
                        reps=reps,
                        stored_rows=size,
                        sampler_op=t.op,
                        call=OPS[t.op][0],
                        us_per_call=statistics.median(t.us),
                        us_min=t.us[0],
                        us_max=t.us[-1],
                        build_s=t.build_s,
                        build_mb=t.build_mb,
                    )
                )
        del layout
    ctx.note(
        NAME,
        f"resident memory each build gained at {_label(sizes[-1])} rows (approximate: RSS "
        "before the build vs after its first calls): " + "; ".join(memory),
    )
    _targets(ctx, per_op, sizes)
    return out


# -- targets --------------------------------------------------------------------------------


def _targets(ctx: Context, per_op: dict[tuple[str, str, int], list[float]], sizes: Any) -> None:
    """The sampling targets (listed in ``docs/sampling.md``) as notes, met or missed (never
    adjusted), judged on the medians and, after ``|``, on the fastest repetitions: on a shared
    machine other processes only ever add time, so the fastest repetition is the better
    estimate of the code's own cost."""

    def pick(impl: str, op: str, size: int, stat: Any) -> float | None:
        us = per_op.get((impl, op, size))
        return stat(us) if us else None

    def both(fn: Callable[[Any], str | None]) -> str | None:
        got = [fn(stat) for stat in (statistics.median, min)]
        return None if None in got else f"{got[0]} | fastest: {got[1]}"

    lo, hi = sizes[0], sizes[-1]
    span = f"{_label(lo)} -> {_label(hi)}" + (" (quick: not 10M)" if hi < SIZES[-1] else "")
    parts = []
    for op in OPS:

        def growth(stat: Any, op: str = op) -> str | None:
            a, b = pick(SHM, op, lo, stat), pick(SHM, op, hi, stat)
            if a is None or b is None:
                return None
            return f"{a:.0f} -> {b:.0f} us = {b / a:.2f}x {_verdict(b / a <= 2)}"

        text = both(growth)
        if text:
            parts.append(f"{op} {text}")
    ctx.note(NAME, f"target within 2x from {span}, median: " + "; ".join(parts))

    def versus(peer: str, op: str, size: int, strict: bool, impl: str = SHM) -> str | None:
        def compare(stat: Any) -> str | None:
            ours, theirs = pick(impl, op, size, stat), pick(peer, op, size, stat)
            if ours is None or theirs is None:
                return None
            ok = ours < theirs if strict else ours <= theirs
            return f"{ours:.1f} vs {theirs:.1f} us = {theirs / ours:.2f}x as fast {_verdict(ok)}"

        text = both(compare)
        who = "" if impl == SHM else f" ({impl})"
        return None if text is None else f"{op}@{_label(size)}{who} vs {peer}: {text}"

    peers = {
        "sample": ["torchrl-RandomSampler"],
        "slices": ["torchrl-SliceSampler", "torchrl-SliceSampler-cached"],
        "sample+update": ["torchrl-PrioritizedSampler"],
    }
    big = [s for s in sizes if s >= 1_000_000]
    parts = [
        text
        for op, names in peers.items()
        for peer in names
        for size in big
        if (text := versus(peer, op, size, strict=True))
    ]
    parts += [  # what a learner's default Reader spends on its own core (READER_DRAW)
        text
        for size in big
        if (text := versus("torchrl-RandomSampler", "sample", size, True, READER_DRAW))
    ]
    ctx.note(
        NAME,
        "target faster than TorchRL at >= 1M rows, median: "
        + ("; ".join(parts) or "no size >= 1M run"),
    )
    cpprb = "cpprb-PrioritizedReplayBuffer"
    parts = [text for size in sizes if (text := versus(cpprb, "sample+update", size, strict=False))]
    ctx.note(NAME, "target prioritized at least as fast as cpprb, median: " + "; ".join(parts))


def _verdict(ok: bool) -> str:
    return "(met)" if ok else "(MISSED)"
