"""The stamps of the rows a sampler handed out lately, so that a priority update sent back
without ``generation=`` is still checked against overwrites.

A prioritized learner samples with ``return_info=True`` and sends ``info["index"]`` back with
new priorities. A writer may overwrite some of those rows in between; ``info["generation"]``
(each row's stamp when sampled) is how the buffer tells, and the update of such a row is
skipped as stale. A caller that leaves ``generation`` out has not asked for that check to go:
a :class:`~shmbuffer.clients.reader.Reader` or :class:`~shmbuffer.buffer.Buffer` remembers
its last :data:`REMEMBERED` samples' indices and stamps, and an update whose ``index`` is one
of them, element for element, carries that sample's stamps. Any other index array (a part of
a sample, rows of several, rows never sampled here) is applied to what the rows hold now.
Whole arrays are matched, not rows: a row sampled twice with two stamps (overwritten in
between) would leave a row-by-row match to guess which of its samples the update is for.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

#: Samples remembered: a learner that updates a batch's priorities a few batches late (a
#: pipeline, ``prefetch``) still has its updates checked.
REMEMBERED = 8


class RecentSamples:
    """The ``(index, generation)`` arrays of the last :data:`REMEMBERED` samples with info."""

    def __init__(self, size: int = REMEMBERED) -> None:
        self._samples: deque[tuple[np.ndarray, np.ndarray]] = deque(maxlen=size)

    def remember(self, index: np.ndarray, generation: np.ndarray) -> None:
        """Note a sample's rows and stamps as handed out (copies: the caller's tensors may
        share these arrays and be changed in place)."""
        self._samples.append(
            (np.array(index, dtype=np.int64, copy=True), np.array(generation, dtype=np.int64))
        )

    def generations_of(self, index: Any) -> np.ndarray | None:
        """The stamps of the newest remembered sample whose index array is ``index``, element
        for element; None if none is (or ``index`` is not an integer array)."""
        wanted: np.ndarray = np.asarray(index)
        if wanted.dtype.kind not in "iu":
            return None
        found = None
        for known, stamps in self._samples:  # oldest first: the last match is the newest
            if known.shape == wanted.shape and bool(np.array_equal(known, wanted)):
                found = stamps
        return found

    def info(
        self, index: np.ndarray, generation: np.ndarray, probability: np.ndarray, weight: Any
    ) -> dict[str, torch.Tensor]:
        """A Buffer's ``info`` of a sample of ``index`` rows whose stamps are ``generation``
        now, remembered for an update sent back without them."""
        import torch  # a Buffer's only: a Reader builds its own info

        self.remember(index, generation)
        return {  # copies: the container's arrays may be shared and read-only
            "index": torch.tensor(index),
            "generation": torch.from_numpy(generation),
            "probability": torch.tensor(probability),
            "weight": torch.tensor(weight, dtype=torch.float32),
        }
