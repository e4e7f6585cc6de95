"""The arguments of a read, checked in one place for every API that reads: the in-process
:class:`~shmbuffer.buffer.Buffer` (through its container, which the daemon runs too), the
daemon's :class:`~shmbuffer.clients.reader.Reader` and the cluster's ``ClusterReader``.

Counts (``batch_size``, ``n``, a slice's ``length``) are Python ints of at least 1 (a numpy
integer is taken: msgpack cannot send one, so it is converted here) within the protocol's
sampling limits (:func:`~shmbuffer.wire.protocol.check_sample_size`, every API's bound, refused
before anything is drawn or sent); ``strict`` is a bool; ``beta`` is finite and >= 0; a padded
slice's ``"mask"`` entry must not shadow a schema key; ``update_priorities`` takes one integer
row and one priority per item (and a stamp each, if given). A bad argument raises
InvalidArgumentError (TypeError for a wrong type) naming it; LimitExceededError names the
argument over a limit. Also here: the rows of a sample of slices and the mask of padded ones
(:func:`expand_slices`, :func:`mask_slices`), and a Buffer's logical index
(:func:`normalize_index`).

Each check is a plain function call with an early-out for the usual case: they run on every
sample.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn, TypeAlias

import numpy as np
import numpy.typing as npt

from shmbuffer.errors import InvalidArgumentError, ShmBufferError
from shmbuffer.samplers.base import check_beta, check_generation, check_update
from shmbuffer.storage.indices import slice_rows, to_host
from shmbuffer.wire.protocol import MAX_SAMPLE, check_sample_size


class _Arguments:
    """Turns a sampler's plain ValueError/IndexError into InvalidArgumentError (a class with
    ``__enter__``/``__exit__``: cheaper than ``contextlib.contextmanager`` on the hot path)."""

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # TypeError stays what it is: a wrong type is the caller's bug, not a bad value.
        if isinstance(exc, ValueError | IndexError) and not isinstance(exc, ShmBufferError):
            raise InvalidArgumentError(str(exc)) from exc


#: ``with as_invalid_argument:`` around argument checks (the Buffer uses it too).
as_invalid_argument = _Arguments()


def raise_invalid(exc: ValueError | IndexError) -> NoReturn:
    """Raise ``exc`` as InvalidArgumentError (as it is if it is a ShmBufferError already)."""
    if isinstance(exc, ShmBufferError):
        raise exc
    raise InvalidArgumentError(str(exc)) from exc


if TYPE_CHECKING:
    # The daemon imports this module, never tensordict (seconds of CPU); a Reader imports it
    # before it imports torch, which the first call that touches rows does.
    import torch
    from tensordict import TensorDict

    from shmbuffer.storage.schema import Schema

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]
Mask = npt.NDArray[np.bool_]
#: What logical indexing takes (``Buffer[index]``).
Index: TypeAlias = "int | np.integer[Any] | slice | Sequence[int] | np.ndarray | torch.Tensor"


def check_where(text: Any, name: str = "where") -> str:
    """A metadata filter (or order key) as a daemon takes it: a str, which the daemon parses
    (InvalidArgumentError naming ``name`` for anything else)."""
    if not isinstance(text, str):
        raise InvalidArgumentError(f"{name} must be a str, got {text!r}")
    return text


def as_integer(value: Any, name: str) -> int:
    """``value`` (an int, a numpy integer, a 0-d integer tensor; never a bool) as a Python
    int, else TypeError naming it."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None


def as_count(value: Any, name: str, lo: int = 1) -> int:
    """``value`` as a Python int of at least ``lo`` (msgpack cannot send ``np.int64``)."""
    number = as_integer(value, name)
    if number < lo:
        raise InvalidArgumentError(f"{name} must be >= {lo}, got {number}")
    return number


def as_beta(value: Any) -> float:
    """An importance exponent as a float, finite and >= 0."""
    try:
        beta = float(value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"importance exponent beta must be a number, got {value!r}"
        ) from None
    try:
        return check_beta(beta)
    except ValueError as exc:
        raise InvalidArgumentError(str(exc)) from None


def check_sample_args(n: Any, beta: Any = None, what: str = "batch_size") -> int:
    """The item count of ``sample`` (called ``what``) within the protocol's limits, and
    ``beta`` (None: the sampler's own)."""
    count: int = n
    if type(n) is not int or not 0 < n <= MAX_SAMPLE:  # the usual case skips these
        count = as_count(n, what)
        check_sample_size(count, what=what)
    if beta is not None:
        as_beta(beta)
    return count


def check_slice_args(n: Any, length: Any, strict: Any, beta: Any = None) -> tuple[int, int]:
    """``sample_slices``' ``n`` and ``length`` (``n * length`` rows within the protocol's
    limits), ``strict`` a bool, and ``beta``."""
    if type(strict) is not bool:
        raise TypeError(f"strict must be True or False, got {strict!r}")
    count, rows = as_count(n, "n"), as_count(length, "length")
    check_sample_size(count, rows)
    if beta is not None:
        as_beta(beta)
    return count, rows


def check_episode_args(n: Any, mean_length: int = 1, beta: Any = None) -> int:
    """``sample_episodes``' ``n``, within the protocol's limits for episodes of
    ``mean_length`` rows (the lengths are known only after the draw; a client, which does
    not know them, checks the item count alone), and ``beta``."""
    count = as_count(n, "n")
    check_sample_size(count, mean_length)
    if beta is not None:
        as_beta(beta)
    return count


def check_mask_free(schema: Schema | None, strict: bool) -> None:
    """A padded sample of slices (``strict=False``) adds a ``"mask"`` entry: refused when the
    schema has that key already, before anything is drawn."""
    if not strict and schema is not None and any(f.key[0] == "mask" for f in schema):
        raise InvalidArgumentError(
            "sample_slices(strict=False) adds a 'mask' entry, but the schema has a key "
            "'mask' already"
        )


def check_iterate_args(batch_size: Any, rank: Any, world_size: Any) -> tuple[int, int, int]:
    """``iterate``'s ``batch_size``, and ``rank`` in ``[0, world_size)``."""
    size = as_count(batch_size, "batch_size")
    return (size, *check_rank(rank, world_size))


def check_rank(rank: Any, world_size: Any) -> tuple[int, int]:
    """``rank`` in ``[0, world_size)``, ``world_size`` at least 1."""
    size = as_count(world_size, "world_size")
    mine = as_integer(rank, "rank")
    if not 0 <= mine < size:
        raise InvalidArgumentError(f"rank must be in [0, {size}), got {mine}")
    return mine, size


def expand_slices(starts: I64, length: int, lengths: I64 | None = None) -> tuple[I64, Mask | None]:
    """The physical rows of slices of ``length`` rows from ``starts``, flat, and for padded
    slices (``lengths``: each one's real rows, a prefix) the mask of real rows ``[n, length]``.
    Past a padded slice's real rows its first row stands in: always a live row, whose stamp
    the daemon sends there and whose bytes the padding is later zeroed over."""
    if lengths is None:
        return slice_rows(starts, length), None
    mask = slice_mask(lengths, length)
    first = starts[:, None]
    return np.where(mask, first + np.arange(length, dtype=np.int64), first).reshape(-1), mask


def slice_mask(lengths: I64, length: int) -> Mask:
    """``[n, length]``, True on each padded slice's real rows (the first ``lengths[i]``)."""
    return np.arange(length, dtype=np.int64) < lengths[:, None]


def mask_slices(data: TensorDict, mask: Mask, device: str | torch.device | None = None) -> None:
    """Zero the padding of a ``[n, length]`` sample of slices (a padding row is a copy of its
    slice's first row) and add the ``"mask"`` entry (on ``device``, beside the rows)."""
    import torch  # loaded already: ``data`` holds tensors

    held = torch.from_numpy(mask)
    if device is not None:
        held = held.to(device)
    padding = ~held
    if bool(padding.any()):
        for leaf in data.values(include_nested=True, leaves_only=True):
            leaf[padding] = 0
    data.set("mask", held)


def check_update_args(
    index: Any, priority: Any, generation: Any, capacity: int, most: float = math.inf
) -> tuple[I64, F64, I64 | None]:
    """``update_priorities``' arguments (tensors on any device, arrays, sequences; a priority
    may be one number for all) as int64 rows below ``capacity``, float64 priorities (at most
    ``most``: the sampler's limit, where it is known) and int64 stamps (None when not
    given)."""
    try:
        rows, values = check_update(to_host(index), to_host(priority), capacity, most)
        if generation is None:
            return rows, values, None
        return rows, values, check_generation(to_host(generation), rows)
    except (TypeError, ValueError, IndexError) as exc:
        raise InvalidArgumentError(f"update_priorities: {exc}") from None


def normalize_index(index: Index, size: int) -> tuple[I64, bool]:
    """Logical positions for ``index`` in ``[0, size)`` and whether it named one item;
    negative ones count from the end. IndexError for anything out of range (unwritten rows
    are never read) or not an integer."""
    if isinstance(index, int | np.integer):
        i = int(index)
        if not -size <= i < size:
            raise IndexError(f"index {i} is out of range for {size} stored items")
        return np.array([i % size], dtype=np.int64), True
    if isinstance(index, slice):
        return np.arange(*index.indices(size), dtype=np.int64), False
    positions = np.asarray(to_host(index))
    if positions.dtype.kind not in "iu" and positions.size:  # bool masks, floats
        raise IndexError(f"indices must be integers, got dtype {positions.dtype}")
    positions = positions.astype(np.int64, copy=False).reshape(-1)  # read, never written
    if not positions.size:
        return positions, False
    # Two reductions decide the usual case, all in [0, size): nothing to check or wrap
    # (the four comparisons and the modulo of a mask-and-wrap cost more than these two).
    lowest, highest = int(np.minimum.reduce(positions)), int(np.maximum.reduce(positions))
    if lowest >= 0 and highest < size:
        return positions, False
    if lowest < -size or highest >= size:
        bad = (positions < -size) | (positions >= size)
        raise IndexError(
            f"indices {positions[bad][:5].tolist()} are out of range for {size} stored items"
        )
    return positions % size, False
