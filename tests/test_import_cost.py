"""What the daemon, the command line, a writer and a reader import: not tensordict, whose import
costs a process about 3 s of CPU here (it loads torch._dynamo). Every ``shmbuffer-daemon`` command,
every daemon start and every env-worker process paid it before; only TensorDict-returning calls
need it. A reader imports not even torch until it first touches rows
(``tests/e2e/test_reader_imports.py`` holds that against a daemon): a tool that attaches to read
``stats()`` or ``len()`` starts in a fraction of the time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

LIGHT = ["shmbuffer.cli", "shmbuffer.daemon.server", "shmbuffer.clients.writer"]
#: What ``from shmbuffer import Reader`` loads: none of these may import torch, tensordict or
#: numba at module level (each is imported by the first call that needs it).
READER = ["shmbuffer.clients.reader", "shmbuffer.api.reads", "shmbuffer.clients.episode_reads"]


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


@pytest.mark.parametrize("module", READER)
def test_reader_modules_import_neither_torch_nor_tensordict(module: str) -> None:
    probe = (
        f"import sys, {module}; "
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'tensordict', 'numba')); "
        "print(heavy[:5])"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]", f"{module} imports {out.stdout.strip()}"


def test_the_public_reader_name_imports_no_torch() -> None:
    probe = (
        "import sys\n"
        "from shmbuffer import Reader\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'tensordict'))[:5])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_segment_builds_its_tensordict_on_first_use() -> None:
    probe = (
        "import sys\n"
        "from shmbuffer.storage.schema import Schema\n"
        "from shmbuffer.storage.segment import LocalSegment\n"
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


def test_commands_other_than_start_do_not_import_torch(tmp_path: Path) -> None:
    """``shmbuffer-daemon status/stop/configure/keygen`` answer in a fraction of a second: torch
    (~3 s of CPU) is for ``start``, which imports it when it runs. Each command here runs to
    its answer: no daemon by that name, a silent endpoint, keys written."""
    silent = f"ipc://{tmp_path / 'nobody.sock'}"
    commands = [
        ["status", "--name", "nobody", "--timeout", "0.5"],
        ["status", "--name", silent, "--json", "--timeout", "0.5"],
        ["stop", "--name", "nobody", "--timeout", "0.5"],
        ["configure", "--name", "nobody", "--min-size", "3", "--timeout", "0.5"],
        ["keygen", "--out", str(tmp_path / "keys"), "--name", "client"],
    ]
    probe = (
        "import sys\n"
        "from shmbuffer.cli import main\n"
        f"codes = [main(argv) for argv in {commands!r}]\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'tensordict'))\n"
        "print(codes, heavy[:5])\n"
    )
    env = {**os.environ, "SHMBUFFER_RUNTIME_DIR": str(tmp_path / "run")}
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,  # the assertion shows what it printed
    )
    assert out.stdout.splitlines()[-1:] == ["[1, 1, 1, 1, 0] []"], out.stdout + out.stderr
    assert (tmp_path / "keys" / "client.key").is_file()
