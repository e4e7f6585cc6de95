"""The examples run for real: their own daemon through the CLI, spawned env workers stepping
gymnasium, a learner that learns. Short bounded runs by default (each CartPole run stops early
once a modest target is reached, the Pendulum run once its 20 episodes are in; the time limits
only bound a busy machine); the full runs that must reach 195 (DQN), 475 (PPO) and -250 (SAC
on Pendulum) within 10 minutes under ``-m slow``.

Every run gets its own runtime and storage folders, and must leave nothing behind in them: its
daemon's runtime file and segment, and its weights channel, are gone when it exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("gymnasium", reason="the examples need the [examples] extra (gymnasium)")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RANDOM_RETURN = 22.0  # CartPole-v1 under random play
CLEARLY_ABOVE_RANDOM = 2 * RANDOM_RETURN
FINAL = re.compile(r"^final mean return \(last 20 episodes\): (?P<value>\S+)$")
SHUTDOWN_S = 60.0  # beyond --minutes: startup on a busy machine, stopping workers and daemon


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def final_return(self) -> float:
        last = self.stdout.rstrip("\n").splitlines()[-1]
        match = FINAL.match(last)
        assert match, f"last line is not the final return: {last!r}\n{self.describe()}"
        return float(match["value"])

    def describe(self) -> str:
        return f"exit {self.returncode} after {self.seconds:.1f}s\n{self.stdout}\n{self.stderr}"


@pytest.fixture
def folders() -> Iterator[tuple[Path, Path]]:
    """A runtime folder (short: ipc socket paths are limited) and a storage folder."""
    runtime = Path(tempfile.mkdtemp(prefix="sbex-", dir="/tmp"))
    storage = Path(f"/dev/shm/shmbuffer-ex-{uuid.uuid4().hex[:12]}")
    try:
        yield runtime, storage
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(storage, ignore_errors=True)


def environ(folders: tuple[Path, Path]) -> dict[str, str]:
    runtime, storage = folders
    return {
        **os.environ,
        "SHMBUFFER_RUNTIME_DIR": str(runtime),
        "SHMBUFFER_STORAGE_DIR": str(storage),
        "PYTHONUNBUFFERED": "1",
    }


def run_example(script: str, folders: tuple[Path, Path], *args: str, minutes: float) -> Run:
    argv = [sys.executable, str(EXAMPLES / script), "--minutes", str(minutes), *args]
    start = time.monotonic()
    # A session of its own, so that a hang can be killed with all its workers.
    proc = subprocess.Popen(
        argv,
        env=environ(folders),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=minutes * 60 + SHUTDOWN_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{script} did not finish in time:\n{out}\n{err}")
    run = Run(proc.returncode, out, err, time.monotonic() - start)
    assert run.returncode == 0, run.describe()
    assert_nothing_left(folders)
    return run


def assert_nothing_left(folders: tuple[Path, Path]) -> None:
    runtime, storage = folders
    left = sorted(p.name for p in runtime.iterdir()) if runtime.exists() else []
    assert not left, f"left in the runtime folder: {left}"
    segments = sorted(p.name for p in storage.iterdir()) if storage.exists() else []
    assert not segments, f"segments left (the daemon's or the weights channel): {segments}"


def wait_gone(probe: Callable[[], None], timeout: float = 10.0) -> bool:
    """Whether ``probe`` (a signal 0) raises ProcessLookupError within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            probe()
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def check_figures(run: Run) -> None:
    lines = run.stdout.splitlines()
    steps = next((ln for ln in lines if ln.startswith("env steps/s: ")), None)
    samples = next((ln for ln in lines if ln.startswith("samples/s: ")), None)
    assert steps and samples, run.describe()
    assert float(steps.split()[2].replace(",", "")) > 0, steps
    assert float(samples.split()[1].replace(",", "")) > 0, samples


# -- short runs (default) -------------------------------------------------------------------


# Each stops once its last-20 mean reaches SHORT_TARGET (tens of seconds on a quiet machine);
# the time limit only bounds a machine so busy that the workers start late.
SHORT_TARGET = "60"
SHORT_MINUTES = 2.0


def env_workers(pid: int) -> list[int]:
    """The spawned multiprocessing children of ``pid`` (its env workers; not its daemon or
    multiprocessing's resource tracker)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    found = []
    for child in map(int, children):
        with contextlib.suppress(OSError):
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
    return found


@pytest.mark.timeout(SHORT_MINUTES * 60 + SHUTDOWN_S + 30)
def test_dqn_learns_above_random_play_through_a_worker_killed(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    """Three workers, one SIGKILLed once the learner trains: the run goes on with the other
    two, says so, and still learns."""
    curve = tmp_path / "dqn.csv"
    argv = [
        sys.executable, str(EXAMPLES / "dqn_cartpole.py"), "--minutes", str(SHORT_MINUTES),
        "--workers", "3", "--target", SHORT_TARGET, "--curve", str(curve),
    ]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.Popen(
        argv, env=environ(folders), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:  # the first progress line: workers act, the learner trains
            lines.append(line)
            if line.startswith("["):
                break
        workers = env_workers(proc.pid)
        assert len(workers) == 3, (workers, "".join(lines))
        os.kill(workers[0], signal.SIGKILL)
        out, err = proc.communicate(timeout=SHORT_MINUTES * 60 + SHUTDOWN_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    run = Run(proc.returncode, "".join(lines) + out, err, time.monotonic() - start)
    assert run.returncode == 0, run.describe()
    assert "exit code -9); going on with 2" in run.stdout, run.describe()
    assert_nothing_left(folders)
    check_figures(run)
    assert run.final_return > CLEARLY_ABOVE_RANDOM, run.describe()
    check_curve_plot(curve, tmp_path / "curves.png")


@pytest.mark.timeout(SHORT_MINUTES * 60 + SHUTDOWN_S + 30)
def test_dqn_with_3_step_returns_learns_above_random_play(folders: tuple[Path, Path]) -> None:
    """``--n-step 3``: the learner's Reader computes each sample's 3-step return, discount and
    next observation from the rows in shared memory, and the target built from them learns."""
    run = run_example(
        "dqn_cartpole.py", folders, "--workers", "2", "--n-step", "3", "--target", SHORT_TARGET,
        minutes=SHORT_MINUTES,
    )  # fmt: skip
    assert "3-step returns" in run.stdout.splitlines()[0], run.describe()
    check_figures(run)
    assert run.final_return > CLEARLY_ABOVE_RANDOM, run.describe()


@pytest.mark.slow  # the DQN short run keeps the examples path in the default run
@pytest.mark.timeout(SHORT_MINUTES * 60 + SHUTDOWN_S + 30)
def test_ppo_learns_above_random_play(folders: tuple[Path, Path]) -> None:
    run = run_example(
        "ppo_cartpole.py", folders, "--workers", "2", "--target", SHORT_TARGET,
        minutes=SHORT_MINUTES,
    )  # fmt: skip
    check_figures(run)
    assert run.final_return > CLEARLY_ABOVE_RANDOM, run.describe()


def check_curve_plot(curve: Path, png: Path, *args: str) -> None:
    """The --curve CSV holds every episode, and plot_curves.py (given ``args``) draws it."""
    lines = curve.read_text().splitlines()
    assert lines[0] == "env_steps,seconds,return" and len(lines) > 20, lines[:3]
    steps = [int(line.split(",")[0]) for line in lines[1:]]
    assert steps == sorted(steps) and steps[-1] > 0
    pytest.importorskip("matplotlib")
    argv = [sys.executable, str(EXAMPLES / "plot_curves.py"), str(curve), "-o", str(png), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# Pendulum learns too slowly for a short run to show it (its target needs about a minute of
# acting): the short run stops at its 20th episode (a target of -inf, reached as soon as the
# figure has its 20 episodes; about 4,000 env steps and 750 updates) and checks the whole path:
# workers acting with float32 torques, the learner sampling and updating, figures, curve and
# cleanup. The time limit only bounds a machine so busy that the workers start late.
PENDULUM_SHORT_MINUTES = 2.0


@pytest.mark.slow  # the DQN short run keeps the examples path in the default run
@pytest.mark.timeout(PENDULUM_SHORT_MINUTES * 60 + SHUTDOWN_S + 30)
def test_sac_pendulum_runs_end_to_end(folders: tuple[Path, Path], tmp_path: Path) -> None:
    curve = tmp_path / "sac.csv"
    run = run_example(
        "sac_pendulum.py", folders, "--workers", "2", "--target=-inf", "--curve", str(curve),
        minutes=PENDULUM_SHORT_MINUTES,
    )  # fmt: skip
    check_figures(run)
    assert -16.3 * 200 <= run.final_return <= 0, run.describe()  # rewards are in [-16.3, 0]
    lines = curve.read_text().splitlines()
    assert lines[0] == "env_steps,seconds,return" and len(lines) > 20, lines[:3]
    rows = [line.split(",") for line in lines[1:]]
    steps = [int(row[0]) for row in rows]
    assert steps == sorted(steps) and steps[-1] > 0, steps
    assert all(-16.3 * 200 <= float(row[2]) <= 0 for row in rows), rows


@pytest.mark.timeout(SHORT_MINUTES * 60 + SHUTDOWN_S + 30)
def test_her_bitflip_learns_what_random_play_never_reaches(folders: tuple[Path, Path]) -> None:
    """``her_bitflip.py``: DQN sampling with ``her=`` through the daemon; random play reaches
    a random 8-bit goal within 8 flips a few percent of the time, the learner stops at 0.8."""
    run = run_example(
        "her_bitflip.py", folders, "--bits", "8", "--target", "0.8", minutes=SHORT_MINUTES
    )
    last = run.stdout.rstrip("\n").splitlines()[-1]
    match = re.match(r"^final success rate \(last 100 greedy episodes\): (\S+)$", last)
    assert match, run.describe()
    assert float(match[1]) >= 0.5, run.describe()


def test_ctrl_c_stops_workers_and_daemon(folders: tuple[Path, Path]) -> None:
    """SIGINT to the example's process group (what Ctrl-C in a terminal sends): it still prints
    its figures, its workers and its daemon are gone, and nothing is left on disk."""
    runtime, _ = folders
    argv = [sys.executable, str(EXAMPLES / "ppo_cartpole.py"), "--workers", "1", "--minutes", "2"]
    proc = subprocess.Popen(
        argv,
        env=environ(folders),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        lines = []
        deadline = time.monotonic() + 90.0
        for line in proc.stdout:  # the first progress line: workers act, the learner trains
            lines.append(line)
            if line.startswith("[") or time.monotonic() > deadline:
                break
        assert lines and lines[-1].startswith("["), "".join(lines)
        (runtime_file,) = runtime.glob("*.json")
        daemon_pid = int(json.loads(runtime_file.read_text())["pid"])
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=SHUTDOWN_S)
        text = "".join(lines) + out
        assert proc.returncode == 0, text
        assert FINAL.match(text.rstrip("\n").splitlines()[-1]), text
        # Workers (and multiprocessing's resource tracker) leave the process group; the
        # daemon, in a session of its own, was stopped by the example.
        assert wait_gone(lambda: os.killpg(proc.pid, 0)), "processes left in the group"
        assert wait_gone(lambda: os.kill(daemon_pid, 0)), f"daemon pid {daemon_pid} still runs"
        assert_nothing_left(folders)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


# -- full runs (slow) -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(10 * 60 + SHUTDOWN_S + 30)
@pytest.mark.parametrize(
    "extra",
    [[], ["--uniform"], ["--n-step", "3"]],
    ids=["default-sampler", "uniform", "3-step"],
)
def test_dqn_reaches_195_within_10_minutes(folders: tuple[Path, Path], extra: list[str]) -> None:
    run = run_example("dqn_cartpole.py", folders, "--workers", "2", *extra, minutes=10)
    check_figures(run)
    assert run.final_return >= 195, run.describe()


@pytest.mark.slow
@pytest.mark.timeout(10 * 60 + SHUTDOWN_S + 30)
def test_ppo_reaches_475_within_10_minutes(folders: tuple[Path, Path]) -> None:
    run = run_example("ppo_cartpole.py", folders, "--workers", "2", minutes=10)
    check_figures(run)
    assert run.final_return >= 475, run.describe()


@pytest.mark.slow
@pytest.mark.timeout(10 * 60 + SHUTDOWN_S + 30)
def test_sac_pendulum_reaches_minus_250_within_10_minutes(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    curve = tmp_path / "sac.csv"
    run = run_example(
        "sac_pendulum.py", folders, "--workers", "2", "--curve", str(curve), minutes=10
    )
    check_figures(run)
    assert run.final_return >= -250, run.describe()
    check_curve_plot(curve, tmp_path / "curves.png", "--title", "Pendulum-v1 through shmbuffer")


@pytest.mark.timeout(SHORT_MINUTES * 60 + SHUTDOWN_S + 30)
def test_two_tables_a_learner_and_an_evaluator_over_one_daemon(folders: tuple[Path, Path]) -> None:
    """``dqn_eval_tables.py``: the learner on a prioritized table, an evaluator consuming a
    FIFO table of the same rows, each episode once (it raises on one handed out twice), the
    return each worker attached equal to its stored rewards (it raises otherwise)."""
    run = run_example(
        "dqn_eval_tables.py", folders, "--workers", "2", "--target", SHORT_TARGET,
        minutes=SHORT_MINUTES,
    )  # fmt: skip
    assert run.returncode == 0, run.describe()
    consumed = re.search(r"^eval: (\d+) episodes consumed, each once$", run.stdout, re.M)
    assert consumed and int(consumed[1]) > 0, run.describe()
    assert re.search(r"^eval: best live episodes of policy v\d+ on: #\d+ ", run.stdout, re.M)
    assert_nothing_left(folders)
    check_figures(run)
    assert run.final_return > CLEARLY_ABOVE_RANDOM, run.describe()
