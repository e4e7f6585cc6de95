"""Fixtures for the end-to-end tests: a real daemon process running the CLI, and writer/reader
processes that are always joined or killed.

Both kinds of process fork from one multiprocessing fork server that has imported torch and
shmbuffer already (:func:`tests.e2e._workers.context`): a fresh interpreter pays ~3 s of CPU
for ``import torch``, and every test starts at least one daemon. The daemon is still its own
process (pid, signals, log, exit code) running ``shmbuffer.cli.main``; ``daemon(via_cli=True)``
starts it as ``python -m shmbuffer.cli start`` instead (tests/e2e/test_cli.py keeps the console
entry under test that way), and ``SHMBUFFER_E2E_DAEMON=subprocess`` does so for every test.

Every test gets its own runtime dir (a short path in /tmp, since ipc socket paths are limited
to ~107 bytes) exported as ``SHMBUFFER_RUNTIME_DIR`` in this process and passed to every child,
and its own storage folder under /dev/shm; both are removed in teardown, whatever happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.e2e import _workers

START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0
CLI = [sys.executable, "-m", "shmbuffer.cli"]
#: How the daemon fixture starts daemons: "forkserver" (fast) or "subprocess" (the console
#: entry, as a user runs it), to check that the fast path hides nothing.
DAEMON_VIA = os.environ.get("SHMBUFFER_E2E_DAEMON", "forkserver")
if DAEMON_VIA not in ("forkserver", "subprocess"):
    raise ValueError(
        f"SHMBUFFER_E2E_DAEMON must be 'forkserver' or 'subprocess', got {DAEMON_VIA!r}"
    )


def run_in_session(argv: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    """Run ``argv`` in a session of its own; ``(returncode, stdout, stderr)``. One still
    running after ``timeout`` (a hang) is killed with everything it started and fails the
    test; nothing it started outlives the call either way."""
    proc = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{argv[:4]} hung for {timeout}s:\n{out}\n{err}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out, err


def wait_for(predicate: Any, timeout: float, interval: float = 0.02, what: str = "") -> Any:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


def kill_pid(pid: int) -> None:
    """SIGTERM, wait, SIGKILL a process that is not our child (a detached daemon)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@dataclass
class Env:
    """The per-test folders and the environment every subprocess gets."""

    runtime_dir: Path
    storage_dir: Path
    extra_pids: list[int] = field(default_factory=list)  # detached daemons to reap

    @property
    def environ(self) -> dict[str, str]:
        return {**os.environ, "SHMBUFFER_RUNTIME_DIR": str(self.runtime_dir)}

    def runtime_file(self, name: str) -> Path:
        return self.runtime_dir / f"{name}.json"

    def read_runtime(self, name: str) -> dict[str, Any] | None:
        try:
            return dict(json.loads(self.runtime_file(name).read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def cli(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """Run ``shmbuffer-daemon ARGS`` to completion (a hang is a test failure)."""
        try:
            return subprocess.run(
                [*CLI, *args],
                check=False,
                env=self.environ,
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"`shmbuffer-daemon {' '.join(args)}` did not finish in {timeout}s: {exc}")


class ForkedProcess:
    """The part of :class:`subprocess.Popen` the tests use (``pid``, ``poll``, ``wait``,
    ``send_signal``, ``kill``, ``returncode``) over a forkserver child. Exit codes read as
    Popen's do: the code the process exited with, ``-N`` for death by signal N."""

    def __init__(self, process: Any, args: list[str]) -> None:
        self._process = process
        self.args = args

    @property
    def pid(self) -> int:
        return int(self._process.pid)

    @property
    def returncode(self) -> int | None:
        code: int | None = self._process.exitcode  # reaps without blocking
        return code

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self.returncode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never signal a reaped pid (it may be reused)
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@dataclass
class DaemonHandle:
    name: str
    process: subprocess.Popen[bytes] | ForkedProcess
    endpoint: str
    storage_dir: Path
    env: Env
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def segment_path(self) -> Path:
        return self.storage_dir / self.name

    def admin(self, timeout: float = 5.0) -> Any:
        from shmbuffer.clients.connection import Connection

        return Connection(self.name, "admin", timeout=timeout)

    def stats(self) -> dict[str, Any]:
        conn = self.admin()
        try:
            return dict(conn.call("stats")["stats"])
        finally:
            conn.close()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self) -> int | None:
        """SIGTERM, wait, SIGKILL; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(STOP_TIMEOUT_S)
        return self.process.returncode


@pytest.fixture
def e2e_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    runtime_dir = Path(tempfile.mkdtemp(prefix="sbe2e-", dir="/tmp"))
    storage_dir = Path(f"/dev/shm/shmbuffer-e2e-{uuid.uuid4().hex[:12]}")
    monkeypatch.setenv("SHMBUFFER_RUNTIME_DIR", str(runtime_dir))
    env = Env(runtime_dir, storage_dir)
    try:
        yield env
    finally:
        for pid in env.extra_pids:
            kill_pid(pid)
        shutil.rmtree(runtime_dir, ignore_errors=True)
        shutil.rmtree(storage_dir, ignore_errors=True)


@pytest.fixture
def daemon(e2e_env: Env) -> Iterator[Any]:
    """Factory: ``daemon(capacity=..., unit=..., args=[...])`` starts a real daemon running
    ``shmbuffer-daemon start`` and waits until its runtime file names its pid; with
    ``via_cli=True`` through the console entry, ``python -m shmbuffer.cli start``."""
    started: list[DaemonHandle] = []

    def start(
        *,
        name: str | None = None,
        capacity: int = 10_000,
        unit: str = "episode",
        args: tuple[str, ...] | list[str] = (),
        via_cli: bool = False,
    ) -> DaemonHandle:
        name = name or f"e2e-{uuid.uuid4().hex[:8]}"
        log_path = e2e_env.runtime_dir / f"{name}.daemon-{len(started)}.log"
        argv = [
            "start",
            "--name",
            name,
            "--capacity",
            str(capacity),
            "--unit",
            unit,
            "--storage-dir",
            str(e2e_env.storage_dir),
            *args,
        ]
        process: subprocess.Popen[bytes] | ForkedProcess
        if via_cli or DAEMON_VIA == "subprocess":
            with open(log_path, "wb") as log:
                process = subprocess.Popen(
                    [*CLI, *argv], env=e2e_env.environ, stdout=log, stderr=subprocess.STDOUT
                )
        else:  # the child takes this process's environment, which holds the test's folders
            forked = _workers.context().Process(
                target=_workers.run_cli, args=(argv, str(log_path)), daemon=True
            )
            forked.start()
            process = ForkedProcess(forked, [*CLI, *argv])
        handle = DaemonHandle(name, process, "", e2e_env.storage_dir, e2e_env, log_path)
        started.append(handle)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            info = e2e_env.read_runtime(name)
            if info is not None and info.get("pid") == process.pid:
                handle.endpoint = str(info["endpoint"])
                return handle
            if process.poll() is not None:
                pytest.fail(f"daemon exited with {process.returncode}:\n{handle.log()}")
            if time.monotonic() > deadline:
                pytest.fail(f"daemon not ready in {START_TIMEOUT_S}s:\n{handle.log()}")
            time.sleep(0.05)

    try:
        yield start
    finally:
        for handle in started:
            handle.stop()
            log = handle.log()
            if log:
                print(f"--- daemon {handle.name} (pid {handle.pid}) log ---\n{log}")


class Children:
    """Worker processes (from the preloaded fork server): results come back on a queue;
    teardown kills stragglers."""

    def __init__(self, env: Env) -> None:
        self.env = env
        self.ctx = _workers.context()
        self.results = self.ctx.Queue()
        self.procs: list[Any] = []

    def spawn(self, tag: str, fn: str, *args: Any) -> Any:
        """Run ``tests.e2e._workers.<fn>(*args)`` in a child process."""
        proc = self.ctx.Process(
            target=_workers.entry,
            args=(str(self.env.runtime_dir), self.results, tag, fn, args),
            daemon=True,
        )
        proc.start()
        self.procs.append(proc)
        return proc

    def get(self, timeout: float) -> tuple[str, str, Any]:
        """The next ``(tag, status, value)``; status is "ok", "error" or a worker message."""
        import queue

        try:
            item: tuple[str, str, Any] = self.results.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"no message from the worker processes within {timeout}s")
        return item

    def collect(self, tags: set[str], timeout: float) -> dict[str, Any]:
        """Wait for the final result of each tagged worker; a worker error fails the test."""
        deadline = time.monotonic() + timeout
        out: dict[str, Any] = {}
        while tags - out.keys():
            tag, status, value = self.get(max(0.1, deadline - time.monotonic()))
            if status == "error":
                pytest.fail(f"worker {tag} failed:\n{value}")
            if status == "ok":
                out[tag] = value
        return out

    def join(self, proc: Any, timeout: float) -> int:
        proc.join(timeout)
        if proc.is_alive():
            pytest.fail(f"worker pid {proc.pid} still running after {timeout}s")
        return int(proc.exitcode)

    def close(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.join(1.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        self.results.close()
        self.results.join_thread()


@pytest.fixture
def children(e2e_env: Env) -> Iterator[Children]:
    kids = Children(e2e_env)
    try:
        yield kids
    finally:
        kids.close()
