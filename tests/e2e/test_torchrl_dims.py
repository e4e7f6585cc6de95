"""``DaemonStorage(name, ndim=2)`` over a real daemon: ``[T, num_envs]`` trajectories stored
one env per daemon row, indexed ``(row, step)`` as TorchRL's own two-dimensional storages
(``shmbuffer/torchrl/dims.py``), side by side with ``LazyTensorStorage(ndim=2)``."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torchrl", reason="shmbuffer.torchrl needs the [torchrl] extra")

import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, SamplerWithoutReplacement, TensorDictReplayBuffer

from shmbuffer.torchrl import DaemonStorage

pytestmark = pytest.mark.timeout(120)

T, ENVS, ROWS = 5, 3, 4


def trajectories(first: int) -> TensorDict:
    obs = torch.arange(first, first + T * ENVS).reshape(T, ENVS)
    return TensorDict({"obs": obs, "next": {"obs": obs + 1000}}, [T, ENVS])


def test_two_dimensional_storage_matches_torchrl_s(daemon: Any) -> None:
    name = daemon(capacity=ROWS, unit="transition").name  # capacity: trajectories
    ours = TensorDictReplayBuffer(storage=DaemonStorage(name, ndim=2), batch_size=6)
    theirs = TensorDictReplayBuffer(storage=LazyTensorStorage(ROWS * T, ndim=2), batch_size=6)
    other = DaemonStorage(name, ndim=2)  # another process's: T from the shared schema
    try:
        for rb in (ours, theirs):
            rb.extend(trajectories(0))
            rb.extend(trajectories(100))  # 6 env rows in a ring of 4: wraps round
        assert len(ours) == len(theirs) == ROWS * T and ours.storage.max_size == ROWS * T
        assert ours.storage.shape == theirs.storage.shape == torch.Size([ROWS, T])
        assert torch.equal(ours[:]["obs"], theirs[:]["obs"])
        assert torch.equal(other[:]["next", "obs"], theirs.storage[:]["next", "obs"])
        index = (torch.tensor([0, 3, 2]), torch.tensor([4, 0, 2]))
        assert torch.equal(ours.storage[index]["obs"], theirs.storage[index]["obs"])
        assert torch.equal(ours.storage[1]["obs"], theirs.storage[1]["obs"])  # one env's steps
        sample = ours.sample()
        assert sample.batch_size == (6,)
        row, step = sample["index"].unbind(-1)  # TorchRL's (row, step) pairs
        assert torch.equal(sample["obs"], other[(row, step)]["obs"])
        ours.set_sampler(SamplerWithoutReplacement())
        seen = torch.cat([ours.sample()["obs"] for _ in range(ROWS * T // 6)])
        assert seen.unique().numel() == seen.numel()  # each step once
        with pytest.raises(NotImplementedError, match="ndim=3"):
            DaemonStorage(name, ndim=3)
    finally:
        ours.storage.close()
        other.close()
