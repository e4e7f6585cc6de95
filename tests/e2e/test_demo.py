"""The README's first command, ``shmbuffer-daemon demo``, run as a newcomer runs it (small): a
daemon, spawned writer and learner processes, and a verdict on what the learners checked.
Regression: on a slow machine the children took longer to import torch than the demo waited
for them, and it ended in a bare ``queue.Empty`` traceback. Its rows are 4 KiB and its episodes
64 of them, so the writers copy with streaming stores (``shmbuffer/storage/streamcopy.py``)
while the learners check every sampled row's first and last byte."""

from __future__ import annotations

import re
import sys
import time

from shmbuffer.cli.demo import episode_spec
from shmbuffer.cli.demo_loops import make_episode
from shmbuffer.storage.schema import Schema
from tests.e2e.conftest import run_in_session

SECONDS = 2


def test_demo_runs_and_its_learner_finds_nothing_torn(e2e_env):
    argv = [sys.executable, "-m", "shmbuffer.cli", "demo", "--writers", "1"]
    argv += ["--seconds", str(SECONDS)]
    # a 20,000-row (80 MB) ring, which a streaming writer laps every few milliseconds: rows a
    # sample names are overwritten under its copy and redrawn, leased (regression: the learner
    # gave up with TornReadError after 8 unleased redraws on a faster machine)
    argv += ["--capacity", "20000", "--episode-len", "64", "--obs-shape", "4,32,32"]
    # in a session of its own: a demo that hangs is killed with its daemon and children
    began = time.monotonic()
    returncode, out, err = run_in_session(argv, e2e_env.environ, timeout=100)
    wall = time.monotonic() - began
    assert returncode == 0, err[-2000:]
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith("1 learner verified") and verdict.endswith("none torn"), verdict
    # something was stored and sampled, not a run where nothing happened
    assert "0 sampled episodes and 0 rows" not in verdict, verdict

    # into a pipe: plain lines, no screen-clearing codes; counts said as a person says them
    assert "\x1b" not in out
    assert "1 writer, 1 learner, 2s" in out.splitlines()[0], out.splitlines()[0]
    assert "1 writers" not in out and "1 learners" not in out and "1 readers" not in out
    # every process runs the same --seconds from one start line, and once the last has
    # reported the demo ends: it takes its start-up (bounded, reported) and about --seconds,
    # not the children's staggered starts and their interpreters' teardown on top
    found = re.search(r"start-up ([\d.]+)s, run ([\d.]+)s", out)
    assert found, out
    startup, ran = float(found[1]), float(found[2])
    assert SECONDS <= ran < SECONDS + 5, out
    assert wall - startup < SECONDS + 10, (wall, out)


def test_the_demo_declares_the_schema_its_writers_write():
    """The command declares the schema without importing torch; it is make_episode's."""
    shape = (4, 32, 32)
    assert episode_spec(shape) == Schema.from_batch(make_episode(0, 0, 3, shape)).to_spec()
