"""What a table's reads and a checked priority update are: plain values.

The samples are NamedTuples, as the samplers' draws: half the cost of a frozen dataclass to
build, on the hot path of every sample. Their arrays may be read-only and shared between calls:
copy before changing them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from shmbuffer.ring.listeners import F64

__all__ = ["EpisodeSample", "PriorityUpdate", "RowSample", "SliceSample"]

I64 = npt.NDArray[np.int64]
Mask = npt.NDArray[np.bool_]


@dataclass(frozen=True, slots=True)
class PriorityUpdate:
    """A validated priority update: the rows to set (stale ones left out), their priorities,
    and how many stale rows were left out (a commit's priorities travel as one too)."""

    rows: I64
    priority: F64
    stale: int


class RowSample(NamedTuple):
    """Rows a read gets: physical ``rows``, each one's draw ``probability`` and importance
    ``weight`` (ones unless the sampler keeps priorities)."""

    rows: I64
    probability: F64
    weight: F64


class EpisodeSample(NamedTuple):
    """Whole episodes: ids, physical bounds ``[starts, ends)``, probability and weight per
    episode, and ``rows``, their physical rows concatenated."""

    ids: I64
    starts: I64
    ends: I64
    probability: F64
    weight: F64
    rows: I64


class SliceSample(NamedTuple):
    """``n`` slices of ``length`` rows: first rows, real lengths (``< length`` only when not
    strict), probability and weight per slice; ``rows`` holds ``n * length`` physical rows
    (a padding position repeats its slice's first row) and ``mask`` ``[n, length]`` is True on
    real rows (a prefix; None for strict slices, which are all real)."""

    starts: I64
    lengths: I64
    probability: F64
    weight: F64
    rows: I64
    mask: Mask | None
