"""A Reader's n-step samples (``Reader.sample(n, n_step=3, gamma=0.99)``): the return, discount
and next observation of each drawn row, computed in the reader from the rows after it in shared
memory by the one computation the in-process Buffer makes (``api/nstep.py``).

The daemon draws the rows and says where each lies in its episode (the sample's ``context``
field: ``left``, the rows of its episode from it on). The reader copies the drawn rows, then
the ``[B, n]`` window after each, and checks, after both copies, that every row the result was
computed from still carries its drawn row's stamp: one reservation gives all its rows one
stamp, so such rows were written with the drawn row and nobody has touched them since
(``storage/stamps.py``). An item with a row that moved is drawn again, with the reader's
torn-row handling (``Reader._checked_gather``), so a window overwritten mid-copy never yields a
return mixing two writes.

Refused, before anything is drawn: a remote reader (its rows come as payload frames of the
drawn rows only; the rows after them would have to cross the socket too, and the daemon knows
nothing of a learner's targets), and a buffer on a GPU (not yet: its gathers run on a side
stream that the window's copy would have to join before the stamp check), and a buffer with
frame stacks (not yet: the next observation ``m`` steps on would be a stack built there).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from shmbuffer.errors import InvalidArgumentError

if TYPE_CHECKING:
    from tensordict import TensorDict

    from shmbuffer.api.nstep import NStep
    from shmbuffer.clients.readerstate import ReaderState
    from shmbuffer.storage.segment import Segment

__all__ = ["Follow", "n_step_spec", "window_follow"]

#: Copies what a sample reads past its drawn rows into ``data`` for the items ``todo`` (all of
#: them at first, then those drawn again) and returns, per item, the rows it read that must
#: still carry the item's stamp after the copy (``[len(todo), w]``).
Follow = Callable[["TensorDict", np.ndarray], np.ndarray]


def n_step_spec(
    reader: ReaderState,
    n_step: Any,
    gamma: Any,
    keys: Mapping[str, str | Sequence[str] | None] | None,
) -> NStep:
    """The n-step arguments checked as ``Buffer.sample`` checks them (the same classes and
    words), against the buffer's schema once it has one, and whether this reader can read
    them: all before anything is drawn."""
    from shmbuffer.api.nstep import check_n_step

    spec = check_n_step(n_step, gamma, keys, None)  # no round trip for a bad number
    if reader.remote:
        raise InvalidArgumentError(
            "n_step: a remote reader (remote=True) receives only the drawn rows, not the "
            "rows after them that an n-step return reads; sample with a reader on the "
            "daemon's machine, or compute returns from sample_slices"
        )
    segment = reader._ready()
    if segment is not None and segment.device != "cpu":
        raise InvalidArgumentError(
            f"n_step: not yet for a buffer on {segment.device} (its gathers run on a side "
            "stream the window's copy does not join); sample without n_step"
        )
    if reader.schema is not None and reader.schema.has_frames:
        raise InvalidArgumentError(
            "n_step: not yet for a buffer with frame stacks (the next observation m steps on "
            "would be a stack built at that row); sample without n_step"
        )
    if reader.schema is not None:
        spec = check_n_step(n_step, gamma, keys, reader.schema)
    return spec


def window_follow(segment: Segment, physical: np.ndarray, left: np.ndarray, spec: NStep) -> Follow:
    """The n-step window of each drawn row as ``Reader._checked_gather`` follows it:
    ``physical`` and ``left`` are the sample's arrays, which a redraw patches in place."""
    import torch

    from shmbuffer.api.nstep import n_step_values

    def follow(data: TensorDict, todo: np.ndarray) -> np.ndarray:
        values, reach = n_step_values(physical[todo], segment.columns, left[todo], spec)
        fresh = "n_step_return" not in data.keys()
        at = torch.from_numpy(todo)
        for key, value in values.items():
            if fresh:  # the first call: every item
                data.set(key, value)
            else:
                data.get(key)[at] = value
        return reach

    return follow
