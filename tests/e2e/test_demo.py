"""The README's first command, ``shmbuffer-daemon demo``, run as a newcomer runs it (small): a
daemon, spawned writer and learner processes, and a verdict on what the learners checked.
Regression: on a slow machine the children took longer to import torch than the demo waited
for them, and it ended in a bare ``queue.Empty`` traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def test_demo_runs_and_its_learner_finds_nothing_torn(e2e_env):
    argv = [sys.executable, "-m", "shmbuffer.cli", "demo", "--writers", "1", "--seconds", "2"]
    argv += ["--capacity", "2000", "--episode-len", "20", "--obs-shape", "4,8,8"]
    # its own session: a demo that hangs is killed with its daemon and children
    proc = subprocess.Popen(
        argv,
        env=e2e_env.environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 0, err[-2000:]
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith("learners verified") and verdict.endswith("none torn"), verdict
    # something was stored and sampled, not a run where nothing happened
    assert "0 sampled episodes and 0 rows" not in verdict, verdict
