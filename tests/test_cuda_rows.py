"""Device copies (``shmbuffer/storage/cuda_rows.py``): gathers and the staged writer.

Each test runs on CPU tensors (the logic: indices, bounds, casts, staging slots, progress)
and, marked ``gpu``, on a CUDA device (streams, pinned staging, host -> device and device ->
device copies), compared with :mod:`shmbuffer.storage.rows` on host columns as the reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shmbuffer.storage import cuda_rows, rows
from shmbuffer.storage.schema import Schema

CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")],
    ),
]
SCHEMA = Schema.from_spec(
    {
        "obs": {"dtype": "float32", "shape": [5]},
        "act": {"dtype": "int32", "shape": []},
        "half": {"dtype": "bfloat16", "shape": [2]},
        "done": {"dtype": "bool", "shape": []},
    }
)
CAPACITY = 64


def host_columns() -> dict[tuple[str, ...], torch.Tensor]:
    return {f.key: torch.zeros((CAPACITY, *f.shape), dtype=f.dtype) for f in SCHEMA}


def on(
    device: str, columns: dict[tuple[str, ...], torch.Tensor]
) -> dict[tuple[str, ...], torch.Tensor]:
    return {k: c.to(device) for k, c in columns.items()}


def leaves(n: int, seed: int = 0) -> dict[tuple[str, ...], object]:
    """A validated batch as writers hand it over: numpy in other dtypes, tensors."""
    rng = np.random.default_rng(seed)
    return {
        ("obs",): rng.normal(size=(n, 5)),  # float64 into float32: a validated cast
        ("act",): torch.arange(n, dtype=torch.int64),
        ("half",): torch.randn(n, 2),
        ("done",): rng.random(n) < 0.5,
    }


def reference(ranges: list[tuple[int, int]], batch: dict, first_row: int = 0) -> dict:
    columns = host_columns()
    arrays = {k: rows._numpy_view(c) for k, c in columns.items()}
    rows.write(columns, arrays, ranges, batch, first_row)
    return columns


def same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert torch.equal(value.cpu(), b[key].cpu()), key


@pytest.mark.parametrize("device", DEVICES)
def test_writer_fills_ranges_in_order_like_rows_write(device: str) -> None:
    batch = leaves(40)
    ranges = [(50, 64), (0, 20)]  # across the ring's end
    columns = on(device, host_columns())
    progress = rows.Progress()
    cuda_rows.DeviceWriter(device).write(columns, {}, ranges, batch, 6, progress)
    assert progress.rows == 34
    same(columns, reference(ranges, batch, 6))


@pytest.mark.parametrize("device", DEVICES)
def test_writer_stages_large_writes_through_small_slots(device: str) -> None:
    batch = leaves(60, seed=1)
    columns = on(device, host_columns())
    writer = cuda_rows.DeviceWriter(device, slot_bytes=64)  # three obs rows a slot
    for first in range(0, 60, 15):  # slots wrap many times, reused after their copies
        writer.write(columns, {}, [(first, first + 15)], batch, first)
    same(columns, reference([(0, 60)], batch))
    writer = cuda_rows.DeviceWriter(device, slot_bytes=8)  # a row larger than a slot: grown
    writer.write(columns, {}, [(0, 4)], {("obs",): np.ones((4, 5))})
    assert columns[("obs",)][:4].cpu().eq(1).all()


@pytest.mark.parametrize("device", DEVICES)
def test_writer_copies_rows_already_on_the_device(device: str) -> None:
    batch = {k: torch.as_tensor(v).to(device) for k, v in leaves(10, seed=2).items()}
    batch[("obs",)] = batch[("obs",)].float()
    columns = on(device, host_columns())
    cuda_rows.DeviceWriter(device).write(columns, {}, [(3, 13)], batch)
    expected = reference([(3, 13)], {k: v.cpu() for k, v in batch.items()})
    same(columns, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_gather_matches_the_host_gather(device: str) -> None:
    host = reference([(0, CAPACITY)], leaves(CAPACITY, seed=3))
    columns = on(device, host)
    picked = np.array([5, 0, 63, 5, 17])
    got = cuda_rows.gather_columns(columns, picked)
    assert all(t.device.type == torch.device(device).type for t in got.values())
    same(got, rows.gather_columns(host, picked))
    assert all(len(t) == 0 for t in cuda_rows.gather_columns(columns, np.array([])).values())


@pytest.mark.parametrize("device", DEVICES)
def test_gather_into_host_arrays(device: str) -> None:
    host = reference([(0, CAPACITY)], leaves(CAPACITY, seed=4))
    columns = on(device, host)
    out = {f.key: torch.full((8, *f.shape), 7, dtype=f.dtype) for f in SCHEMA}
    arrays, flat, held = rows.out_arrays(SCHEMA, {k[0]: v for k, v in out.items()})
    got = cuda_rows.gather_columns(columns, np.array([1, 2, 3]), out=arrays)
    assert held == 8
    for key, tensor in got.items():
        assert tensor.data_ptr() == flat[key].data_ptr()  # the caller's memory
    same(got, rows.gather_columns(host, np.array([1, 2, 3])))


@pytest.mark.parametrize("device", DEVICES)
def test_gather_refuses_rows_out_of_range_before_running(device: str) -> None:
    columns = on(device, host_columns())
    for bad, named in (([0, CAPACITY], CAPACITY), ([-1, 2], -1)):
        with pytest.raises(IndexError, match=f"row {named} is out of range"):
            cuda_rows.gather_columns(columns, np.array(bad))
    if device == "cuda":  # a device-side assert would have poisoned the context
        assert torch.zeros(1, device="cuda").item() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_failed_write_leaves_later_ranges_untouched(device: str) -> None:
    columns = on(device, host_columns())
    batch = leaves(10, seed=5)
    batch[("act",)] = torch.arange(4)  # shorter than the write: the second range fails
    progress = rows.Progress()
    with pytest.raises((RuntimeError, ValueError)):
        cuda_rows.DeviceWriter(device).write(columns, {}, [(0, 4), (20, 26)], batch, 0, progress)
    assert progress.rows == 10  # the second range may have been touched, the rest not
    assert columns[("obs",)][26:].cpu().eq(0).all()
    assert columns[("act",)][:4].cpu().tolist() == [0, 1, 2, 3]
