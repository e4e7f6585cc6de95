"""The ingestion rules shared by the in-process :class:`~shmbuffer.buffer.Buffer` and the
daemon's :class:`~shmbuffer.clients.writer.Writer`: what a batch stores and with which
priorities, decided before anything is reserved, so both keep the same rules.

Only the store differs: a Buffer copies a plan into its own rows at once, a Writer reserves
rows over the wire and copies in its pipeline. Everything before that is here: a batch checked
against the schema (a lazy schema taken from it), the newest part of a batch too large for a
ring, a vector env's episode turned env-major, and a write's priority shaped per row or per
episode to what is kept, refused whole (InvalidArgumentError naming it) before anything is
evicted.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from shmbuffer.api.frames import frame_write
from shmbuffer.errors import CapacityError, InvalidArgumentError, SchemaError
from shmbuffer.samplers.base import Sampler, check_priority
from shmbuffer.samplers.declare import declared
from shmbuffer.storage.schema import Schema, to_host

#: A write's priorities as checked here: none (the sampler's default for new data), one number
#: for every item, or one float64 value per item kept (row, or sub-episode in episode unit).
Items = float | np.ndarray | None


class WritePlan(NamedTuple):
    """What a batch stores: rows ``[first_row, first_row + num_rows)`` of its ``leaves`` as
    ``episodes`` equal (sub-)episodes, out of the ``given`` ones it holds."""

    schema: Schema
    leaves: dict[Any, Any]
    first_row: int
    num_rows: int
    #: A count of equal (sub-)episodes, or their lengths (a write laid out by
    #: ``api/frames.py``: its segments, each with its tail row).
    episodes: int | list[int]
    given: int

    @property
    def kept(self) -> int:
        """How many (sub-)episodes it stores."""
        return len(self.episodes) if isinstance(self.episodes, list) else self.episodes

    @property
    def lengths(self) -> list[int]:
        """The length of each (sub-)episode stored."""
        if isinstance(self.episodes, list):
            return self.episodes
        return [self.num_rows // self.episodes] * self.episodes


_new_tuple = tuple.__new__


def plan_write(
    schema: Schema | None,
    batch: Mapping[str, Any],
    num_sub: int,
    capacity: int,
    mode: str,
    unit: str = "transition",
) -> WritePlan | None:
    """Validate ``batch`` against ``schema`` (None: a lazy schema, taken from this batch;
    nothing is written if it does not fit, or holds more rows than a fixed buffer) and decide
    what to store, or None for an empty batch. Called before a lazy schema is fixed, so only a
    batch that passed every check defines it. A schema with frame stacks or next_of columns
    lays the rows out first (``api/frames.py``)."""
    if schema is None:
        schema = Schema.from_batch(batch)
    episodes: int | list[int] = num_sub
    if schema.has_frames:
        batch, episodes = frame_write(schema, batch, num_sub, unit)
    (num_rows,), leaves = schema.validate(batch)
    if num_rows == 0:
        warnings.warn("ignoring a write of zero rows", RuntimeWarning, stacklevel=4)
        return None
    if isinstance(episodes, list):  # tail rows laid in: kept whole or refused
        if num_rows > capacity:
            raise CapacityError(
                f"{num_rows} rows (with one tail row per episode) do not fit a buffer of "
                f"capacity {capacity}; write fewer steps at a time"
            )
        return _new_tuple(WritePlan, (schema, leaves, 0, num_rows, episodes, num_sub))
    if num_rows > capacity and mode == "fixed":  # can never fit: refused before anything
        raise CapacityError(f"{num_rows} rows do not fit a buffer of capacity {capacity}")
    first_row, kept = 0, num_sub
    if num_rows > capacity and mode == "circular":
        first_row, num_rows, kept = tail_that_fits(num_rows, num_sub, capacity)
        warnings.warn(
            f"{first_row + num_rows} rows exceed the capacity {capacity}; "
            f"keeping the last {num_rows}",
            RuntimeWarning,
            stacklevel=4,
        )
    # tuple.__new__, not WritePlan(...): its generated constructor is a Python-level call,
    # on the path of every write however small
    return _new_tuple(WritePlan, (schema, leaves, first_row, num_rows, kept, num_sub))


def tail_that_fits(num_rows: int, num_sub: int, capacity: int) -> tuple[int, int, int]:
    """(first_row, rows, sub_episodes) of the newest data that fits ``capacity``: whole
    trailing sub-episodes when one fits, else the tail of the last one."""
    length = num_rows // num_sub
    if length <= capacity:
        keep = capacity // length
        return (num_sub - keep) * length, keep * length, keep
    return num_rows - capacity, capacity, 1


def write_priority(
    priority: Any,
    plan: WritePlan,
    unit: str,
    *,
    sampler: str,
    keeps: bool,
    most: float = math.inf,
) -> Items:
    """``priority`` as given to a write, checked against the whole batch and cut to what
    ``plan`` keeps of it (its newest rows, or sub-episodes in episode unit): a scalar is one
    number for every item. InvalidArgumentError, before anything is reserved, for a priority
    given to a ``sampler`` that ``keeps`` none, a value negative, NaN, infinite or over
    ``most`` (the sampler's :attr:`~shmbuffer.samplers.Sampler.priority_limit`, where it is
    known), or a count that is not one per row (transition unit) or per sub-episode (episode
    unit)."""
    if priority is None:
        return None
    if not keeps:
        keeping = ", ".join(name for name, kind in declared().items() if kind.has_priorities)
        raise InvalidArgumentError(
            f"priority given, but the sampler {sampler!r} keeps no priorities (these do: {keeping})"
        )
    value = to_host(priority)
    try:
        if np.ndim(value) == 0:
            return float(check_priority(value, 1, most=most)[0])
        if unit == "episode":
            return check_priority(value, plan.given, most=most)[plan.given - plan.kept :]
        if isinstance(plan.episodes, list) and plan.schema.tail:
            raise InvalidArgumentError(
                "a write with a next_of column takes one priority for all its rows (or none), "
                "not one per row: its tail rows hold no step"
            )
        total = plan.first_row + plan.num_rows
        return check_priority(value, total, most=most)[plan.first_row :]
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(str(exc)) from None


def priority_for(priority: Any, plan: WritePlan, unit: str, sampler: Sampler) -> Items:
    """:func:`write_priority` checked as ``sampler`` (the table's the write's priority goes
    to) keeps them."""
    if priority is None:
        return None
    return write_priority(
        priority,
        plan,
        unit,
        sampler=sampler.name,
        keeps=sampler.has_priorities,
        most=sampler.priority_limit,
    )


def vector_episode(
    episode: Mapping[str, Any], num_envs: int, unit: str, priority: Any
) -> tuple[dict[str, Any], Any]:
    """``add_episode(episode, num_envs)``'s batch for ``num_envs > 1``: ``[L, num_envs, ...]``
    leaves as env-major rows (each sub-env its own episode), and in transition unit a per-row
    priority shaped ``[L, num_envs]`` like the data put in the same order as the rows."""
    if priority is not None and unit == "transition":
        value = to_host(priority)
        if np.ndim(value) == 2:
            priority = np.asarray(value).T.reshape(-1)
    return env_major(episode, num_envs), priority


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
