"""Write planning shared by the in-process :class:`~shmbuffer.buffer.Buffer` and the daemon's
:class:`~shmbuffer.clients.writer.Writer`: what a batch stores, decided before anything is
reserved, so both keep the same rules."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from shmbuffer.errors import CapacityError, SchemaError
from shmbuffer.schema import Schema


def plan_write(
    schema: Schema, batch: Mapping[str, Any], num_sub: int, capacity: int, mode: str
) -> tuple[dict[Any, Any], int, int, int] | None:
    """Validate ``batch`` (nothing is written if it does not fit the schema, or holds more
    rows than a fixed buffer) and decide what to store: ``(leaves, first_row, rows,
    sub_episodes)``, or None for an empty batch. Shared by :class:`Buffer` and the daemon's
    Writer so both keep the same rules; both call it before a lazy schema is fixed."""
    (num_rows,), leaves = schema.validate(batch)
    if num_rows == 0:
        warnings.warn("ignoring a write of zero rows", RuntimeWarning, stacklevel=4)
        return None
    if num_rows > capacity and mode == "fixed":  # can never fit: refused before anything
        raise CapacityError(f"{num_rows} rows do not fit a buffer of capacity {capacity}")
    first_row = 0
    if num_rows > capacity and mode == "circular":
        first_row, num_rows, num_sub = tail_that_fits(num_rows, num_sub, capacity)
        warnings.warn(
            f"{first_row + num_rows} rows exceed the capacity {capacity}; "
            f"keeping the last {num_rows}",
            RuntimeWarning,
            stacklevel=4,
        )
    return leaves, first_row, num_rows, num_sub


def tail_that_fits(num_rows: int, num_sub: int, capacity: int) -> tuple[int, int, int]:
    """(first_row, rows, sub_episodes) of the newest data that fits ``capacity``: whole
    trailing sub-episodes when one fits, else the tail of the last one."""
    length = num_rows // num_sub
    if length <= capacity:
        keep = capacity // length
        return (num_sub - keep) * length, keep * length, keep
    return num_rows - capacity, capacity, 1


def env_major(batch: Mapping[str, Any], num_envs: int) -> dict[str, Any]:
    """``[L, num_envs, ...]`` leaves → ``[num_envs * L, ...]``, sub-env 0's steps first."""

    def convert(value: Any, key: str) -> Any:
        if isinstance(value, Mapping) or hasattr(value, "batch_size"):
            return {str(k): convert(value[k], f"{key}.{k}".lstrip(".")) for k in value.keys()}
        if not key:
            raise SchemaError(
                f"a batch must be a mapping of key -> array, got a {type(value).__name__}"
            )
        try:
            tensor = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as exc:  # str, None, ragged lists
            raise SchemaError(f"key {key!r}: not an array of numbers ({exc})") from None
        if tensor.dim() < 2 or tensor.shape[1] != num_envs:
            raise SchemaError(
                f"key {key!r}: with num_envs={num_envs} every value must be "
                f"[L, {num_envs}, ...], got shape {list(tensor.shape)}"
            )
        return tensor.transpose(0, 1).reshape(-1, *tensor.shape[2:])

    return convert(batch, "")  # type: ignore[no-any-return]
