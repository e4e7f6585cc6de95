"""The README's first command, ``shmbuffer-daemon demo``, run as a newcomer runs it (small): a
daemon, spawned writer and learner processes, and a verdict on what the learners checked.
Regression: on a slow machine the children took longer to import torch than the demo waited
for them, and it ended in a bare ``queue.Empty`` traceback. Its rows are 4 KiB and its episodes
64 of them, so the writers copy with streaming stores (``shmbuffer/streamcopy.py``) while the
learners check every sampled row's first and last byte."""

from __future__ import annotations

import sys

from tests.e2e.conftest import run_in_session


def test_demo_runs_and_its_learner_finds_nothing_torn(e2e_env):
    argv = [sys.executable, "-m", "shmbuffer.cli", "demo", "--writers", "1", "--seconds", "2"]
    # a 20,000-row (80 MB) ring, which a streaming writer laps every few milliseconds: rows a
    # sample names are overwritten under its copy and redrawn, leased (regression: the learner
    # gave up with TornReadError after 8 unleased redraws on a faster machine)
    argv += ["--capacity", "20000", "--episode-len", "64", "--obs-shape", "4,32,32"]
    # in a session of its own: a demo that hangs is killed with its daemon and children
    returncode, out, err = run_in_session(argv, e2e_env.environ, timeout=100)
    assert returncode == 0, err[-2000:]
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith("learners verified") and verdict.endswith("none torn"), verdict
    # something was stored and sampled, not a run where nothing happened
    assert "0 sampled episodes and 0 rows" not in verdict, verdict
