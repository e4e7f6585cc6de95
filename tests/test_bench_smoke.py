"""Smoke test of the benchmark runner: ``python -m bench core --quick`` in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_core_scenarios(tmp_path: Path) -> None:
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "bench", "core", "--quick", "--plot", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    doc = json.loads((out / "results.json").read_text())
    rows = doc["rows"]
    assert (out / "results.md").read_text().startswith("# shmbuffer benchmark results")
    for scenario in ("core.transitions", "core.episodes"):
        impls = {r["impl"] for r in rows if r["scenario"] == scenario}
        assert "copy-limit" in impls, (scenario, impls, doc["notes"])
        assert "shmbuffer" in impls, (scenario, impls, doc["notes"])
        assert (out / f"{scenario}.png").stat().st_size > 0
    for r in rows:
        assert r["seconds"] > 0 and r["rows"] > 0, r
        assert r["rows_per_s"] > 0 and r["gb_per_s"] > 0, r
        assert r["pass"] in ("first", "steady"), r
