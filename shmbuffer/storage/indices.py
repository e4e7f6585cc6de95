"""Row numbers, without torch: the rows of slices and of episodes, and an index argument (a
tensor on any device, an array, a sequence) as a host array.

Kept apart from ``rows.py`` and ``schema.py`` (which re-export them) because those import
torch, and the modules a :class:`~shmbuffer.clients.reader.Reader` is made of must not: a
fresh process constructs a Reader and asks it ``stats()`` without importing torch
(``tests/test_import_cost.py``); its first call that touches rows imports it.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np


def to_host(value: Any) -> Any:
    """A tensor (on any device, maybe needing grad) as a numpy array; others as given: how
    every API takes index, priority and generation arguments. A tensor exists only in a
    process that imported torch, so one that has not is never made to."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return value


def slice_rows(starts: np.ndarray, length: int) -> np.ndarray:
    """The physical rows of slices ``[start, start + length)``, concatenated, vectorised."""
    out: np.ndarray = (starts[:, None] + np.arange(length)).reshape(-1)
    return out


def episode_rows(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The physical rows of episodes ``[start, start + length)``, concatenated, vectorised."""
    ends_before = np.cumsum(lengths) - lengths
    out: np.ndarray = np.arange(int(lengths.sum()), dtype=np.int64)
    out += np.repeat(starts - ends_before, lengths)
    return out
