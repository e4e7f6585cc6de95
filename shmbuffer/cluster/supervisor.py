"""One daemon child and its lifetime: started through the command line, restarted with
``--resume`` when it dies, stopped explicitly.

A :class:`DaemonSupervisor` runs ``python -m shmbuffer.cli start`` as its own child (never
imports the daemon), on a tcp endpoint of the node's address, and watches it from one thread:

* **Start** clears what a dead daemon of the same name left (its runtime file and segment: the
  name is scoped to the buffer and the node, so nothing else uses it) and waits until the
  daemon's runtime file names the child's pid. The first start binds port 0; the port it got is
  kept for every restart, so clients' endpoints stay valid.
* **Death** of the child (SIGKILL, a crash) is seen within ``check_interval``; the daemon is
  started again with ``--resume`` on the same endpoint, which re-attaches the segment and the
  journal the dead one left: every committed row is served again. A resume that fails falls
  back to a fresh start (the rows are lost; logged as an error); repeated failures back off.
* **Stop** is explicit: SIGTERM (the daemon's clean stop: segment and runtime file removed),
  a wait of ``stop_timeout``, then SIGKILL and the leftovers removed here. The child's log
  (``<runtime dir>/<name>.cluster.log``) is removed after a clean stop, kept otherwise.
* **Death of the supervisor's process** (Ray stops actors with SIGKILL) reaches the daemon as
  SIGTERM through ``PR_SET_PDEATHSIG``, set in the child before it runs. The kernel ties that
  signal to the *thread* that forked the child, so every start happens on the watcher thread,
  which lives until :meth:`stop`.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from shmbuffer import runtime
from shmbuffer.errors import ShmBufferError
from shmbuffer.storage.segment import Segment
from shmbuffer.wire import curve

log = logging.getLogger("shmbuffer.cluster")

PR_SET_PDEATHSIG = 1
#: A restart that keeps failing waits this long at most between tries.
MAX_BACKOFF_S = 5.0

_libc: Any = None
with contextlib.suppress(OSError, AttributeError):  # Linux only; elsewhere no death signal
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    _prctl = _libc.prctl


def _die_with_parent(parent: int) -> None:  # pragma: no cover - runs in the forked child
    """preexec_fn: SIGTERM this child when the thread that forked it ends (its process was
    killed); exit at once if the parent is already gone. Resolved before the fork: the child
    only makes these calls."""
    if _libc is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # died before the signal was armed
            os._exit(1)


def tcp_endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def make_curve_keys(folder: Path) -> tuple[Path, str]:
    """A fresh CURVE keypair in ``folder`` (owner-only): the secret certificate's path for
    ``--curve-secret`` and the public key as Z85 text, which clients pass as
    ``curve_server_key``."""
    import zmq.auth

    public, secret = curve.keygen(folder, "server", force=True)
    key, _ = zmq.auth.load_certificate(public)
    return secret, key.decode("ascii")


class DaemonSupervisor:
    """Owns the daemon serving ``name``; see the module docstring.

    Args:
        name: the daemon's buffer name (scoped by the caller, e.g. to the node).
        flags: ``start`` arguments (``options.start_flags``: may begin with ``--log-level L``,
            then ``start`` and its flags); the endpoint and ``--resume`` are added here.
        host: the address to listen on (the node's).
        storage_dir: the segment folder (None: the daemon's default).
        ready_timeout: seconds a start may take to be ready.
        check_interval: seconds between checks that the child lives.
        stop_timeout: seconds SIGTERM is given before SIGKILL.
    """

    def __init__(
        self,
        name: str,
        flags: list[str],
        *,
        host: str = "127.0.0.1",
        storage_dir: str | None = None,
        ready_timeout: float = 60.0,
        check_interval: float = 0.2,
        stop_timeout: float = 10.0,
    ) -> None:
        self.name = name
        self.flags = list(flags)
        self.storage_dir = storage_dir
        self.ready_timeout = ready_timeout
        self.check_interval = check_interval
        self.stop_timeout = stop_timeout
        self.endpoint = tcp_endpoint(host, 0)
        self.restarts = 0
        self.log_path = runtime.runtime_dir() / f"{name}.cluster.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None  # of the daemon while it is up
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.returncode: int | None = None

    # -- public -------------------------------------------------------------------------------

    def start(self) -> dict[str, Any]:
        """Start the daemon (clearing a dead one's leftovers first) and the watcher; returns
        :meth:`info`. ShmBufferError when it does not come up (with its log's tail)."""
        if self._thread is not None:
            raise RuntimeError("DaemonSupervisor.start() was called already")
        self._thread = threading.Thread(target=self._run, name=f"shmbuffer-{self.name}")
        self._thread.daemon = True
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            self._thread.join(self.stop_timeout)
            raise self._error
        return self.info()

    def info(self) -> dict[str, Any]:
        """``name``, ``endpoint``, ``pid`` (None while it is down), ``alive``, ``restarts``."""
        with self._lock:
            pid = self._pid
            alive = self._proc is not None and self._proc.poll() is None and pid is not None
        return {
            "name": self.name,
            "endpoint": self.endpoint,
            "pid": pid if alive else None,
            "alive": alive,
            "restarts": self.restarts,
            "log": str(self.log_path),
        }

    def stop(self) -> int | None:
        """Stop the daemon (SIGTERM, wait, SIGKILL) and the watcher; returns the daemon's exit
        code (None if none ran). Safe to call twice."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.stop_timeout * 2 + 5)
        return self.returncode

    # -- the watcher thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._clear_stale()
            self._spawn(resume=False)
        except BaseException as exc:
            self._error = exc
            self._started.set()
            return
        self._started.set()
        backoff = self.check_interval
        try:
            while not self._stop.wait(backoff):
                proc = self._proc
                if proc is not None and proc.poll() is None:
                    backoff = self.check_interval
                    continue
                if proc is not None:
                    log.warning(
                        "the daemon of %s (pid %s) exited with %s; restarting it with --resume",
                        self.name,
                        proc.pid,
                        proc.returncode,
                    )
                    with self._lock:
                        self._pid = None
                if self._restart():
                    backoff = self.check_interval
                else:
                    backoff = min(MAX_BACKOFF_S, backoff * 2)
        finally:
            self._terminate()

    def _restart(self) -> bool:
        """Resume the dead daemon's segment on its endpoint, else on any free port (its port
        may have been taken), else start afresh (its rows are lost). Whether it is up."""
        kept = self.endpoint
        anyport = tcp_endpoint(kept[len("tcp://") :].rsplit(":", 1)[0].strip("[]"), 0)
        for resume, endpoint in ((True, kept), (True, anyport), (False, anyport)):
            self.endpoint = endpoint
            try:
                if not resume:
                    log.error(
                        "could not resume %s: starting it empty, its rows are lost", self.name
                    )
                    self._clear_stale()
                self._spawn(resume=resume)
            except ShmBufferError as exc:
                log.error("restarting %s failed: %s", self.name, exc)
                if self._stop.is_set():
                    break
                continue
            self.restarts += 1
            return True
        self.endpoint = kept
        return False

    def _argv(self, resume: bool) -> list[str]:
        argv = [sys.executable, "-m", "shmbuffer.cli", *self.flags]
        argv += ["--name", self.name, "--endpoint", self.endpoint]
        if self.storage_dir is not None:
            argv += ["--storage-dir", self.storage_dir]
        if resume:
            argv.append("--resume")
        return argv

    def _spawn(self, resume: bool) -> None:
        """Start the child and wait until it is ready (its runtime file names it)."""
        with open(self.log_path, "ab") as out:
            offset = out.seek(0, os.SEEK_END)
            proc = subprocess.Popen(
                self._argv(resume),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # one prctl call, resolved before the fork: safe in a threaded parent
                preexec_fn=functools.partial(_die_with_parent, os.getpid()),  # noqa: PLW1509
            )
        with self._lock:
            self._proc = proc
        deadline = time.monotonic() + self.ready_timeout
        while True:
            info = self._runtime_info()
            if info is not None and info.get("pid") == proc.pid:
                break
            if proc.poll() is not None:
                raise ShmBufferError(
                    f"the daemon of {self.name} exited with {proc.returncode} while starting"
                    f"{' (--resume)' if resume else ''}: {self._log_tail(offset)}"
                )
            if time.monotonic() > deadline or self._stop.is_set():
                self._kill(proc)
                raise ShmBufferError(
                    f"the daemon of {self.name} was not ready within {self.ready_timeout:g}s: "
                    f"{self._log_tail(offset)}"
                )
            time.sleep(0.05)
        with self._lock:
            self._pid = proc.pid
            self.endpoint = str(info["endpoint"])  # the port 0 chose, kept for restarts

    def _runtime_info(self) -> dict[str, Any] | None:
        with contextlib.suppress(ValueError, OSError):  # half-written: read again
            return runtime.read(self.name)
        return None

    def _log_tail(self, offset: int, lines: int = 15) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                text = f.read()[-32768:].decode(errors="replace")
        except OSError:
            return "(no log)"
        tail = text.strip().splitlines()[-lines:]
        return "\n".join(tail) if tail else "(nothing logged)"

    def _clear_stale(self) -> None:
        """Remove a dead daemon's runtime file and segment of this name; a live one is given
        ``stop_timeout`` to go (a killed host's daemon is stopping on its death signal)."""
        info = runtime.read(self.name)
        if info is not None and not runtime.is_stale(info):
            pid = int(info["pid"])
            deadline = time.monotonic() + self.stop_timeout
            while runtime.pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if runtime.pid_alive(pid):
                raise ShmBufferError(
                    f"a daemon (pid {pid}) still serves {self.name!r}, which this shard host "
                    "owns: is another ShardedBuffer of this name running? Stop it first"
                )
        if info is not None:
            runtime.remove(self.name)
        (runtime.runtime_dir() / f"{self.name}.pid").unlink(missing_ok=True)
        Segment.unlink(self.name, self.storage_dir)

    def _kill(self, proc: subprocess.Popen[bytes]) -> int:
        """SIGTERM, ``stop_timeout``, SIGKILL; the exit code."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                log.warning("the daemon of %s ignored SIGTERM; killing it", self.name)
                proc.kill()
                proc.wait(self.stop_timeout)
        return int(proc.returncode)

    def _terminate(self) -> None:
        proc = self._proc
        if proc is None:
            return
        self.returncode = self._kill(proc)
        with self._lock:
            self._pid = None
        # A clean stop removed these; a killed daemon left them.
        with contextlib.suppress(ShmBufferError, OSError, ValueError):
            runtime.remove(self.name, proc.pid)
            (runtime.runtime_dir() / f"{self.name}.pid").unlink(missing_ok=True)
            Segment.unlink(self.name, self.storage_dir)
        if self.returncode == 0:  # nothing to look into: the log goes too
            self.log_path.unlink(missing_ok=True)
