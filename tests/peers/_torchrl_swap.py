"""A pytest plugin that runs TorchRL's own replay-buffer tests on ``shmbuffer.torchrl``.

Loaded into a pytest run over TorchRL's test files (``-p tests.peers._torchrl_swap``, started
by ``tests/peers/test_torchrl_suite.py``), before they are imported. It makes the change a
user makes, everywhere a test builds a buffer part by its public name:

- storages: ``ListStorage``, ``LazyTensorStorage`` and ``LazyMemmapStorage`` become a
  :class:`~shmbuffer.torchrl.DaemonStorage` over a fresh daemon of that capacity (transition
  unit, ``--sampler prioritized``), stopped when the test ends;
- nothing else: a buffer over a daemon storage gets a
  :class:`~shmbuffer.torchrl.DaemonWriter` in place of its default writer, and a
  :class:`~shmbuffer.torchrl.DaemonSampler` in place of a TorchRL ``PrioritizedSampler``,
  from ``DaemonStorage.attach``, as in a user's program; writers a test names
  (``RoundRobinWriter``, ...) write through ``storage.set``, honoured at the ring's pointer,
  and TorchRL's samplers run as they are.

TorchRL's internals keep their own classes (only the names a test imports are replaced), so
its ``isinstance`` checks see what a user's code would give them. Parametrizations that
differ only by which TorchRL storage they name are one test here, and run once.
Each test's outcome, the error's first line and whether it built a daemon storage go to the
JSON-lines file ``SHMBUFFER_TORCHRL_REPORT``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torchrl.data as trl_data
import torchrl.data.replay_buffers as trl_rb
import torchrl.data.replay_buffers.samplers as trl_samplers
import torchrl.data.replay_buffers.storages as trl_storages
import torchrl.data.replay_buffers.writers as trl_writers

from shmbuffer.torchrl import DaemonStorage
from tests.e2e import _workers

START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0
#: The daemons and storages the running test started, closed at its teardown.
_STARTED: list[tuple[Any, str, DaemonStorage]] = []
_USED: set[str] = set()  # node ids of tests that built a daemon storage
_CURRENT: list[str] = [""]


def _start_daemon(capacity: int) -> tuple[Any, str]:
    runtime = Path(os.environ["SHMBUFFER_RUNTIME_DIR"])
    name = f"trl-{uuid.uuid4().hex[:10]}"
    argv = [
        "start",
        "--name",
        name,
        "--capacity",
        str(capacity),
        "--unit",
        "transition",
        "--sampler",
        "prioritized",
        "--storage-dir",
        os.environ["SHMBUFFER_TORCHRL_STORAGE_DIR"],
    ]
    proc = _workers.context().Process(
        target=_workers.run_cli, args=(argv, str(runtime / f"{name}.log")), daemon=True
    )
    proc.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    info = runtime / f"{name}.json"
    while True:
        if info.exists():
            try:
                if json.loads(info.read_text()).get("pid") == proc.pid:
                    return proc, name
            except ValueError:
                pass  # being written
        if not proc.is_alive() or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"harness: daemon {name} did not start")
        time.sleep(0.01)


class _HarnessStorage(DaemonStorage):
    """A DaemonStorage over a daemon of ``max_size`` rows started for the running test."""

    def __init__(
        self,
        max_size: int | None = None,
        *,
        device: Any = "cpu",
        ndim: int = 1,
        compilable: bool = False,
        **_: Any,
    ) -> None:
        if ndim != 1:
            # DaemonStorage(ndim=2) counts its daemon's rows as trajectories of T steps, and
            # T is only known at the first write: a test's max_size in steps cannot size it.
            raise NotImplementedError(
                "harness: an ndim=2 DaemonStorage's daemon is sized in trajectories "
                "(--capacity = max_size / T), and T is not known before the first write; "
                "not one-dimensional, so not run here"
            )
        if device not in (None, "cpu", "auto") and torch.device(device).type != "cpu":
            raise NotImplementedError(f"DaemonStorage rows are read to the CPU, got {device}")
        proc, name = _start_daemon(1000 if max_size is None else int(max_size))
        super().__init__(name, timeout=5.0)
        _STARTED.append((proc, name, self))
        _USED.add(_CURRENT[0])


class ListStorage(_HarnessStorage):
    pass


class LazyTensorStorage(_HarnessStorage):
    pass


class LazyMemmapStorage(LazyTensorStorage):
    def __init__(self, max_size: int | None = None, *, scratch_dir: Any = None, **kw: Any) -> None:
        super().__init__(max_size, **kw)


SUBSTITUTES: dict[str, type] = {
    "ListStorage": ListStorage,
    "LazyTensorStorage": LazyTensorStorage,
    "LazyMemmapStorage": LazyMemmapStorage,
}
#: What the originals become in a parametrization's key (see ``_dedupe``).
_LABELS: dict[Any, str] = {}
for _module in (trl_data, trl_rb, trl_storages, trl_samplers, trl_writers):
    for _name, _substitute in SUBSTITUTES.items():
        _original = getattr(_module, _name, None)
        if _original is not None and _original is not _substitute:
            _LABELS[_original] = _name
            setattr(_module, _name, _substitute)
_LABELS.update({cls: name for name, cls in SUBSTITUTES.items()})
_STORAGE_LABELS = {"ListStorage", "LazyTensorStorage", "LazyMemmapStorage"}


def _label(value: Any) -> str:
    try:
        label = _LABELS.get(value)
    except TypeError:  # unhashable: a list or dict of parameters
        return repr(value)
    if label in _STORAGE_LABELS:
        return "DaemonStorage"
    return label or repr(value)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep one test per parametrization that differs only in the TorchRL storage it names
    (they all run on DaemonStorage here)."""
    seen: set[tuple[Any, ...]] = set()
    kept = []
    for item in items:
        callspec = getattr(item, "callspec", None)
        params = (
            ()
            if callspec is None
            else tuple(sorted((k, _label(v)) for k, v in callspec.params.items()))
        )
        key = (item.nodeid.split("[")[0], params)
        if key not in seen:
            seen.add(key)
            kept.append(item)
    if len(kept) < len(items):
        dropped = [item for item in items if item not in set(kept)]
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def _stop_all() -> None:
    while _STARTED:
        proc, _name, storage = _STARTED.pop()
        # A test may have left it broken; the daemon is stopped below all the same.
        with contextlib.suppress(Exception):
            storage.close()
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGTERM)
            proc.join(STOP_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join(STOP_TIMEOUT_S)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _CURRENT[0] = item.nodeid


def pytest_runtest_teardown(item: pytest.Item) -> None:
    _stop_all()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Any:
    outcome = yield
    report = outcome.get_result()
    if report.when == "teardown" or (report.when == "setup" and report.passed):
        return
    if report.when == "setup" and report.skipped:
        state = "skipped"
    elif report.when == "call":
        state = "passed" if report.passed else "skipped" if report.skipped else "failed"
    else:
        state = "failed"
    message = ""
    crash = getattr(report.longrepr, "reprcrash", None)
    if state == "failed" and crash is not None:
        message = crash.message.strip().splitlines()[0][:400] if crash.message.strip() else ""
    elif state == "failed":
        message = str(report.longrepr).strip().splitlines()[-1][:400]
    record = {
        "test": item.nodeid,
        "outcome": state,
        "message": message,
        "daemon": item.nodeid in _USED,
    }
    with open(os.environ["SHMBUFFER_TORCHRL_REPORT"], "a") as out:
        out.write(json.dumps(record) + "\n")
