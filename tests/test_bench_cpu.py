"""The CPU accounting of the bench's multi-process loads, with real spawned children burning a
known amount of CPU: a pass counts what every process spent in it, and a server's part apart.
CPU time, not wall time, is asserted (a busy machine stretches the pass, not the CPU burned);
the bounds leave room for the kernel's 10 ms ticks and the children's own bookkeeping."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from bench import cpu, loads
from bench.harness import Body, Children
from bench.registry import Context

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")

BURN = 0.3  # CPU seconds each busy child spends in the pass


@contextmanager
def _burn_role(seconds: float) -> Iterator[Body]:
    def body(_: int) -> tuple[int, bool]:
        t0 = time.process_time()
        while time.process_time() - t0 < seconds:
            pass
        return 1000, True

    yield body


@pytest.mark.timeout(120)
def test_a_pass_counts_every_process_and_the_server_apart() -> None:
    with Children(passes=1) as kids:
        kids.start(_burn_role, seconds=BURN)  # a writer
        kids.start(_burn_role, seconds=BURN)  # stands for the daemon
        kids.start(_burn_role, seconds=0.0)  # a learner with nothing to do
        writer, server, idle = (p.pid for p in kids.procs)
        [pass_] = loads.run_plan(kids, {0: "writers", 1: "server", 2: "learners"}, 1, server)
    spent = kids.cpu[0]
    assert BURN - 0.05 <= spent[writer] <= BURN + 0.15, spent
    assert spent[idle] < 0.1, spent
    assert pass_.cpu_s is not None and pass_.server_cpu_s is not None
    assert 2 * BURN - 0.1 <= pass_.cpu_s <= 2 * BURN + 0.6, spent
    assert pass_.server_cpu_s == spent[server]
    assert 0.25 <= pass_.server_cpu_s / pass_.cpu_s <= 0.6, spent
    # the pass's processes spawned before the window: their start-up is not in it
    assert pass_.rates["writers"][0] == 1000


def test_rows_get_cpu_per_million_rows_of_their_own_side() -> None:
    ctx = Context()
    fill = loads.Pass({"writers": (1, 1.0), "learners": (1, 1.0)}, 9.0, 1.0)
    timed = loads.Pass({"writers": (2_000_000, 2.0), "learners": (500_000, 2.0)}, 6.0, 1.5)
    sides = (("writers", "insert", 200), ("learners", "sample", 256))
    shm = loads.rate_rows(ctx, "s", loads.SHM, (2,), [fill, timed], sides, 10, 2)
    assert [r["op"] for r in shm] == ["insert-2w", "sample-2w"]
    assert [r["cpu_s_per_m_rows"] for r in shm] == pytest.approx([3.0, 12.0])
    assert {r["daemon_cpu_share"] for r in shm} == {0.25} and shm[0]["cpu_s"] == 6.0
    peer = loads.rate_rows(
        ctx, "s", loads.CPPRB, (2,), [fill, timed._replace(server_cpu_s=None)], sides, 10, 2
    )
    assert peer[0]["daemon_cpu_share"] is None
    assert peer[0]["cpu_s_per_m_rows"] == pytest.approx(3.0)
    # nothing read (no /proc) or nothing moved: no figure, not a division by zero
    blind = loads.Pass({"writers": (0, 2.0), "learners": (5, 2.0)}, None, None)
    rows = loads.rate_rows(ctx, "s", loads.SHM, (2,), [fill, blind], sides, 10, 2)
    assert [r["cpu_s_per_m_rows"] for r in rows] == [None, None]


def test_a_process_started_in_the_window_counts_whole_and_a_reused_pid_restarts() -> None:
    before = {1: cpu.Proc(0, 5.0, 0.0), 2: cpu.Proc(0, 7.0, 0.0)}
    after = {1: cpu.Proc(0, 5.5, 0.0), 2: cpu.Proc(0, 0.2, 0.0), 3: cpu.Proc(0, 0.3, 0.0)}
    assert cpu.used(before, after) == pytest.approx({1: 0.5, 2: 0.2, 3: 0.3})
    assert cpu.share({1: 0.5, 3: 0.3}, 3) == pytest.approx((0.8, 0.3))
    assert cpu.share({1: 0.5}, None) == (0.5, None) and cpu.share({}, 3) == (None, None)
