"""The CUDA tier's segment (``shmbuffer/storage/cuda_segment.py``) and settings.

On a machine without CUDA these check what is refused and how (each error names the device
and what torch reports), the layout, and the carving of a buffer into columns, on a host
buffer. Tests marked ``gpu`` allocate, export and open a real device buffer across processes;
they skip cleanly without CUDA. ``tests/e2e/test_cuda.py`` runs whole daemons.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from shmbuffer.daemon.config import DaemonConfig
from shmbuffer.errors import ConfigError, OutOfSpaceError, SegmentError
from shmbuffer.storage.cuda_segment import (
    CudaSegment,
    PinnedSegment,
    attach_segment,
    boot_id,
    check_device_memory,
    check_room,
    cuda_layout,
    cuda_problem,
    device_views,
    normalize_device,
)
from shmbuffer.storage.schema import Schema
from shmbuffer.storage.segment import DATA_FILE, FORMAT_VERSION, MANIFEST, Segment, _layout

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
without_gpu = pytest.mark.skipif(CUDA, reason="checks the errors of a machine without CUDA")

SPEC = {
    "obs": {"dtype": "float32", "shape": [3]},
    "act": {"dtype": "int64", "shape": []},
    "half": {"dtype": "bfloat16", "shape": [2]},
    "done": {"dtype": "bool", "shape": []},
    "info": {"rgb": {"dtype": "uint8", "shape": [2, 2]}},
}
CAPACITY = 10


@pytest.fixture
def storage() -> Iterator[Path]:
    root = Path(f"/dev/shm/shmbuffer-test-cuda-{uuid.uuid4().hex[:10]}")
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def host_part(root: Path, name: str, **changes: Any) -> Path:
    """The host half of a CUDA segment as ``CudaSegment.create`` leaves it (manifest and a
    stamps file), with an IPC description no GPU ever exported: for the checks made before
    any handle is opened."""
    schema = Schema.from_spec(SPEC)
    layout = cuda_layout(schema, CAPACITY)
    manifest = {
        "format_version": FORMAT_VERSION,
        "name": name,
        "capacity": CAPACITY,
        "schema": schema.to_spec(),
        **layout,
        "data_file": DATA_FILE,
        "created": time.time(),
        "pid": os.getpid() + 100_000,  # a daemon, not us
        "host": socket.gethostname(),
        "extra": {},
        "device": "cuda:0",
        "device_uuid": "GPU-00000000-not-a-real-one",
        "boot_id": boot_id(),
        "ipc": {
            "handle": "00" * 64,
            "size": layout["device_size"],
            "offset": 0,
            "ref_counter": b"/torch_0_0_0".hex(),
            "ref_counter_offset": 0,
            "event": "00" * 64,
            "event_sync": False,
            "device_ptr": 0,
        },
        **changes,
    }
    folder = root / name
    folder.mkdir(parents=True, mode=0o700)
    with open(folder / DATA_FILE, "wb") as f:
        f.truncate(layout["size"])
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return folder


# -- devices and settings ------------------------------------------------------------------


def test_device_names_are_normalised_or_refused() -> None:
    assert normalize_device("cpu") == "cpu"
    assert normalize_device("cuda") == "cuda:0"
    assert normalize_device("cuda:3") == "cuda:3"
    for bad in ("tpu", "cuda:x", "", "mps:0"):
        with pytest.raises(ValueError, match="expected cpu, cuda or cuda:N"):
            normalize_device(bad)
    with pytest.raises(ValueError, match="must be a string"):
        normalize_device(0)


@without_gpu
def test_without_cuda_the_problem_names_what_torch_reports() -> None:
    problem = cuda_problem("cuda:0")
    assert problem is not None and torch.__version__ in problem


@without_gpu
def test_daemon_config_refuses_a_gpu_it_cannot_use() -> None:
    with pytest.raises(ConfigError) as info:
        DaemonConfig(name="x", device="cuda")
    message = str(info.value)
    assert "--device cuda:0" in message and torch.__version__ in message
    with pytest.raises(ConfigError) as info:
        DaemonConfig(name="x", pin_memory=True)
    assert "--pin-memory needs CUDA" in str(info.value) and torch.__version__ in str(info.value)


def test_daemon_config_checks_device_settings() -> None:
    assert DaemonConfig(name="x").device == "cpu"
    with pytest.raises(ConfigError, match="--device: device 'tpu'"):
        DaemonConfig(name="x", device="tpu")
    # decided before any GPU is looked at: the same answer with and without one
    with pytest.raises(ConfigError, match="give one or the other"):
        DaemonConfig(name="x", device="cuda:0", pin_memory=True)
    with pytest.raises(ConfigError, match="pin_memory must be true or false"):
        DaemonConfig(name="x", pin_memory="yes")  # type: ignore[arg-type]


def test_out_of_device_memory_names_needed_and_free_bytes() -> None:
    # the helper the daemon calls before allocating, given the free bytes the driver would
    # report (no GPU here to ask: the GPU test below asks a real one)
    with pytest.raises(OutOfSpaceError) as info:
        check_device_memory("buf", 5_000_000, "cuda:1", free=1_234_567)
    message = str(info.value)
    assert "5,000,000" in message and "1,234,567" in message and "cuda:1" in message
    check_device_memory("buf", 1_000, "cuda:0", free=1_000)  # exactly fits


# -- layout and carving --------------------------------------------------------------------


def test_cuda_layout_keeps_cpu_column_offsets_and_puts_stamps_on_the_host() -> None:
    schema = Schema.from_spec(SPEC)
    layout = cuda_layout(schema, 1000)
    assert layout["columns"] == _layout(schema, 1000)["columns"]
    assert layout["generations"] == {"offset": 0, "nbytes": 8000}
    assert layout["size"] % 4096 == 0 and layout["size"] >= 8000
    end = max(c["offset"] + c["nbytes"] for c in layout["columns"].values())
    assert layout["device_size"] % 4096 == 0 and layout["device_size"] >= end
    assert all(c["offset"] % 4096 == 0 for c in layout["columns"].values())


def test_device_views_are_the_buffer_at_the_layout_offsets() -> None:
    schema = Schema.from_spec(SPEC)
    layout = cuda_layout(schema, CAPACITY)
    buffer = torch.zeros(layout["device_size"], dtype=torch.uint8)  # any device carves alike
    data, columns = device_views(schema, CAPACITY, layout["columns"], buffer)
    assert set(columns) == {f.key for f in schema}
    for field in schema:
        column = columns[field.key]
        region = layout["columns"][".".join(field.key)]
        assert column.dtype == field.dtype and column.shape == (CAPACITY, *field.shape)
        assert column.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert column.data_ptr() == buffer.data_ptr() + region["offset"]
    columns[("obs",)][4] = torch.tensor([1.5, 2.5, 3.5])
    start = layout["columns"]["obs"]["offset"] + 4 * 12
    raw = buffer[start : start + 12].view(torch.float32)
    assert raw.tolist() == [1.5, 2.5, 3.5]
    assert data["info"]["rgb"].data_ptr() == columns[("info", "rgb")].data_ptr()


def test_check_room_counts_the_stamps_on_the_storage_folder(storage: Path) -> None:
    schema = Schema.from_spec(SPEC)
    check_room("cpu", "room", schema, CAPACITY, storage)  # a CPU buffer: segment.check_fits
    huge = 10**15  # stamps alone over any tmpfs: refused before the device is asked
    with pytest.raises(OutOfSpaceError, match="for its stamps"):
        check_room("cuda:0", "room", schema, huge, storage)


# -- attaching: what is refused, in which order --------------------------------------------


def test_a_host_attach_of_a_cuda_segment_is_refused_clearly(storage: Path) -> None:
    host_part(storage, "gpu-buf")
    with pytest.raises(SegmentError) as info:
        Segment.attach("gpu-buf", storage_dir=storage)
    message = str(info.value)
    assert "keeps its rows on cuda:0" in message and "attach_segment" in message
    assert "nothing to resume" in message


@without_gpu
def test_a_client_without_cuda_is_refused_naming_the_device(storage: Path) -> None:
    host_part(storage, "gpu-buf")
    with pytest.raises(SegmentError) as info:
        attach_segment("gpu-buf", storage)
    message = str(info.value)
    assert "keeps its rows on cuda:0" in message and torch.__version__ in message
    assert "remote=True" in message


def test_ipc_between_machines_is_refused_before_cuda_is_asked(storage: Path) -> None:
    host_part(storage, "far", boot_id="another-kernel", host="elsewhere")
    with pytest.raises(SegmentError) as info:
        attach_segment("far", storage)
    message = str(info.value)
    assert "CUDA IPC impossible" in message and "another machine (elsewhere" in message
    assert "remote=True" in message


def test_ipc_with_the_exporting_process_itself_is_refused(storage: Path) -> None:
    host_part(storage, "mine", pid=os.getpid())
    with pytest.raises(SegmentError, match="CUDA IPC impossible: this process"):
        attach_segment("mine", storage)


def test_an_inconsistent_cuda_manifest_is_refused(storage: Path) -> None:
    host_part(storage, "bent", device_size=4096)
    with pytest.raises(SegmentError, match="is inconsistent"):
        CudaSegment.attach("bent", storage_dir=storage)
    host_part(storage, "holey", ipc="nope")
    with pytest.raises(SegmentError, match="is inconsistent"):
        attach_segment("holey", storage)


def test_attach_segment_gives_host_segments_as_before(storage: Path) -> None:
    schema = Schema.from_spec(SPEC)
    made = Segment.create("plain", schema, CAPACITY, storage_dir=storage)
    made.columns[("act",)][3] = 42
    got = attach_segment("plain", storage, pin=True)  # no --pin-memory: nothing to pin
    try:
        assert type(got) is Segment and got.device == "cpu"
        assert int(got.columns[("act",)][3]) == 42
        got.settle()  # host memory: nothing queued, returns at once
    finally:
        got.close()
        made.close()


@without_gpu
def test_a_pinned_buffer_stays_pageable_in_a_process_without_cuda(storage: Path) -> None:
    schema = Schema.from_spec(SPEC)
    made = Segment.create("pin", schema, CAPACITY, storage_dir=storage, extra={"pin_memory": True})
    try:
        got = attach_segment("pin", storage, pin=True)
        assert type(got) is Segment  # readable all the same; the log says why it is not pinned
        got.close()
    finally:
        made.close()


# -- on a GPU ------------------------------------------------------------------------------


def _child_attach(storage: str, name: str, results: Any) -> None:
    """In a spawned process: attach, report what the parent wrote, write back."""
    try:
        segment = CudaSegment.attach(name, storage_dir=storage)
        seen = segment.columns[("obs",)][:4].cpu().tolist()
        segment.columns[("act",)][:] = torch.arange(CAPACITY, device=segment.device) * 3
        torch.cuda.synchronize()
        stamps = segment.generations[:3].tolist()
        segment.generations[5] = 99  # host stamps: the parent sees this too
        results.put(("ok", seen, stamps, segment.device, segment.buffer.numel()))
        segment.close()
    except BaseException as exc:
        results.put(("error", repr(exc), None, None, None))


@gpu
@needs_gpu
def test_a_cuda_segment_is_one_allocation_shared_across_processes(storage: Path) -> None:
    schema = Schema.from_spec(SPEC)
    made = CudaSegment.create("shared", schema, CAPACITY, device="cuda", storage_dir=storage)
    try:
        assert made.device == "cuda:0" and made.arrays == {}
        assert all(c.is_cuda for c in made.columns.values())
        assert made.manifest["ipc"]["size"] == made.buffer.numel() == made.nbytes
        made.columns[("obs",)][:4] = torch.arange(12, dtype=torch.float32).view(4, 3).cuda()
        made.generations[:3] = [7, 8, 9]
        torch.cuda.synchronize()
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        child = ctx.Process(target=_child_attach, args=(str(storage), "shared", results))
        child.start()
        try:
            status, seen, stamps, device, nbytes = results.get(timeout=60)
        finally:
            child.join(30)
            if child.is_alive():
                child.kill()
        assert status == "ok", seen
        assert seen == torch.arange(12, dtype=torch.float32).view(4, 3).tolist()
        assert stamps == [7, 8, 9] and device == "cuda:0" and nbytes == made.nbytes
        torch.cuda.synchronize()
        assert made.columns[("act",)].cpu().tolist() == [3 * i for i in range(CAPACITY)]
        assert int(made.generations[5]) == 99
        # the exporting process cannot open its own handle: said so, not a CUDA error
        with pytest.raises(SegmentError, match="this process"):
            CudaSegment.attach("shared", storage_dir=storage)
    finally:
        made.close()


@gpu
@needs_gpu
def test_a_gpu_this_process_does_not_see_is_named(storage: Path) -> None:
    host_part(storage, "elsewhere-gpu")  # a uuid no GPU has
    with pytest.raises(SegmentError) as info:
        attach_segment("elsewhere-gpu", storage)
    message = str(info.value)
    assert "CUDA IPC impossible" in message and "not among the" in message


@gpu
@needs_gpu
def test_device_memory_is_checked_against_the_real_free_bytes(storage: Path) -> None:
    free, _total = torch.cuda.mem_get_info(0)
    schema = Schema.from_spec({"x": {"dtype": "uint8", "shape": [1 << 20]}})
    rows = free // (1 << 20) + 1024  # a GiB more than is free
    with pytest.raises(OutOfSpaceError) as info:
        CudaSegment.create("huge", schema, rows, device="cuda:0", storage_dir=storage)
    assert f"{rows << 20:,}" in str(info.value) and "free" in str(info.value)
    assert not (storage / "huge").exists()


@gpu
@needs_gpu
def test_a_pinned_segment_is_page_locked_in_this_process(storage: Path) -> None:
    schema = Schema.from_spec(SPEC)
    made = Segment.create("pin", schema, CAPACITY, storage_dir=storage, extra={"pin_memory": True})
    try:
        got = attach_segment("pin", storage, pin=True)
        assert isinstance(got, PinnedSegment) and got.pinned
        assert got.columns[("obs",)].is_pinned()
        made.columns[("obs",)][2] = torch.tensor([4.0, 5.0, 6.0])
        on_gpu = got.columns[("obs",)].to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert on_gpu[2].tolist() == [4.0, 5.0, 6.0]
        got.close()
        assert not got.pinned
    finally:
        made.close()


@gpu
@needs_gpu
def test_module_touches_no_cuda_at_import() -> None:
    # CPU-only paths pay nothing: importing the tier initialises no CUDA state (only a
    # machine with CUDA can tell: a CPU build is never initialised)
    import subprocess
    import sys

    code = (
        "import torch, shmbuffer.storage.cuda_segment, shmbuffer.storage.cuda_rows, "
        "shmbuffer.clients.reader, "
        "shmbuffer.clients.writer, shmbuffer.daemon.service; "
        "print(torch.cuda.is_initialized())"
    )
    argv = [sys.executable, "-c", code]
    out = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
