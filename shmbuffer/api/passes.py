"""Passes over every stored row, split between ranks (``Buffer.iterate``): which shuffle each
pass uses, and its minibatches.

PyTorch's ``DistributedSampler`` convention: every rank's k-th pass shuffles the rows alike
(seeded by the buffer's seed and k), so the ranks split one permutation between them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

import numpy as np
import numpy.typing as npt

__all__ = ["Passes", "batches"]

T = TypeVar("T")


class Passes:
    """The seed of the next pass of each ``(rank, world_size)``, from the buffer's ``seed``."""

    def __init__(self, seed: int | None) -> None:
        self._root = int(np.random.SeedSequence(seed).entropy)  # type: ignore[arg-type]
        self._done: dict[tuple[int, int], int] = {}

    def next_seed(self, rank: int, world_size: int) -> list[int]:
        """The shuffle seed of this rank's next pass (and count it)."""
        k = self._done.get((rank, world_size), 0)
        self._done[(rank, world_size)] = k + 1
        return [self._root, k]


def batches(
    rows: npt.NDArray[np.int64],
    batch_size: int,
    drop_last: bool,
    read: Callable[[npt.NDArray[np.int64]], T],
) -> Iterator[T]:
    """``read`` of each ``batch_size`` run of ``rows`` in order; ``drop_last``: no short one."""
    stop = len(rows) - len(rows) % batch_size if drop_last else len(rows)
    for first in range(0, stop, batch_size):
        yield read(rows[first : first + batch_size])
