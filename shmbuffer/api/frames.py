"""Frames stored once: what a write of a schema with frame stacks or next_of columns stores.

A stack column (``obs = {dtype = "uint8", shape = [84, 84], stack = 4}``) stores one frame per
row and is read as ``[4, 84, 84]`` (``api/framegather.py``); a next_of column
(``"next.obs" = {next_of = "obs"}``) stores nothing of its own but each episode's last next
observation, in one extra row after the episode: the *tail row*. So the next frame of any row
``t`` is the frame at row ``t + 1`` (in the episode, or its tail row), and a read reaching it
checks one stamp more: the tail row is reserved with its episode, so it carries its stamp.

Here, before anything is reserved, a batch is turned into the rows it stores:

- its *segments*, the runs of rows a stack never reaches across: each (sub-)episode of the
  write, and in transition unit also the rows after a step whose ``terminated`` or
  ``truncated`` flag is set (a chunk written by ``extend`` may hold several episodes);
- a stack written whole (``[T, K, *shape]``, what Gymnasium's ``FrameStackObservation``
  gives) is checked against the frames before it in its segment, and the padding at the
  segment's first step, then only its newest frame is kept; a next_of value (``[T, *shape]``
  or ``[T, K, *shape]``) is checked against the next step's frame; a disagreement is a
  SchemaError naming the key and the row, and nothing is stored;
- with a next_of column each segment is laid out followed by its tail row (the next_of
  value's newest frame at the segment's last step in the column it follows, zeros in every
  other column), and the write's episodes are the segments, each one row longer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from shmbuffer.errors import SchemaError
from shmbuffer.storage.schema import Field, Key, Schema, iter_leaves, key_str, to_host

#: The keys whose flag ends an episode inside a transition chunk, where the schema has them.
DONE_KEYS: tuple[Key, ...] = (("terminated",), ("truncated",), ("done",))


def done_keys(schema: Schema) -> list[Key]:
    """The done flags a stack stops at (transition unit), of those the schema stores."""
    return [key for key in DONE_KEYS if key in schema]


def frame_write(
    schema: Schema, batch: Mapping[str, Any], num_sub: int, unit: str
) -> tuple[dict[str, Any], int | list[int]]:
    """The batch ``schema`` stores for ``batch`` of ``num_sub`` equal (sub-)episodes: nested
    leaves of its stored columns (newest frames, tail rows laid in), and the episodes it
    writes (a count of equal ones, or the segments' lengths with their tail rows). SchemaError
    naming the key (and row) for a value that does not fit or a stack that disagrees."""
    leaves = {key: value for key, value in iter_leaves(batch)}
    nexts: dict[Key, Any] = {}
    for key in schema.next_of:
        if key not in leaves:
            raise SchemaError(
                f"missing key {key_str(key)!r}: a next_of column's values are needed to keep "
                "each episode's last next observation"
            )
        nexts[key] = _host(key, leaves.pop(key))
    num_rows = _rows(leaves)
    starts = _segment_starts(schema, leaves, num_rows, num_sub, unit)
    first = np.maximum.accumulate(starts * np.arange(num_rows))  # each row's segment start
    newest: dict[Key, np.ndarray] = {}
    for field in schema.fields:
        if field.stack > 1 and field.key in leaves:
            newest[field.key] = leaves[field.key] = _newest(field, leaves[field.key], first)
    if not nexts:
        return _nested(leaves), num_sub
    ends = np.flatnonzero(np.r_[starts[1:], True])  # each segment's last row
    tails: dict[Key, np.ndarray] = {}
    for key, value in nexts.items():
        field = schema[schema.next_of[key]]
        frames = newest.get(field.key)
        if frames is None:
            frames = leaves[field.key] = _host(field.key, leaves[field.key])
        tails[field.key] = _checked_next(key, field, value, frames, first, ends)
    return _laid_out(schema, leaves, tails, ends), [int(n) + 1 for n in np.diff(ends, prepend=-1)]


def _rows(leaves: Mapping[Key, Any]) -> int:
    for value in leaves.values():
        shape = getattr(value, "shape", None)
        if shape is not None and len(shape):
            return int(shape[0])
    raise SchemaError("a batch needs at least one array with a batch dimension")


def _host(key: Key, value: Any) -> np.ndarray:
    try:
        return np.asarray(to_host(value))
    except (TypeError, ValueError) as exc:
        raise SchemaError(f"key {key_str(key)!r}: not an array of numbers ({exc})") from None


def _segment_starts(
    schema: Schema, leaves: Mapping[Key, Any], num_rows: int, num_sub: int, unit: str
) -> np.ndarray:
    """A bool per row: whether a segment starts there (see the module docstring)."""
    starts = np.zeros(num_rows, bool)
    if num_rows == 0:
        return starts
    starts[:: max(1, num_rows // num_sub)] = True
    if unit == "transition":
        for key in done_keys(schema):
            if key in leaves:
                flag = np.asarray(_host(key, leaves[key]).reshape(num_rows, -1).any(axis=1))
                starts[1:] |= flag[:-1]
    return starts


def _newest(field: Field, value: Any, first: np.ndarray) -> Any:
    """A stack column's value as frames: given whole stacks, checked and cut to their newest
    frame; given frames, as it is."""
    shape = tuple(getattr(value, "shape", np.shape(value)))
    if shape[1:] != (field.stack, *field.shape):
        return value  # frames (or a shape the schema's check names)
    stacks = _host(field.key, value)
    frames = stacks[:, -1]
    _check_stacks(field.key, stacks, frames, first, field.pad, 0)
    return frames


def _check_stacks(
    key: Key, stacks: np.ndarray, frames: np.ndarray, first: np.ndarray, pad: str, ahead: int
) -> None:
    """Each row ``r``'s stack ``stacks[r]`` against the frames of its segment: position
    ``j`` from the newest is the frame at row ``r + ahead - j`` where that is in the segment,
    else the padding (the segment's first frame repeated, or zeros). ``ahead`` 1: a next
    observation's stack, whose newest frame is checked apart."""
    k = stacks.shape[1]
    rows = np.arange(len(frames))
    for j in range(ahead, k):
        source = rows + ahead - j
        inside = source >= first
        want = frames[np.where(inside, source, first)]
        if pad == "zero":
            want[~inside] = 0
        bad = _differ(stacks[:, k - 1 - j], want)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise SchemaError(
                f"key {key_str(key)!r}: row {row}'s stack disagrees with the frames written "
                f"before it: its frame {k - 1 - j} (of {k}) is not "
                + (
                    f"the frame of row {row + ahead - j}"
                    if inside[row]
                    else f"the padding ({pad}) before its episode's first step, row {first[row]}"
                )
                + " (a stack restarts at each episode, and at each write's first row)"
            )


def _differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row, whether ``a`` and ``b`` differ anywhere."""
    if not len(a):
        return np.zeros(0, bool)
    return np.asarray((a != b).reshape(len(a), -1).any(axis=1))


def _checked_next(
    key: Key, field: Field, value: np.ndarray, frames: np.ndarray, first: np.ndarray, ends: Any
) -> np.ndarray:
    """A next_of value checked against the frames of the rows after each step in its
    segment; returns its newest frame at each segment's last step (the tail rows' frames)."""
    shape = tuple(value.shape)
    if shape[1:] == field.shape:
        nxt = value
    elif field.stack > 1 and shape[1:] == (field.stack, *field.shape):
        nxt = value[:, -1]
        _check_stacks(key, value, frames, first, field.pad, 1)
    else:
        want = f"[rows, {', '.join(map(str, field.shape))}]"
        if field.stack > 1:
            want += f" or [rows, {field.stack}, {', '.join(map(str, field.shape))}]"
        raise SchemaError(f"key {key_str(key)!r}: shape {list(shape)}, expected {want}")
    if len(nxt) != len(frames):
        raise SchemaError(
            f"key {key_str(key)!r}: {len(nxt)} rows, but {key_str(field.key)!r} has {len(frames)}"
        )
    inner = np.ones(len(frames), bool)
    inner[ends] = False  # a segment's last step: its next frame is the tail row's
    bad = _differ(nxt[:-1], frames[1:]) & inner[:-1]
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise SchemaError(
            f"key {key_str(key)!r}: row {row}'s next observation is not row {row + 1}'s "
            f"{key_str(field.key)!r} (next_of keeps one frame: the next row's)"
        )
    tail: np.ndarray = nxt[ends]
    return tail


def _laid_out(
    schema: Schema, leaves: dict[Key, Any], tails: dict[Key, np.ndarray], ends: np.ndarray
) -> dict[str, Any]:
    """Every stored column with a tail row after each segment's last row."""
    n, segments = _rows(leaves), len(ends)
    dest = np.arange(n) + np.searchsorted(ends, np.arange(n))  # each row moves past the tails
    tail_rows = ends + np.arange(1, segments + 1)
    out: dict[Key, Any] = {}
    for field in schema.fields:
        if field.key not in leaves:
            continue  # missing: the schema's check names it
        value = _host(field.key, leaves[field.key])
        laid = np.zeros((n + segments, *value.shape[1:]), value.dtype)
        laid[dest] = value
        if field.key in tails:
            laid[tail_rows] = tails[field.key]
        out[field.key] = laid
    for key, value in leaves.items():
        if key not in out:
            out[key] = value  # not in the schema: its check names it
    return _nested(out)


def _nested(leaves: Mapping[Key, Any]) -> dict[str, Any]:
    """``{("next", "obs"): v}`` as ``{"next": {"obs": v}}``, as a schema checks a batch."""
    out: dict[str, Any] = {}
    for key, value in leaves.items():
        node = out
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = value
    return out
