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
from tensordict import is_tensor_collection
from torch.utils._pytree import tree_leaves

from shmbuffer.torchrl import DaemonStorage, DaemonWriter
from tests.e2e import _workers
from tests.peers._torchrl_native import outcome, record

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
        if device not in (None, "cpu", "auto") and torch.device(device).type != "cpu":
            raise NotImplementedError(f"DaemonStorage rows are read to the CPU, got {device}")
        size = 1000 if max_size is None else int(max_size)
        if ndim == 2:
            # The daemon counts trajectories of T steps and a test gives max_size in steps:
            # it is started at the first write, which says T (_Deferred below).
            super().__init__(f"trl-pending-{uuid.uuid4().hex[:10]}", timeout=5.0, ndim=2)
            self._pending: int | None = size
            _USED.add(_CURRENT[0])
            return
        proc, name = _start_daemon(size)
        super().__init__(name, timeout=5.0, ndim=ndim)
        self._pending = None
        _STARTED.append((proc, name, self))
        _USED.add(_CURRENT[0])

    def start_for(self, data: Any) -> None:
        """Start an ndim=2 storage's daemon, ``max_size / T`` rows, ``T`` from ``data`` (a
        batch: rows first, then T)."""
        if self._pending is None:
            return
        leaf = data if isinstance(data, torch.Tensor) else next(iter(tree_leaves(data)))
        if is_tensor_collection(data):
            steps = int(data.shape[1]) if data.ndim > 1 else 1
        else:
            steps = int(leaf.shape[1]) if leaf.ndim > 1 else 1
        proc, name = _start_daemon(max(1, -(self._pending // -steps)))
        self.target, self._pending = name, None
        _STARTED.append((proc, name, self))

    def _rows_in_use(self) -> int:
        return 0 if self._pending is not None else super()._rows_in_use()

    def _steps(self) -> int | None:
        return None if self._pending is not None else super()._steps()

    @property
    def max_size(self) -> int:
        return self._pending if self._pending is not None else super().max_size

    def _max_size_along_dim0(self, *, single_data: Any = None, batched_data: Any = None) -> int:
        if batched_data is not None:
            self.start_for(batched_data)
        elif single_data is not None:
            self.start_for(torch.utils._pytree.tree_map(lambda x: x.unsqueeze(0), single_data))
        return super()._max_size_along_dim0()

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        self.start_for(data)
        super().set(cursor, data, set_cursor=set_cursor)


_daemon_extend = DaemonWriter.extend


def _extend(self: DaemonWriter, data: Any) -> Any:
    """A DaemonWriter's first write to an ndim=2 harness storage starts its daemon."""
    storage = self._storage
    if isinstance(storage, _HarnessStorage) and storage._pending is not None:
        storage.start_for(data)
    return _daemon_extend(self, data)


DaemonWriter.extend = _extend  # type: ignore[method-assign]


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
    report = (yield).get_result()
    state = outcome(report)
    if state is None:
        return
    message = ""
    crash = getattr(report.longrepr, "reprcrash", None)
    if state == "failed" and crash is not None:
        message = crash.message.strip().splitlines()[0][:400] if crash.message.strip() else ""
    elif state == "failed":
        message = str(report.longrepr).strip().splitlines()[-1][:400]
    record(
        {"test": item.nodeid, "outcome": state, "message": message, "daemon": item.nodeid in _USED}
    )
