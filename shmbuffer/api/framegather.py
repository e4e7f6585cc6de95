"""Frame stacks built at gather time, from one frame stored per row (``api/frames.py``).

A drawn row ``t`` of a stack column of ``K`` frames reads rows ``t - j`` for ``j = K-1..0``;
frames before its episode's start (``j > before``, the rows of its registry entry before it,
``Container.extent``) are padded: the earliest frame in reach repeated, or zeros. In
transition unit a chunk may hold several episodes, so a done flag (``terminated``,
``truncated``) in an earlier row within reach ends the reach there too. A next_of column
reads the same way from row ``t + 1`` (the next row in the episode, or its tail row), one
frame further. Every row read lies in ``reach`` (``[B, M]``): a reader whose rows others
write checks them all against the drawn row's stamp after the copy (one reservation, one
stamp: ``storage/stamps.py``), else the item is torn.

Vectorised: one index computation for all rows and one ``take`` of ``[B * K]`` rows per
column, no Python loop over rows. A stack column with a next_of column is one ``take`` of
``[B * (K + 1)]`` rows: the stack and the next stack are views of it (they share frames, so
they share memory: a copy made to write into one leaves the other alone).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import torch

from shmbuffer.api.frames import done_keys
from shmbuffer.errors import InvalidArgumentError
from shmbuffer.storage.schema import Key, Schema
from shmbuffer.storage.streamcopy import gather_into


def frame_reach(schema: Schema) -> int:
    """How many rows before a drawn row its stacks may read (the largest stack less one)."""
    stacks = [f.stack for f in schema.fields]
    return max(stacks) - 1 if stacks else 0


def gather_frames(
    schema: Schema,
    arrays: Mapping[Key, np.ndarray],
    rows: np.ndarray,
    before: np.ndarray,
    stop_at_done: bool,
) -> tuple[dict[Key, torch.Tensor], np.ndarray]:
    """Every column of the drawn ``rows`` (stacks as ``[B, K, *shape]``, next_of columns
    added) and the rows read for each (``[B, M]``, for the stamp check). ``before``: the rows
    of each one's registry entry before it; ``stop_at_done``: a done flag in an earlier row
    ends an episode too (transition unit)."""
    if not arrays:
        raise InvalidArgumentError(
            "frame stacks are gathered from host memory; a buffer on a GPU has none"
        )
    capacity = len(next(iter(arrays.values())))
    t = np.asarray(rows, np.int64)
    k = frame_reach(schema)
    limit = np.minimum(np.asarray(before, np.int64), k)  # rows of its entry in reach
    reach = _reach(schema, arrays, t, limit, capacity, stop_at_done)
    out: dict[Key, torch.Tensor] = {}
    shared: dict[Key, torch.Tensor] = {}  # a stack's K + 1 frames, its next stack's too
    for field in schema.fields:
        if field.stack > 1 and field.key in schema.next_of.values():
            # The stack at t and the one at t + 1 share K - 1 frames: one gather of the K + 1
            # rows, both stacks views of it (padding agrees: min(j, reach) + 1 = min(j + 1,
            # reach + 1)), a third fewer bytes gathered than two stacks.
            window = _frames(
                arrays[field.key], field.dtype, t + 1, reach + 1, field.stack + 1, field.pad
            )
            shared[field.key] = window
            out[field.key] = window[:, :-1]
        else:
            out[field.key] = _frames(
                arrays[field.key], field.dtype, t, reach, field.stack, field.pad
            )
    for key, of in schema.next_of.items():
        field = schema[of]
        if of in shared:
            out[key] = shared[of][:, 1:]
        else:
            out[key] = _frames(arrays[of], field.dtype, t + 1, reach + 1, field.stack, field.pad)
    # the rows read: its entry's within reach (done flags too), itself, and the next one
    read = (t[:, None] - np.minimum(np.arange(k + 1)[None, :], limit[:, None])) % capacity
    if schema.next_of:
        read = np.concatenate([read, ((t + 1) % capacity)[:, None]], axis=1)
    return out, read


def _reach(
    schema: Schema,
    arrays: Mapping[Key, np.ndarray],
    t: np.ndarray,
    reach: np.ndarray,
    capacity: int,
    stop_at_done: bool,
) -> np.ndarray:
    """How many rows before each drawn row belong to its episode (``reach``: those of its
    entry a stack reads), cut at a done flag where ``stop_at_done``."""
    k = frame_reach(schema)
    keys = done_keys(schema) if stop_at_done and k else []
    if not keys:
        return reach
    j = np.arange(1, k + 1)
    earlier = (t[:, None] - j) % capacity  # [B, k]
    done = np.zeros(earlier.shape, bool)
    for key in keys:
        flags = arrays[key].take(earlier.ravel(), 0)
        done |= flags.reshape(len(t), k, -1).any(axis=2)
    done &= j[None, :] <= reach[:, None]  # only rows of its entry
    hit = done.any(axis=1)
    return np.where(hit, done.argmax(axis=1), reach)  # the first done row, j - 1 rows back


def _frames(
    src: np.ndarray, dtype: torch.dtype, base: np.ndarray, reach: np.ndarray, k: int, pad: str
) -> torch.Tensor:
    """Rows ``base - j`` for ``j = k-1..0`` (``[B, k, *shape]``; ``[B, *shape]`` for k 1),
    ``j`` past ``reach`` padded."""
    capacity = len(src)
    if k == 1:
        got = gather_into(src, base % capacity)
        return _tensor(got, dtype)
    j = np.arange(k - 1, -1, -1)  # oldest first
    clipped = np.minimum(j[None, :], reach[:, None])
    index = ((base[:, None] - clipped) % capacity).ravel()
    got = gather_into(src, index).reshape(len(base), k, *src.shape[1:])
    if pad == "zero":
        outside = j[None, :] > reach[:, None]
        if outside.any():
            got[outside] = 0
    return _tensor(got, dtype)


def _tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    got = torch.from_numpy(array)
    return got.view(torch.bfloat16) if dtype == torch.bfloat16 else got


def nest_frames(flat: Mapping[Key, torch.Tensor], n: int) -> Any:
    """The gathered columns as a TensorDict of ``n`` rows."""
    from shmbuffer.storage.rows import nest

    return nest(flat, [n])


class Episodes(Protocol):
    """Where rows lie in their episodes: a ring's container (``Container.extent``)."""

    @property
    def unit(self) -> str: ...

    def extent(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


def read_frames(
    schema: Schema, arrays: Mapping[Key, np.ndarray], rows: np.ndarray, episodes: Episodes
) -> Any:
    """The drawn ``rows`` copied out with their stacks, in a process where nobody else
    writes (the in-process Buffer: no stamp to check)."""
    before, _ = episodes.extent(rows)
    flat, _ = gather_frames(schema, arrays, rows, before, episodes.unit == "transition")
    return nest_frames(flat, len(rows))
