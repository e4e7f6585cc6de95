"""Smoke test of the benchmark runner: ``python -m bench core daemon --quick`` in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_core_scenarios(tmp_path: Path) -> None:
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "bench", "core", "daemon", "--quick", "--plot", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=540, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    doc = json.loads((out / "results.json").read_text())
    rows = doc["rows"]
    assert (out / "results.md").read_text().startswith("# shmbuffer benchmark results")
    for scenario in ("core.transitions", "core.episodes"):
        impls = {r["impl"] for r in rows if r["scenario"] == scenario}
        assert "copy-limit" in impls, (scenario, impls, doc["notes"])
        assert "shmbuffer" in impls, (scenario, impls, doc["notes"])
        assert (out / f"{scenario}.png").stat().st_size > 0
    # the daemon scenarios: every op of the daemon and of the copy limit ran
    expected = {
        "daemon.insert_images": {"insert-1w", "insert-2w"},
        "daemon.insert_small": {"insert-1w", "insert-2w"},
        "daemon.sample": {"sample", "sample-episodes", "sample-slices"},
        "daemon.messages": {"ping-1c", "ping-2c"},
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
    # Known library limit, not a bench failure: sample_episodes(32) of 400-step episodes sends
    # 12,800 per-row stamps in its reply header, over protocol.MAX_HEADER_BYTES (64 KiB).
    failed = [n for n in doc["notes"] if n.startswith("daemon.") and "failed" in n]
    assert not [n for n in failed if "sample-episodes-L400" not in n], failed
    for r in rows:
        assert r["seconds"] > 0 and r["rows"] > 0, r
        assert r["rows_per_s"] > 0 and r["gb_per_s"] > 0, r
        assert r["pass"] in ("first", "steady"), r
