"""Scenario registry, run context and the result-row format shared by all scenarios."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

Row = dict[str, Any]
ScenarioFn = Callable[["Context"], list[Row]]

SCENARIOS: dict[str, ScenarioFn] = {}
WORKER_COUNTS = (1, 2, 4)
QUICK_WORKER_COUNTS = (2,)


def scenario(name: str) -> Callable[[ScenarioFn], ScenarioFn]:
    """Register a scenario function under ``name`` (e.g. ``"core.transitions"``)."""

    def register(fn: ScenarioFn) -> ScenarioFn:
        if name in SCENARIOS:
            raise ValueError(f"scenario {name!r} registered twice")
        SCENARIOS[name] = fn
        return fn

    return register


@dataclass
class Context:
    """What a scenario gets from the runner: size mode, a scratch dir and a place for notes."""

    quick: bool = False
    tmpdir: str = "/tmp"
    #: Where the daemons' segments go (``--shm-dir``); None: /dev/shm where it is writable.
    shm_dir: str | None = None
    max_op_seconds: float = 5.0  # an op stops after the call that crosses this (calls reported)
    create_gb: float = 4.0  # size of the buffer core.create makes (GB, 1e9 bytes)
    atari_transitions: int = 100_000  # images.atari's buffer (--atari-transitions)
    notes: list[str] = field(default_factory=list)
    #: The runner repeats each scenario ``repeat`` times; ``rep`` is the one running (a
    #: scenario may rotate its implementations' order by it, so none always runs first).
    rep: int = 0
    repeat: int = 1
    #: Worker (writer) process counts of the multi-process loads, rollout and contention
    #: (``--workers``); None: :data:`WORKER_COUNTS`, or :data:`QUICK_WORKER_COUNTS` quick.
    workers: tuple[int, ...] | None = None

    def worker_counts(self) -> tuple[int, ...]:
        """The worker counts a multi-process load runs, one timed pass each."""
        if self.workers:
            return self.workers
        return QUICK_WORKER_COUNTS if self.quick else WORKER_COUNTS

    def rotate(self, items: list[Any]) -> list[Any]:
        """``items`` rotated by the current repetition: A B C, then B C A, then C A B."""
        k = self.rep % len(items) if items else 0
        return items[k:] + items[:k]

    def size(self, n: int, minimum: int = 1) -> int:
        """``n`` at default size, about ``n / 20`` in ``--quick`` mode."""
        return max(minimum, n // 20) if self.quick else n

    def note(self, scenario_name: str, text: str) -> None:
        self.notes.append(f"{scenario_name}: {text}")


def make_row(
    scenario_name: str,
    impl: str,
    op: str,
    *,
    rows: int,
    nbytes: int,
    seconds: float,
    pass_: str,
    **extra: Any,
) -> Row:
    seconds = max(seconds, 1e-9)
    return {
        "scenario": scenario_name,
        "impl": impl,
        "op": op,
        "rows": int(rows),
        "bytes": int(nbytes),
        "seconds": seconds,
        "rows_per_s": rows / seconds,
        "gb_per_s": nbytes / seconds / 1e9,
        "pass": pass_,
        **extra,
    }


def timed(fn: Callable[[Any], Any], items: Iterable[Any], budget: float) -> tuple[float, int]:
    """``(seconds, calls)`` to call ``fn`` on the items (results dropped as they come),
    stopping after the call that crosses ``budget`` seconds."""
    gc.collect()
    calls = 0
    t0 = time.perf_counter()
    for item in items:
        fn(item)
        calls += 1
        if time.perf_counter() - t0 > budget:
            break
    return time.perf_counter() - t0, calls


def median_us(fn: Callable[[], Any], seconds: float, warm: int = 1) -> tuple[float, int]:
    """Median microseconds per call of ``fn`` over repetitions filling ``seconds`` (at least
    3), after ``warm`` calls that are not timed (first use: parse, allocate, fault pages)."""
    for _ in range(warm):
        fn()
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 3:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2] * 1e6, len(times)
