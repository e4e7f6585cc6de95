"""Statistics helpers shared by the sampler tests (fixed seeds, chi-square at p > P_MIN)."""

from __future__ import annotations

import numpy as np
import torch

#: A statistical test fails below this p-value: with fixed seeds a pass stays a pass, and a
#: wrong distribution at these sample sizes lands far below it.
P_MIN = 1e-3


def chi2_p(observed: np.ndarray, expected: np.ndarray) -> float:
    """p-value of Pearson's chi-square (torch's regularised upper gamma is chi2's survival)."""
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = observed.size - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))
