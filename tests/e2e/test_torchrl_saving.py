"""``rb.empty()``, ``state_dict``/``load_state_dict``, ``dumps``/``loads`` and the writer's
cursor of a TorchRL buffer over real daemons (``shmbuffer/torchrl/saving.py``)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchrl", reason="shmbuffer.torchrl needs the [torchrl] extra")

import torch
from tensordict import TensorDict
from torchrl.data import (
    LazyTensorStorage,
    PrioritizedReplayBuffer,
    ReplayBuffer,
    RoundRobinWriter,
    TensorStorage,
)

from shmbuffer.errors import PermissionDeniedError, SchemaError
from shmbuffer.torchrl import DaemonSampler, DaemonStorage, DaemonWriter

pytestmark = pytest.mark.timeout(120)


def rows(first: int, count: int) -> TensorDict:
    ids = torch.arange(first, first + count)
    return TensorDict({"id": ids, "obs": ids[:, None].float().expand(count, 3)}, [count])


def buffer(name: str, **options: Any) -> ReplayBuffer:
    return ReplayBuffer(storage=DaemonStorage(name, **options), writer=DaemonWriter(), batch_size=4)


def test_empty_clears_the_whole_daemon_for_every_process_and_restarts_the_cursor(
    daemon: Any,
) -> None:
    name = daemon(capacity=8, unit="transition", args=["--sampler", "prioritized"]).name
    rb, other = buffer(name), buffer(name)  # other: another process's view of the same rows
    try:
        rb.extend(rows(0, 6))
        rb.extend(rows(6, 5))  # wraps round: the pointer is at 3
        assert rb.writer._cursor == 3 and rb.write_count == 11 and len(other) == 8
        rb.empty()
        assert len(rb) == 0 and len(other) == 0
        assert rb.writer._cursor == 0 and rb.write_count == 0
        rb.extend(rows(100, 2))
        assert other.storage[:]["id"].tolist() == [100, 101]  # at indices 0 and 1 again
        assert rb.write_count == 2 and other.writer._cursor == 2
        other.set_sampler(DaemonSampler())
        assert set(other.sample()["id"].tolist()) <= {100, 101}
        rb.empty(empty_write_count=False)
        assert len(other) == 0 and rb.write_count == 2
        with pytest.raises(RuntimeError, match="Cannot sample from an empty storage"):
            other.sample()  # TorchRL's words, from the daemon's sampler too
    finally:
        rb.storage.close()
        other.storage.close()


def test_empty_without_a_transport_that_vouches_for_the_caller_is_refused(daemon: Any) -> None:
    """A tcp daemon without CURVE lets any local user claim the admin role: ``empty`` is
    refused, saying what to do, and nothing is cleared."""
    d = daemon(capacity=8, unit="transition", args=["--endpoint", "tcp://127.0.0.1:0"])
    rb = buffer(d.endpoint, remote=True)
    try:
        rb.extend(rows(0, 3))
        with pytest.raises(PermissionDeniedError, match=r"admin request.*--insecure-tcp-admin"):
            rb.empty()
        assert rb.storage[:]["id"].tolist() == [0, 1, 2]
    finally:
        rb.storage.close()


def test_state_dict_moves_the_rows_and_the_ring_position_to_another_daemon(
    daemon: Any, tmp_path: Path
) -> None:
    first = daemon(capacity=8, unit="transition").name
    second = daemon(capacity=8, unit="transition").name
    rb, copy = buffer(first), buffer(second)
    try:
        rb.extend(rows(0, 6))
        rb.extend(rows(6, 5))
        copy.extend(rows(50, 1))  # replaced whole by the load
        torch.save(rb.state_dict(), tmp_path / "rb.pt")
        copy.load_state_dict(torch.load(tmp_path / "rb.pt", weights_only=False))
        assert copy.storage[:]["id"].tolist() == [8, 9, 10, 3, 4, 5, 6, 7]
        assert torch.equal(copy.storage[:]["obs"], rb.storage[:]["obs"])
        assert copy.writer._cursor == rb.writer._cursor == 3
        for each in (rb, copy):  # the next write replaces the oldest row in both
            each.extend(rows(20, 1))
        assert copy.storage[:]["id"].tolist() == rb.storage[:]["id"].tolist()
        assert copy.storage[3]["id"].item() == 20
        # TorchRL's own tensor storage's state dict loads too (rows in index order).
        torchrl_rb = ReplayBuffer(storage=LazyTensorStorage(8), batch_size=4)
        torchrl_rb.extend(rows(30, 5))
        copy.storage.load_state_dict(torchrl_rb.storage.state_dict())
        assert copy.storage[:]["id"].tolist() == [30, 31, 32, 33, 34]
        # ... and a DaemonStorage's loads into TorchRL's.
        mine = TensorStorage(None, max_size=8)
        mine.load_state_dict(copy.storage.state_dict())
        assert mine[:5]["id"].tolist() == [30, 31, 32, 33, 34]
        with pytest.raises(ValueError, match="'_storage'"):
            copy.storage.load_state_dict({"rows": []})
        # Rows of another schema are refused before anything is cleared.
        other = {"_storage": TensorDict({"x": torch.zeros(2)}, [2]).state_dict(), "_len": 2}
        with pytest.raises(SchemaError, match="x"):
            copy.storage.load_state_dict(other)
        assert copy.storage[:]["id"].tolist() == [30, 31, 32, 33, 34]
    finally:
        rb.storage.close()
        copy.storage.close()


class SaveHook:
    """A TorchRL save hook: told where the ring is, shown the rows saved."""

    shift: int | None = None
    is_full: bool | None = None
    seen: list[int] | None = None

    def __call__(self, data: Any, path: Any = None) -> Any:
        self.seen = data["id"].tolist()
        return data


def test_dumps_writes_a_daemon_checkpoint_and_loads_reads_it_back(
    daemon: Any, tmp_path: Path
) -> None:
    d = daemon(capacity=8, unit="transition")
    rb = buffer(d.name)
    try:
        rb.extend(rows(0, 5))
        hook = SaveHook()
        rb.register_save_hook(hook)
        rb.dumps(tmp_path / "saved")
        assert (hook.shift, hook.is_full, hook.seen) == (5, False, [0, 1, 2, 3, 4])
        assert (tmp_path / "saved" / "storage" / "daemon" / "checkpoint").is_dir()
        rb.empty()
        rb.loads(tmp_path / "saved")
        assert rb.storage[:]["id"].tolist() == [0, 1, 2, 3, 4]
        with pytest.raises(FileNotFoundError, match="start --restore"):
            rb.loads(tmp_path / "nothing")
    finally:
        rb.storage.close()
    d.stop()
    # The checkpoint is the daemon's own: a daemon restored from it holds the rows.
    restored = daemon(
        name=d.name,
        capacity=8,
        unit="transition",
        args=["--restore", str(tmp_path / "saved" / "storage" / "daemon")],
    )
    again = buffer(restored.name)
    try:
        assert again.storage[:]["id"].tolist() == [0, 1, 2, 3, 4]
    finally:
        again.storage.close()


def test_a_write_longer_than_the_ring_lands_as_in_torchrl_s_ring(daemon: Any) -> None:
    """Each kept row at the index TorchRL's ring gives it, the cursor ``n`` rows on, and
    ``write_count`` counting every row handed."""
    rb = buffer(daemon(capacity=3, unit="transition").name)
    theirs = ReplayBuffer(storage=LazyTensorStorage(3), batch_size=4)
    try:
        for each in (rb, theirs):
            each.extend(rows(0, 7))
        assert rb.storage[:]["id"].tolist() == theirs.storage[:]["id"].tolist() == [6, 4, 5]
        assert rb.writer._cursor == theirs.writer._cursor == 1
        assert rb.write_count == theirs.write_count == 7
    finally:
        rb.storage.close()


def test_the_storage_is_the_one_line_change_for_replay_buffers_and_prioritized_ones(
    daemon: Any,
) -> None:
    """TorchRL's defaults that cannot work over a daemon become the adapters: the default
    writer a DaemonWriter, a PrioritizedReplayBuffer's own sampler a DaemonSampler (its beta;
    its alpha checked against the daemon's exponent)."""
    args = ["--sampler", "prioritized", "--priority-exponent", "0.7"]
    name = daemon(capacity=16, unit="transition", args=args).name
    rb = ReplayBuffer(storage=DaemonStorage(name), batch_size=4)
    prb = PrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=DaemonStorage(name), batch_size=4)
    other = PrioritizedReplayBuffer(alpha=0.9, beta=0.5, storage=DaemonStorage(name), batch_size=4)
    try:
        assert isinstance(rb.writer, DaemonWriter) and isinstance(prb.writer, DaemonWriter)
        assert isinstance(prb.sampler, DaemonSampler) and prb.sampler.beta == 0.5
        rb.extend(rows(0, 8))
        assert len(prb) == 8 and set(rb.sample()["id"].tolist()) <= set(range(8))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the exponents agree: nothing to say
            sample, info = prb.sample(return_info=True)
        prb.update_priority(info["index"], torch.full((4,), 1e9))
        assert set(prb.sample()["id"].tolist()) <= set(sample["id"].tolist())
        with pytest.warns(UserWarning, match=r"priority exponent 0\.7.*--priority-exponent 0\.9"):
            other.sample()
    finally:
        for each in (rb, prb, other):
            each.storage.close()


def test_storage_set_at_the_ring_pointer_is_written_elsewhere_in_place(daemon: Any) -> None:
    """TorchRL's RoundRobinWriter (and ``storage.set(range(n), rows)`` on a fresh storage)
    write where the ring's pointer is: new rows. A row written already is changed in place,
    the pointer left where it was (``tests/e2e/test_torchrl_inplace.py``)."""
    storage = DaemonStorage(daemon(capacity=4, unit="transition").name)
    try:
        storage.set(range(3), torch.arange(3))
        rb = ReplayBuffer(storage=storage, writer=RoundRobinWriter(), batch_size=2)
        rb.writer._cursor = 3  # where the rows above left TorchRL's own cursor
        rb.extend(torch.arange(10, 13))  # rows 3, 0 and 1, as in TorchRL's ring
        assert storage[:].tolist() == [11, 12, 2, 10] and rb.writer._cursor == 2
        assert storage._storage[[3, 1]].tolist() == [10, 12]  # TorchRL code reads it so
        storage.set(0, torch.tensor(7))
        assert storage[:].tolist() == [7, 12, 2, 10] and rb.writer._cursor == 2
    finally:
        storage.close()


def test_a_buffer_s_generator_seeds_torchrl_s_client_side_draws(daemon: Any) -> None:
    name = daemon(capacity=16, unit="transition").name
    draws = []
    for _ in range(2):
        generator = torch.Generator().manual_seed(7)
        rb = ReplayBuffer(storage=DaemonStorage(name), batch_size=8, generator=generator)
        try:
            if not len(rb):
                rb.extend(rows(0, 16))
            draws.append(rb.sample()["id"].tolist())
        finally:
            rb.storage.close()
    assert draws[0] == draws[1]
