"""``DaemonWriter.extend`` returns where the daemon put the rows (a local writer that waits for
its commits), so TorchRL's samplers that keep state by those indices (a
``PrioritizedSliceSampler``'s sum tree) work over a ``DaemonStorage``, on a real daemon."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torchrl", reason="shmbuffer.torchrl needs the [torchrl] extra")

import torch
from tensordict import TensorDict
from torchrl.data import (
    PrioritizedSliceSampler,
    ReplayBuffer,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
)

from shmbuffer.torchrl import DaemonSampler, DaemonStorage, DaemonWriter

pytestmark = pytest.mark.timeout(120)


def rows(first: int, n: int) -> TensorDict:
    obs = torch.arange(first, first + n, dtype=torch.float32)
    return TensorDict({"obs": obs, "episode": torch.arange(first, first + n) // 4}, [n])


def test_extend_returns_the_rows_the_daemon_chose_with_another_writer_between(
    daemon: Any,
) -> None:
    name = daemon(capacity=16, unit="transition").name
    ours = ReplayBuffer(storage=DaemonStorage(name))
    other = ReplayBuffer(storage=DaemonStorage(name))  # a second Writer on the same ring
    try:
        seen = []
        for step in range(5):  # 5 x (3 + 2) rows in a ring of 16: it wraps round
            index = ours.extend(rows(100 * step, 3))
            other.extend(rows(100 * step + 50, 2))  # lands between this writer's rows
            seen.append(index)
            assert index.dtype == torch.long and index.shape == (3,)
            assert bool(((index >= 0) & (index < 16)).all())
            # the rows at the returned indices are the ones this extend wrote
            assert torch.equal(ours.storage[index]["obs"], rows(100 * step, 3)["obs"])
        assert torch.equal(seen[0], torch.tensor([0, 1, 2]))
        assert torch.equal(seen[1], torch.tensor([5, 6, 7]))  # after the other writer's 2
        lazy = ReplayBuffer(storage=DaemonStorage(name), writer=DaemonWriter(flush=False))
        assert bool((lazy.extend(rows(0, 2)) == -1).all())  # not committed yet: unknown
        lazy.storage.close()
    finally:
        ours.storage.close()
        other.storage.close()


def test_torchrl_prioritized_slice_sampler_keeps_its_tree_by_those_indices(daemon: Any) -> None:
    name = daemon(capacity=32, unit="transition").name
    sampler = PrioritizedSliceSampler(
        max_capacity=32, num_slices=2, alpha=0.7, beta=0.9, traj_key="episode"
    )
    rb = TensorDictReplayBuffer(storage=DaemonStorage(name), sampler=sampler, batch_size=4)
    try:
        index = rb.extend(rows(0, 12))  # three episodes of 4
        # every row written got TorchRL's default priority in its own sum tree
        assert sampler._sum_tree.query(0, 32) > 0
        assert [sampler._sum_tree[int(i)] > 0 for i in index] == [True] * 12
        # all the weight on episode 1: slices come from it alone
        priority = torch.zeros(12)
        priority[4:8] = 1.0
        rb.update_priority(index, priority)
        for _ in range(5):
            sample = rb.sample()
            assert bool((sample["episode"] == 1).all()), sample["episode"]
    finally:
        rb.storage.close()


def test_a_priority_key_reaches_the_daemon_s_rows_through_those_indices(daemon: Any) -> None:
    name = daemon(
        capacity=32,
        unit="transition",
        args=["--sampler", "prioritized", "--priority-exponent", "1"],
    ).name
    rb = TensorDictPrioritizedReplayBuffer(
        alpha=1.0, beta=0.5, storage=DaemonStorage(name), priority_key="td_error", batch_size=64
    )
    try:
        assert isinstance(rb.sampler, DaemonSampler) and rb.sampler.device == torch.device("cpu")
        td_error = torch.zeros(16, 1)  # a column: one priority per row
        td_error[9] = 1.0
        data = rows(0, 16)
        data["td_error"] = td_error
        rb.extend(data)  # TorchRL applies td_error to the indices extend returns
        sample = rb.sample()
        assert bool((sample["obs"] == 9).all()), sample["obs"]  # every other row has 0
    finally:
        rb.storage.close()
