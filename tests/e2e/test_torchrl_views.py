"""TorchRL's pieces that need a ``TensorStorage`` over a real daemon: ``SliceSampler``
finding trajectories from ``end_key`` when its ``traj_key`` is absent, ``Sequence`` views,
and a ``torch.compile``d function that extends and samples (the daemon's round trips run
eagerly)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torchrl", reason="shmbuffer.torchrl needs the [torchrl] extra")

import torch
from tensordict import TensorDict, is_tensor_collection
from torchrl.data import ReplayBuffer, SliceSampler, TensorDictReplayBuffer, TensorStorage
from torchrl.data.replay_buffers.sample_units import Sequence

from shmbuffer.torchrl import DaemonStorage

pytestmark = pytest.mark.timeout(120)


def episodes(n: int = 12, length: int = 4) -> TensorDict:
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[length - 1 :: length] = True
    return TensorDict({"obs": torch.arange(n), ("next", "done"): done}, [n])


def test_slice_sampler_falls_back_to_end_key_and_sequence_reads_the_rows(daemon: Any) -> None:
    name = daemon(capacity=16, unit="transition").name
    storage = DaemonStorage(name)
    try:
        assert isinstance(storage, TensorStorage)
        assert not storage.initialized
        rb = TensorDictReplayBuffer(
            storage=storage, sampler=SliceSampler(slice_len=4, traj_key="episode"), batch_size=8
        )
        rb.extend(episodes())
        assert storage.initialized
        # "episode" is not a key: trajectories come from ("next", "done"), as on TorchRL's own
        for _ in range(5):
            obs = rb.sample()["obs"].reshape(2, 4)
            assert bool((obs[:, 0] % 4 == 0).all()) and bool((obs.diff(dim=1) == 1).all())
        # storage._storage: a copy of capacity rows, the ones not written yet zeros
        copy = storage._storage
        assert is_tensor_collection(copy) and copy.shape == (16,)
        assert copy["obs"][:12].tolist() == list(range(12)) and copy["obs"][12:].sum() == 0
        assert storage.get(("next", "done")).shape == (12, 1)  # a key: its column
        view, info = Sequence(length=4, episode_boundary="stop").expand(
            torch.tensor([2, 5]), {}, storage
        )
        # "stop": a window that would cross its episode's end (row 7) is shifted back to it
        assert view.reshape(2, 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert info["validity_mask"].all()
        with pytest.raises(RuntimeError, match="Conditional updates are not supported"):
            rb.update_if_present(
                index=torch.tensor([1]), generation=torch.tensor([0]), patch={"obs": torch.ones(1)}
            )
    finally:
        storage.close()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # from inside torch.compile
def test_compiled_extend_and_sample_run_the_daemon_calls_eagerly(daemon: Any) -> None:
    name = daemon(capacity=64, unit="transition").name
    rb = ReplayBuffer(storage=DaemonStorage(name), batch_size=4)

    @torch.compile
    def extend_and_sample(data: TensorDict) -> Any:
        rb.extend(data)
        return rb.sample()

    try:
        for step in range(3):
            batch = extend_and_sample(TensorDict({"obs": torch.arange(8) + 8 * step}, [8]))
            assert batch["obs"].shape == (4,) and bool((batch["obs"] < 8 * (step + 1)).all())
        assert len(rb) == 24
    finally:
        rb.storage.close()
