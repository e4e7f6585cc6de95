"""Copying rows in and out of a segment's columns: the only code that touches row bytes.

Writes go through numpy (``np.copyto`` reaches libc memcpy speed, torch's single-thread
``copy_`` does not), large ones through streaming stores (``streamcopy.py``: faster than
``np.copyto`` for an image episode). Gathers and range copies of large rows stream too
(``streamcopy.gather_into`` / ``copy_out``, rows of 4 KiB or more, 256 KiB in all, once a
process of such rows has loaded the loop): faster than ``np.take`` for random image rows, even
for a learner that converts the batch to float right after. Other
gathers go through numpy, chosen per column by what was fastest here (CPU time, one
thread, 256 rows drawn at random from 1M f32[64] rows or 50k u8[4,84,84] rows, with the other
columns beside them):

* a column of one value per row: fancy indexing ``a[rows]``, numpy's 1-D fast path (ahead
  of ``np.take`` and ``torch.index_select``);
* wider rows: ``np.take(a, rows, axis=0, out=np.empty(...), mode="clip")`` (ahead of
  ``torch.index_select`` and fancy indexing, alone and for the whole gather beside scalars).
  On u8[4,84,84] rows every numpy and torch way is memory bound and within noise of the others.

The figures are in ``docs/architecture.md`` (Figures behind the code's choices).

Not worth it, measured: sorting the rows first (the sort and the reorder cost more than the
locality gains), one allocation for all columns (slower than one per column), and copying runs
of consecutive rows (episodes, slices) one ``np.copyto`` per run (no faster than ``np.take``
over their rows, which streams them; slower for short runs of small rows). Results are
tensors over numpy memory (``torch.from_numpy``: such a tensor cannot ``resize_``); a caller's
``out`` (:func:`out_arrays`) takes the copy instead, in pages that are warm by the second call.
Everything works on plain ``{key: tensor}`` dicts, not TensorDicts, to keep per-call overhead
in microseconds.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from shmbuffer.errors import InvalidArgumentError
from shmbuffer.storage.indices import episode_rows as episode_rows  # noqa: PLC0414
from shmbuffer.storage.indices import slice_rows as slice_rows  # noqa: PLC0414
from shmbuffer.storage.schema import Key, Schema, key_str
from shmbuffer.storage.streamcopy import copy_into, copy_out, gather_into

if TYPE_CHECKING:
    from tensordict import TensorDict

Range = tuple[int, int]


@functools.cache
def tensordict_class() -> type[TensorDict]:
    """``tensordict.TensorDict``, imported on first use: the import costs a process seconds
    of CPU (it loads torch._dynamo); the daemon imports this module but never makes one."""
    from tensordict import TensorDict

    return cast("type[TensorDict]", TensorDict)


def as_numpy(value: Any) -> np.ndarray | None:
    """A zero-copy numpy view of ``value`` when one exists (CPU tensors, arrays), else None."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, torch.Tensor):
        # is_cpu, not device.type: the latter builds a device object for every leaf.
        if not value.is_cpu or value.dtype == torch.bfloat16 or value.requires_grad:
            return None
        return value.numpy()
    return np.asarray(value)


class Progress:
    """How far a :func:`write` got: rows ``[0, rows)`` of the reservation (in fill order) may
    have been touched, the rest were not. An aborted reservation gives back what it evicted
    from the untouched rows (:meth:`~shmbuffer.ring.container.Container.abort`).

    Used as a context manager around the copy into a reservation (the Buffer, the daemon's
    remote write and the Writer share it): a copy that fails calls ``abort(rows)`` before the
    error goes on, so reserve → copy → abort-on-error → commit is written once. A class, not
    ``contextlib.contextmanager``: this runs once per written chunk.
    """

    __slots__ = ("_abort", "rows")

    def __init__(self, abort: Callable[[int], object] | None = None) -> None:
        self.rows = 0
        self._abort = abort

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is not None and self._abort is not None:
            self._abort(self.rows)


def write(
    columns: Mapping[Key, torch.Tensor],
    arrays: Mapping[Key, np.ndarray],
    ranges: Sequence[Range],
    leaves: Mapping[Key, Any],
    first_row: int = 0,
    progress: Progress | None = None,
) -> None:
    """Copy rows ``first_row:`` of each validated leaf into the physical ``ranges`` in order.

    Casting is ``unsafe`` on purpose: :meth:`Schema.validate` already decided every cast (the
    dtype kind, and that the values fit), and numpy's own ``same_kind`` rule differs from
    torch's (it refuses int64 -> uint8 even for values that fit), which made a validated write
    fail halfway. Range by range, every key per range, so ``progress`` can tell which rows a
    failure left untouched.
    """
    # Each leaf's source and destination once, not once per range (a wrapped chunk has two).
    pairs: list[tuple[Any, Any, bool]] = []  # (destination column, source, both numpy)
    for key, value in leaves.items():
        src_np = as_numpy(value)
        # bfloat16 columns are uint16 bits to numpy: an unsafe cast would store garbage
        dst_np = arrays.get(key) if columns[key].dtype != torch.bfloat16 else None
        if src_np is not None and dst_np is not None:
            pairs.append((dst_np, src_np, True))
        else:
            tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
            pairs.append((columns[key], tensor, False))
    offset = first_row
    for start, stop in ranges:
        end = offset + stop - start
        # Every source slice first: one that cannot be read fails before a byte of the range.
        copies = [(dst[start:stop], src[offset:end], plain) for dst, src, plain in pairs]
        if progress is not None:  # from here rows of this range may change
            progress.rows = end - first_row
        for dst, src, plain in copies:
            if plain:
                copy_into(dst, src)
            else:
                dst.copy_(src)
        offset = end


def scatter(
    columns: Mapping[Key, torch.Tensor],
    arrays: Mapping[Key, np.ndarray],
    rows: np.ndarray,
    leaves: Mapping[Key, Any],
) -> None:
    """Copy row ``i`` of each validated leaf into physical row ``rows[i]`` of its column (a
    rewrite in place: rows anywhere, some columns only), each row named once. Casts are
    ``unsafe`` as in :func:`write`, for the same reason. Device columns are synchronised
    before the return: the caller's reply says the rows are written."""
    for key, value in leaves.items():
        src = as_numpy(value)
        dst = arrays.get(key) if columns[key].dtype != torch.bfloat16 else None
        if src is not None and dst is not None:
            dst[rows] = src.astype(dst.dtype, copy=False, casting="unsafe")
            continue
        column = columns[key]
        tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        index = torch.from_numpy(np.ascontiguousarray(rows)).to(column.device)
        column.index_copy_(0, index, tensor.to(column.device, column.dtype))
        if column.is_cuda:
            torch.cuda.synchronize(column.device)


def owned_slice(
    value: Any, first: int, n: int, dtype: torch.dtype | None = None
) -> np.ndarray | torch.Tensor:
    """A private copy of rows ``first:first + n`` (the caller may reuse its arrays), converted
    to the column's ``dtype`` if given (validated: the values fit), so copying it later into
    shared memory is a plain memcpy that cannot fail."""
    array = as_numpy(value)
    if array is not None and dtype != torch.bfloat16:
        part = array[first : first + n]
        if dtype is None or part.dtype == numpy_dtype(dtype):
            return part.copy()  # a third faster than astype(copy=True) on small rows
        return part.astype(numpy_dtype(dtype))
    tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    return tensor[first : first + n].detach().to("cpu", dtype, copy=True)


def split_ranges(ranges: Sequence[Range], offset: int, n: int) -> list[Range]:
    """The parts of ``ranges`` (filled in order) that hold rows ``offset:offset + n``."""
    out: list[Range] = []
    seen = 0
    for start, stop in ranges:
        lo, hi = max(offset, seen), min(offset + n, seen + stop - start)
        if lo < hi:
            out.append((start + lo - seen, start + hi - seen))
        seen += stop - start
    return out


def nest(flat: Mapping[Key, torch.Tensor], batch_size: Sequence[int]) -> TensorDict:
    nested: dict[str, Any] = {}
    for key, tensor in flat.items():
        node = nested
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = tensor
    # The columns are ours and already consistent, so skip TensorDict's per-key validation
    # (most of a call's cost, which matters at 256-row samples).
    return tensordict_class()._new_unsafe(nested, batch_size=torch.Size(batch_size))


#: What :func:`out_arrays` makes of a caller's ``out``: numpy views to copy into, the same
#: memory as flat tensors, and the rows each holds.
OutArrays = tuple[dict[Key, np.ndarray], dict[Key, torch.Tensor], int]


def _numpy_view(column: torch.Tensor) -> np.ndarray:
    """A column's memory as numpy (bfloat16 as its uint16 bits, as a segment's ``arrays``)."""
    if column.dtype == torch.bfloat16:
        return column.view(torch.uint16).numpy()
    return column.numpy()


_LARGEST = np.maximum.reduce  # the ufunc's own method: ndarray.max() adds a microsecond


def _out_of_range(index: np.ndarray, capacity: int) -> IndexError:
    bad = index[(index < 0) | (index >= capacity)]
    return IndexError(f"row {int(bad[0])} is out of range for {capacity} rows")


def gather_columns(
    columns: Mapping[Key, torch.Tensor],
    rows: np.ndarray,
    arrays: Mapping[Key, np.ndarray] | None = None,
    *,
    out: Mapping[Key, np.ndarray] | None = None,
) -> dict[Key, torch.Tensor]:
    """Copy the given physical rows (any order, duplicates allowed) out of every column.

    ``arrays``: the columns' numpy views (a segment's ``arrays``; made here if not given).
    Columns on a GPU (a CUDA segment's, whose ``arrays`` is empty) are gathered there by
    :func:`shmbuffer.storage.cuda_rows.gather_columns`, into device tensors or ``out``.
    ``out``: numpy views to copy into, each with at least ``len(rows)`` rows of the column's
    row shape and dtype (checked by :func:`out_arrays`); the result is then views of them.
    A row out of range raises IndexError before anything is copied.

    Written for per-call overhead (this runs once per ``sample``): at 256 small rows a
    microsecond of Python is a visible share of the call.
    """
    if arrays:
        sources = arrays
    elif columns and next(iter(columns.values())).device.type != "cpu":
        from shmbuffer.storage import (
            cuda_rows,  # a CudaSegment's columns (no numpy views): gathered
        )

        return cuda_rows.gather_columns(columns, rows, out=out)  # on their device
    else:
        sources = {k: _numpy_view(c) for k, c in columns.items()}
    index: np.ndarray = np.ascontiguousarray(rows, dtype=np.int64)
    n = len(index)
    if n and sources:
        # np.take(mode="clip") would clamp a bad row silently: check them all first, in one
        # reduction (a negative row is huge as unsigned)
        capacity = len(next(iter(sources.values())))
        if int(_LARGEST(index.view(np.uint64))) >= capacity:
            raise _out_of_range(index, capacity)
    result = {}
    for key, column in columns.items():
        src = sources[key]
        if out is None and src.ndim == 1:
            got = torch.from_numpy(src[index])  # numpy's 1-D fast path
        else:
            # the method, not np.take: its Python wrapper costs a call per column; large rows
            # stream (streamcopy.gather_into)
            dst = None if out is None else out[key][:n]
            got = torch.from_numpy(gather_into(src, index, dst))  # in range: checked above
        result[key] = got.view(torch.bfloat16) if column.dtype == torch.bfloat16 else got
    return result


def gather(
    columns: Mapping[Key, torch.Tensor],
    rows: np.ndarray,
    arrays: Mapping[Key, np.ndarray] | None = None,
) -> TensorDict:
    """Copy the given physical rows into a new TensorDict (see :func:`gather_columns`)."""
    return nest(gather_columns(columns, rows, arrays), [len(rows)])


def out_arrays(schema: Schema, out: Any, what: str = "out") -> OutArrays:
    """A caller's preallocated ``out`` (a TensorDict, or a possibly nested dict of tensors) as
    flat numpy views to copy into, the matching flat tensors, and how many rows they hold.

    Every column needs a CPU tensor of its dtype, contiguous, shaped ``[*lead, *row_shape]``
    (any leading dims: ``[n, L]`` or ``[rows]``); keys the schema lacks are left alone. A
    tensor that does not fit raises InvalidArgumentError naming the key, its dtype and shape.
    """
    if not isinstance(out, tensordict_class() | Mapping):
        raise InvalidArgumentError(
            f"{what} must be a TensorDict or a dict of tensors, got {type(out).__name__}"
        )
    arrays: dict[Key, np.ndarray] = {}
    flat: dict[Key, torch.Tensor] = {}
    held: int | None = None
    for field in schema:
        key, name, row_shape = field.key, key_str(field.key), field.shape
        if field.compress is not None:  # its rows are chunk references, not values
            raise InvalidArgumentError(
                f"{what}: column {name!r} is stored compressed; its rows are decompressed "
                f"into new tensors, never into {what} (nor read as views): leave {what} out"
            )
        tensor = _leaf(out, key)
        if not isinstance(tensor, torch.Tensor):
            got = "nothing" if tensor is None else type(tensor).__name__
            raise InvalidArgumentError(f"{what} has no tensor for key {name!r} (got {got})")
        lead = tensor.shape[: tensor.dim() - len(row_shape)]
        problem = None
        if tensor.dtype != field.dtype:
            problem = f"dtype {tensor.dtype}, the column's is {field.dtype}"
        elif tensor.dim() < len(row_shape) + 1 or tuple(tensor.shape[len(lead) :]) != row_shape:
            problem = f"shape {list(tensor.shape)}, not [*batch, {', '.join(map(str, row_shape))}]"
        elif tensor.device.type != "cpu":
            problem = f"device {tensor.device}: out must be on the CPU"
        elif tensor.requires_grad:
            problem = "requires_grad set: copies cannot go into a tensor autograd tracks"
        elif not tensor.is_contiguous():
            problem = f"shape {list(tensor.shape)} but not contiguous"
        if problem is not None:
            raise InvalidArgumentError(f"{what}[{name!r}] does not fit: {problem}")
        rows = math.prod(lead)  # np.prod converts a torch.Size to an array first
        if held is not None and rows != held:
            raise InvalidArgumentError(
                f"{what}[{name!r}] holds {rows} rows, other keys {held}: give every key the "
                "same leading shape"
            )
        held = rows
        view = tensor.reshape(rows, *row_shape)  # contiguous: a view, never a copy
        flat[key] = view
        raw = view.view(torch.uint16) if view.dtype == torch.bfloat16 else view
        arrays[key] = raw.numpy()
    return arrays, flat, held or 0


def check_out_rows(held: int, lengths: np.ndarray, what: str = "out") -> None:
    """Refuse episodes of ``lengths`` that an ``out`` of ``held`` rows cannot take (the draw
    is made by then: the message says so)."""
    total = int(lengths.sum())
    if total > held:
        raise InvalidArgumentError(
            f"{what} holds {held} rows per key, but the {len(lengths)} episodes drawn hold "
            f"{total} (the longest {int(lengths.max())}; they count as sampled): give {what} "
            "n x the longest episode's rows"
        )


def _leaf(out: Any, key: Key) -> Any:
    node = out
    for part in key:
        if isinstance(node, tensordict_class()):
            node = node.get(part, None)
        elif isinstance(node, Mapping):
            node = node.get(part)
        else:
            return None
    return node


def copy_columns(
    columns: Mapping[Key, torch.Tensor],
    start: int,
    stop: int,
    arrays: Mapping[Key, np.ndarray] | None = None,
) -> dict[Key, torch.Tensor]:
    """Copy one contiguous range of rows (memcpy speed, no index tensor). Through numpy when
    ``arrays`` are given (``ndarray.copy`` beat ``Tensor.clone``); a large range streams
    (``streamcopy.copy_out``, faster than ``copy`` for image rows)."""
    if arrays is None:
        return {k: c[start:stop].clone() for k, c in columns.items()}
    flat = {}
    for key, column in columns.items():
        got = torch.from_numpy(copy_out(arrays[key][start:stop]))  # large: streamed
        flat[key] = got.view(torch.bfloat16) if column.dtype == torch.bfloat16 else got
    return flat


def copy_range(
    columns: Mapping[Key, torch.Tensor],
    start: int,
    stop: int,
    arrays: Mapping[Key, np.ndarray] | None = None,
) -> TensorDict:
    """:func:`copy_columns` as a TensorDict."""
    return nest(copy_columns(columns, start, stop, arrays), [stop - start])


def view(columns: Mapping[Key, torch.Tensor], start: int, stop: int) -> TensorDict:
    """A zero-copy TensorDict view of rows ``start:stop`` (the caller guards against reuse)."""
    return nest({k: c[start:stop] for k, c in columns.items()}, [stop - start])


def read_columns(
    columns: Mapping[Key, torch.Tensor],
    rows: np.ndarray,
    arrays: Mapping[Key, np.ndarray] | None = None,
) -> dict[Key, torch.Tensor]:
    """Copy rows out, using a plain range copy when they are contiguous and ascending."""
    # n strictly increasing rows whose ends are n - 1 apart are consecutive (one comparison,
    # no temporary of differences as np.all(np.diff(rows) == 1) makes)
    if len(rows) and rows[-1] - rows[0] == len(rows) - 1 and (rows[1:] > rows[:-1]).all():
        return copy_columns(columns, int(rows[0]), int(rows[-1]) + 1, arrays)
    return gather_columns(columns, rows, arrays)


def read(
    columns: Mapping[Key, torch.Tensor],
    rows: np.ndarray,
    arrays: Mapping[Key, np.ndarray] | None = None,
) -> TensorDict:
    """:func:`read_columns` as a TensorDict."""
    return nest(read_columns(columns, rows, arrays), [len(rows)])


def episodes(
    flat: Mapping[Key, torch.Tensor], lengths: np.ndarray
) -> TensorDict | list[TensorDict]:
    """Copied episodes (their rows one after another in ``flat``) as ``[n, L]`` if their
    lengths agree, else a list of ``[L_i]``. Each tensor is viewed as ``[n, L, ...]`` before
    the TensorDict is made: ``TensorDict.reshape`` costs far more a call."""
    if len(lengths) == 0:
        return []
    if np.all(lengths == lengths[0]):
        n, length = len(lengths), int(lengths[0])
        shaped = {k: t.view(n, length, *t.shape[1:]) for k, t in flat.items()}
        return nest(shaped, [n, length])
    return list(nest(flat, [int(lengths.sum())]).split(lengths.tolist()))


def read_episodes(
    columns: Mapping[Key, torch.Tensor],
    rows: np.ndarray,
    arrays: Mapping[Key, np.ndarray] | None,
    lengths: np.ndarray,
    scalar: bool = False,
) -> TensorDict | list[TensorDict]:
    """Episodes of ``lengths`` whose ``rows`` follow one another, copied out (:func:`episodes`;
    ``scalar``: one episode, as one TensorDict)."""
    flat = read_columns(columns, rows, arrays)
    return nest(flat, [len(rows)]) if scalar else episodes(flat, lengths)


def episodes_into(
    columns: Mapping[Key, torch.Tensor],
    rows: np.ndarray,
    arrays: Mapping[Key, np.ndarray] | None,
    lengths: np.ndarray,
    target: OutArrays,
) -> TensorDict | list[TensorDict]:
    """:func:`read_episodes` into a caller's ``out`` (:func:`out_arrays`), as views of it;
    InvalidArgumentError if it holds too few rows (:func:`check_out_rows`)."""
    out, flat, held = target
    check_out_rows(held, lengths)
    gather_columns(columns, rows, arrays, out=out)
    return episodes({key: tensor[: len(rows)] for key, tensor in flat.items()}, lengths)


_NUMPY_DTYPES: dict[torch.dtype, np.dtype[Any]] = {}


def numpy_dtype(dtype: torch.dtype) -> np.dtype[Any]:
    # Cached: making a tensor to ask cost a fifth of a small-row writer's time.
    found = _NUMPY_DTYPES.get(dtype)
    if found is None:
        found = _NUMPY_DTYPES[dtype] = torch.empty(0, dtype=dtype).numpy().dtype
    return found


def from_bytes(
    frame: np.ndarray, dtype: torch.dtype, shape: Sequence[int], *, copy: bool = False
) -> np.ndarray | torch.Tensor:
    """Raw payload bytes (a uint8 array) viewed as rows of ``dtype`` and ``shape``: a numpy
    view when ``copy`` is False (a copy source), else an owned torch tensor."""
    if dtype == torch.bfloat16:  # no numpy dtype: go through int16
        return torch.from_numpy(frame.copy()).view(torch.bfloat16).reshape(tuple(shape))
    array: np.ndarray = frame.view(numpy_dtype(dtype)).reshape(tuple(shape))
    return torch.from_numpy(array.copy()) if copy else array


def to_bytes(value: Any, dtype: torch.dtype) -> memoryview:
    """A leaf as contiguous bytes of the column's dtype (remote writers send these)."""
    tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    tensor = tensor.detach().to("cpu", dtype).contiguous()
    if dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return memoryview(tensor.numpy()).cast("B")  # type: ignore[arg-type]
