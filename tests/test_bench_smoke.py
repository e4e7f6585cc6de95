"""Smoke test of the benchmark runner (``python -m bench --quick --plot``: every scenario, in a
subprocess; slow), and the teardown of the bench's process harness with real spawned children.

The quick run checks that every scenario runs and that its results are sane, not that anything
is fast: timings are the benchmark's output, never asserted."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench.harness import Body, Children
from bench.registry import SCENARIOS
from bench.runner import main as _register  # noqa: F401  (imports every scenario module)

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def _sleeper_role(seconds: float) -> Iterator[Body]:
    def body(_: int) -> tuple[int, bool]:
        time.sleep(seconds)
        return 1, True

    yield body


@contextmanager
def _broken_role() -> Iterator[Body]:
    raise ValueError("no such field 'obs'")
    yield  # unreachable: makes this a generator


@pytest.mark.timeout(60)
def test_children_failed_block_kills_running_children() -> None:
    with pytest.raises(KeyError), Children(passes=1) as kids:
        kids.start(_sleeper_role, seconds=600.0)
        kids.wait_ready()
        kids.go[0].set()  # the child is now in a pass it will not finish for 10 minutes
        procs = list(kids.procs)
        t0 = time.monotonic()
        raise KeyError("the scenario failed")
    assert time.monotonic() - t0 < 10  # killed, not joined for JOIN_TIMEOUT
    assert [p.exitcode for p in procs] == [-9]


@pytest.mark.timeout(60)
def test_children_report_a_failing_role_by_name() -> None:
    with pytest.raises(RuntimeError) as info, Children(passes=1) as kids:
        kids.start(_broken_role)
        kids.run_passes()
    assert "bench-_broken-0 failed" in str(info.value)
    assert "ValueError: no such field 'obs'" in str(info.value)
    assert all(not p.is_alive() for p in kids.procs)


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except Exception:
        return False
    return True


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_all_scenarios(tmp_path: Path) -> None:
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "bench", "--quick", "--plot", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=540, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    doc = json.loads((out / "results.json").read_text())
    rows = doc["rows"]
    md = (out / "results.md").read_text()
    assert md.startswith("# shmbuffer benchmark results") and "| winner |" in md
    # every scenario ran (or said why it could not) and has its figure and its load record
    for name in SCENARIOS:
        got = [r for r in rows if r["scenario"] == name]
        skipped = [n for n in doc["notes"] if n.startswith(name) and "skipped" in n]
        assert got or skipped, (name, doc["notes"])
        if got:
            assert (out / f"{name}.png").stat().st_size > 0, name
        load = doc["meta"]["scenarios"][name]
        assert len(load["load_before"]) == 3 and len(load["load_after"]) == 3, load
        assert load["seconds"] > 0 and load["repeats"] == 1, load
    # contention and rollout: every available implementation, both sides, every count
    loads = {
        "contention": ("insert", "sample"),
        "rollout": ("env-steps", "learner-samples"),
    }
    peers = {"cpprb-MPReplayBuffer": "cpprb", "torchrl-shared-LazyMemmapStorage": "torchrl"}
    for scenario, sides in loads.items():
        impls = ["shmbuffer-daemon"] + [i for i, m in peers.items() if _importable(m)]
        if scenario == "rollout":
            impls.append("mp.Queue")
        for impl in impls:
            ops = {r["op"] for r in rows if r["scenario"] == scenario and r["impl"] == impl}
            assert ops == {f"{s}-2w" for s in sides}, (impl, ops, doc["notes"])  # --quick: 2
        for r in (r for r in rows if r["scenario"] == scenario):
            # every process's CPU, and the daemon's part of it where there is one
            assert r["cpu_s"] > 0 and r["cpu_s_per_m_rows"] > 0, r
            share = r["daemon_cpu_share"]
            assert (0 <= share <= 1) if r["impl"] == "shmbuffer-daemon" else share is None, r
        assert not [n for n in doc["notes"] if n.startswith(scenario) and "failed" in n]
    for scenario in ("core.transitions", "core.episodes"):
        impls = {r["impl"] for r in rows if r["scenario"] == scenario}
        assert "copy-limit" in impls, (scenario, impls, doc["notes"])
        assert "shmbuffer" in impls, (scenario, impls, doc["notes"])
        assert (out / f"{scenario}.png").stat().st_size > 0
    # the daemon scenarios: every op of the daemon and of the copy limit ran (--quick: one
    # writer / client count, one daemon each)
    expected = {
        "daemon.insert_images": {"insert-2w"},
        "daemon.insert_small": {"insert-2w"},
        "daemon.sample": {"sample", "sample-episodes", "sample-slices"},
        "daemon.messages": {"ping-2c"},
    }
    for scenario, ops in expected.items():
        got = {
            r["op"] for r in rows if r["scenario"] == scenario and r["impl"] == "shmbuffer-daemon"
        }
        assert ops <= got, (scenario, got, doc["notes"])
        if scenario != "daemon.messages":
            limit = {
                r["op"] for r in rows if r["scenario"] == scenario and r["impl"] == "copy-limit"
            }
            assert ops <= limit, (scenario, limit, doc["notes"])
        assert (out / f"{scenario}.png").stat().st_size > 0
    # No daemon op may fail (the full run's sample_episodes(32) of 400-step episodes, which
    # --quick skips, is tested through a daemon in tests/e2e/test_sample_out.py).
    failed = [n for n in doc["notes"] if n.startswith("daemon.") and "failed" in n]
    assert not failed, failed
    # the sampling scenario: every op at both quick sizes, shmbuffer and a peer beside it
    sampling = [r for r in rows if r["scenario"] == "sampling.scaling"]
    for op in ("sample", "sample+update", "slices"):
        for size in (10_000, 100_000):
            impls = {
                r["impl"] for r in sampling if (r["sampler_op"], r["stored_rows"]) == (op, size)
            }
            assert "shmbuffer" in impls and len(impls) > 1, (op, size, impls, doc["notes"])
    assert not [n for n in doc["notes"] if n.startswith("sampling.") and "failed" in n]
    assert (out / "sampling.scaling.png").stat().st_size > 0
    for r in rows:
        assert r["seconds"] > 0 and r["rows"] > 0, r
        assert r["rows_per_s"] > 0, r
        # rows of metadata or of the control plane move no bytes (meta.queries, daemon.service)
        assert r["gb_per_s"] > 0 if r["bytes"] > 0 else r["gb_per_s"] == 0, r
        assert r["pass"] in ("first", "steady"), r
        assert r["repeats"] == 1 and r["rows_per_s_min"] == r["rows_per_s_max"], r
