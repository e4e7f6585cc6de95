"""What the daemon, the command line and a writer import: not tensordict, whose import costs a
process about 3 s of CPU here (it loads torch._dynamo). Every ``shmbuffer-daemon`` command, every
daemon start and every env-worker process paid it before; only TensorDict-returning calls need it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

LIGHT = ["shmbuffer.cli", "shmbuffer.daemon.server", "shmbuffer.clients.writer"]


@pytest.mark.parametrize("module", LIGHT)
def test_module_does_not_import_tensordict(module: str) -> None:
    probe = (
        f"import sys, {module}; "
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] == 'tensordict'); "
        "print(heavy[:5])"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]", f"{module} imports {out.stdout.strip()}"


def test_segment_builds_its_tensordict_on_first_use() -> None:
    probe = (
        "import sys\n"
        "from shmbuffer.schema import Schema\n"
        "from shmbuffer.segment import LocalSegment\n"
        "seg = LocalSegment(Schema.from_spec({'obs': {'dtype': 'float32', 'shape': [3]}}), 8)\n"
        "assert 'tensordict' not in sys.modules\n"
        "seg.columns[('obs',)][2] = 1.5\n"
        "assert seg.data['obs'][2].tolist() == [1.5] * 3 and seg.data.batch_size == (8,)\n"
        "seg.close()\n"
        "assert seg.data.batch_size == (8,) and not list(seg.data.keys())\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.stdout.strip() == "ok", out.stderr
