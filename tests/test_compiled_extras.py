"""The compiled parts of the installed extras load with the torch installed beside them.

A wheel's C++ or LLVM part can be present and fail to load (a symbol its build saw and the
installed torch lacks): the package still imports, and only its fast or prioritized paths
break, silently or at first use, in the users' code as in ours. Each check runs in a fresh
interpreter, as a user's process loads it, and is skipped where its extra is not installed.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]  # the child imports this checkout's shmbuffer

CHECKS = {
    # TorchRL's segment trees: its PrioritizedSampler and PrioritizedReplayBuffer need them
    # (the torchrl extra; scripts/torchrl_ext.py builds them against the installed torch).
    "torchrl": "from torchrl._torchrl import SumSegmentTreeFp32\ntree = SumSegmentTreeFp32(4)",
    # numba compiles through llvmlite's shared library; shmbuffer.jit falls back to numpy
    # loops when that import fails, so the fast extra would be slow without a word.
    "numba": (
        "import numba\n"
        "assert numba.njit(lambda x: x + 1)(1) == 2\n"
        "from shmbuffer import jit\n"
        "assert jit.load('shmbuffer.samplers._jit') is not None"
    ),
    # tensordict's C++ helpers (a core dependency).
    "tensordict": "import tensordict._C",
}


@pytest.mark.parametrize("package", sorted(CHECKS))
def test_compiled_part_loads(package: str) -> None:
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (its extra is optional)")
    done = subprocess.run(
        [sys.executable, "-c", CHECKS[package]],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    error = done.stderr.strip().splitlines()[-1:] if done.returncode else []
    hint = " (run scripts/torchrl_ext.py)" if package == "torchrl" else ""
    assert done.returncode == 0, f"{package}'s compiled part does not load{hint}: {error}"
