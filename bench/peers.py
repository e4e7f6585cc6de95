"""Peers: TorchRL replay buffers and cpprb, driven through the common adapter interface.

Both are optional (the ``bench`` extra); a missing one is skipped with a note.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from typing import Any

import numpy as np

from bench.adapters import Adapter, Unsupported, missing_module
from bench.data import Batch, Spec


def cpprb_env(spec: Spec) -> dict[str, dict[str, Any]]:
    """``spec`` as cpprb's ``env_dict`` (a scalar as ``shape=1``, cpprb's default)."""
    return {k: {"shape": shape or 1, "dtype": dtype} for k, (shape, dtype) in spec.items()}


class _TorchRL(Adapter):
    """``torchrl.data.ReplayBuffer`` with ``extend(TensorDict)``. TorchRL has no episode unit:
    an episode is one extend of its rows; episodes are sampled with ``SliceSampler``, which finds
    episode ends from the ``done`` flags."""

    @classmethod
    def missing(cls) -> str | None:
        return missing_module("torchrl")

    def __init__(self, capacity: int, spec: Spec, unit: str, tmpdir: str) -> None:
        super().__init__(capacity, spec, unit, tmpdir)
        from torchrl.data import ReplayBuffer

        logging.getLogger("torchrl").setLevel(logging.WARNING)
        self.storage = self.make_storage(capacity)
        self.rb = ReplayBuffer(storage=self.storage)
        self.slices: dict[int, Any] = {}

    def make_storage(self, capacity: int) -> Any:
        raise NotImplementedError

    def convert(self, batch: Batch) -> Any:
        import torch
        from tensordict import TensorDict

        n = len(batch["done"])
        return TensorDict({k: torch.from_numpy(v) for k, v in batch.items()}, batch_size=[n])

    def write(self, native: Any) -> None:
        self.rb.extend(native)

    def read(self, start: int, stop: int) -> Any:
        return self.rb[start:stop]

    def read_index(self, idx: np.ndarray) -> Any:
        import torch

        return self.rb[torch.from_numpy(idx)]

    def sample(self, n: int) -> Any:
        return self.rb.sample(n)

    def _slice_rb(self, n: int) -> Any:
        if n not in self.slices:
            from torchrl.data import ReplayBuffer, SliceSampler

            sampler = SliceSampler(num_slices=n, end_key="done")
            self.slices[n] = ReplayBuffer(storage=self.storage, sampler=sampler)
        return self.slices[n]

    def prepare_sampling(self) -> None:
        if self.unit == "episode":
            self._slice_rb(32).sample(32 * 2)

    def sample_episodes(self, n: int, length: int) -> Any:
        return self._slice_rb(n).sample(n * length).reshape(n, length)


class TorchRLTensor(_TorchRL):
    name = "torchrl-LazyTensorStorage"

    def make_storage(self, capacity: int) -> Any:
        from torchrl.data import LazyTensorStorage

        return LazyTensorStorage(capacity)


class TorchRLMemmap(_TorchRL):
    name = "torchrl-LazyMemmapStorage"

    def make_storage(self, capacity: int) -> Any:
        from torchrl.data import LazyMemmapStorage

        self.scratch = tempfile.mkdtemp(prefix="bench-memmap-", dir=self.tmpdir)
        return LazyMemmapStorage(capacity, scratch_dir=self.scratch)

    def close(self) -> None:
        del self.rb, self.storage, self.slices
        shutil.rmtree(self.scratch, ignore_errors=True)


class Cpprb(Adapter):
    """``cpprb.ReplayBuffer(N, env_dict)`` with ``add(**arrays)``. cpprb has no public slice or
    index read: reads use ``_encode_sample(idx)``, the gather behind ``sample``."""

    name = "cpprb"

    @classmethod
    def missing(cls) -> str | None:
        return missing_module("cpprb")

    def __init__(self, capacity: int, spec: Spec, unit: str, tmpdir: str) -> None:
        super().__init__(capacity, spec, unit, tmpdir)
        import cpprb

        self.rb = cpprb.ReplayBuffer(capacity, cpprb_env(spec))

    def write(self, native: Any) -> None:
        self.rb.add(**native)

    def read(self, start: int, stop: int) -> Any:
        return self.rb._encode_sample(np.arange(start, stop))

    def read_index(self, idx: np.ndarray) -> Any:
        return self.rb._encode_sample(idx)

    def sample(self, n: int) -> Any:
        return self.rb.sample(n)

    def sample_episodes(self, n: int, length: int) -> Any:
        raise Unsupported("cpprb has no episode sampling")
