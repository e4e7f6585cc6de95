"""The CUDA tier through real daemons (``start --device cuda``, ``--pin-memory``).

Without CUDA: the clear refusals at start (each names the device and what torch reports).
With a GPU (marked ``gpu``, skipped cleanly elsewhere): a CUDA daemon fed by a host-side and a
GPU-side writer process, read as GPU tensors and zero-copy GPU views; payload clients of it;
a pinned CPU buffer; out-of-memory, checkpoint and resume refusals.
"""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e import _cuda_workers as workers

CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
without_gpu = pytest.mark.skipif(CUDA, reason="checks the errors of a machine without CUDA")
LENGTH = 25


def schema_file(env: Any, spec: dict[str, Any] | None = None) -> str:
    path = Path(env.runtime_dir) / "schema.json"
    path.write_text(json.dumps(spec or workers.SCHEMA))
    return str(path)


def start_fails(env: Any, *args: str) -> str:
    """``start ARGS`` must exit 1, leaving no runtime file and no segment; its stderr."""
    name = "cudafail"
    done = env.cli("start", "--name", name, "--storage-dir", str(env.storage_dir), *args)
    assert done.returncode == 1, done.stdout + done.stderr
    assert env.read_runtime(name) is None
    assert not (env.storage_dir / name).exists()
    return str(done.stderr)


def run_writers(env: Any, name: str, jobs: list[tuple[int, int, bool]]) -> list[int]:
    """Run ``workers.write`` once per (writer_id, episodes, on_gpu), in spawned processes."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=workers.entry,
            args=(str(env.runtime_dir), results, "write", (name, wid, n, LENGTH, on_gpu)),
            daemon=True,
        )
        for wid, n, on_gpu in jobs
    ]
    for proc in procs:
        proc.start()
    try:
        got = [results.get(timeout=90) for _ in procs]
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    errors = [value for status, value in got if status != "ok"]
    assert not errors, errors[0]
    return [int(value) for _, value in got]


# -- without a GPU -------------------------------------------------------------------------


@without_gpu
def test_start_on_a_gpu_without_one_fails_naming_it(e2e_env: Any) -> None:
    err = start_fails(e2e_env, "--device", "cuda", "--schema", schema_file(e2e_env))
    assert "--device cuda:0" in err and torch.__version__ in err


@pytest.mark.slow  # the same check as test_cuda_segment's config test, through the CLI
@without_gpu
def test_start_pinned_without_cuda_fails_naming_it(e2e_env: Any) -> None:
    err = start_fails(e2e_env, "--pin-memory")
    assert "--pin-memory needs CUDA" in err and torch.__version__ in err


def test_start_flags_reach_the_settings(e2e_env: Any) -> None:
    # both flags must reach DaemonConfig for this refusal, on any machine
    err = start_fails(e2e_env, "--device", "cuda", "--pin-memory")
    assert "give one or the other" in err


# -- on a GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
def test_a_cuda_daemon_serves_gpu_rows_written_from_host_and_gpu(daemon: Any, e2e_env: Any) -> None:
    from shmbuffer import Reader
    from shmbuffer.storage.cuda_segment import CudaSegment

    d = daemon(capacity=4000, args=["--device", "cuda", "--schema", schema_file(e2e_env)])
    written = run_writers(e2e_env, d.name, [(1, 40, False), (2, 40, True)])
    assert written == [40 * LENGTH, 40 * LENGTH]
    with Reader(d.name) as reader:
        batch = reader.sample(256)
        assert isinstance(reader.segment, CudaSegment)
        assert all(leaf.is_cuda for leaf in batch.values())
        assert workers.bad_rows(batch["ep"], batch["t"], batch["obs"]) == 0
        assert {int(e) // 100_000 for e in batch["ep"].unique()} == {1, 2}  # both writers
        base = reader.segment.buffer
        with reader.sample_episodes(8) as episodes:
            for ep in episodes:
                assert ep["obs"].is_cuda and ep["obs"].device == base.device
                # a zero-copy view inside this process's mapping of the daemon's allocation
                ptr = ep["obs"].data_ptr()
                assert base.data_ptr() <= ptr < base.data_ptr() + base.numel()
                assert ep["t"].tolist() == list(range(LENGTH))
                assert ep["ep"].unique().numel() == 1
                assert workers.bad_rows(ep["ep"], ep["t"], ep["obs"]) == 0
        sliced = reader.sample_slices(4, LENGTH + 5, strict=False)
        assert sliced["mask"].is_cuda and int(sliced["mask"].sum()) == 4 * LENGTH
        assert reader.stats()["rows"] == 80 * LENGTH


@pytest.mark.gpu
@needs_gpu
def test_payload_clients_of_a_cuda_daemon(daemon: Any, e2e_env: Any) -> None:
    from shmbuffer import Reader, Writer

    d = daemon(capacity=2000, args=["--device", "cuda", "--schema", schema_file(e2e_env)])
    with Writer(d.name, remote=True) as writer:  # the daemon copies host -> device
        for i in range(10):
            writer.add_episode(workers.episode(i, LENGTH, None))
        writer.flush()
    with Reader(d.name, remote=True) as remote, Reader(d.name) as local:
        copied = remote.sample(64)  # the daemon gathers on the GPU and sends the rows
        assert not copied["obs"].is_cuda
        assert workers.bad_rows(copied["ep"], copied["t"], copied["obs"]) == 0
        on_gpu = local.sample(64)
        assert on_gpu["obs"].is_cuda
        assert workers.bad_rows(on_gpu["ep"], on_gpu["t"], on_gpu["obs"]) == 0


@pytest.mark.gpu
@needs_gpu
def test_a_pinned_cpu_buffer_is_page_locked_by_its_readers(daemon: Any, e2e_env: Any) -> None:
    from shmbuffer import Reader
    from shmbuffer.storage.cuda_segment import PinnedSegment

    d = daemon(capacity=2000, args=["--pin-memory", "--schema", schema_file(e2e_env)])
    run_writers(e2e_env, d.name, [(1, 10, False)])
    with Reader(d.name) as reader:
        batch = reader.sample(32)
        assert not batch["obs"].is_cuda  # rows stay on the host
        assert isinstance(reader.segment, PinnedSegment) and reader.segment.pinned
        with reader.sample_episodes(2) as episodes:
            view = episodes[0]["obs"]
            assert view.is_pinned()
            moved = view.to("cuda", non_blocking=True)
            torch.cuda.synchronize()
            assert torch.equal(moved.cpu(), view)


@pytest.mark.gpu
@needs_gpu
def test_a_buffer_larger_than_the_gpu_is_refused_at_start(e2e_env: Any) -> None:
    free, _total = torch.cuda.mem_get_info(0)
    rows = free // (1 << 20) + 1024
    spec = {"frame": {"dtype": "uint8", "shape": [1 << 20]}}
    err = start_fails(
        e2e_env, "--device", "cuda", "--capacity", str(rows), "--schema", schema_file(e2e_env, spec)
    )
    assert f"needs {rows << 20:,} bytes on cuda:0 but only" in err and "free" in err


@pytest.mark.gpu
@needs_gpu
def test_gpu_buffers_refuse_checkpoints_and_resume(
    daemon: Any, e2e_env: Any, tmp_path: Path
) -> None:
    from shmbuffer.errors import SegmentError

    d = daemon(capacity=500, args=["--device", "cuda", "--schema", schema_file(e2e_env)])
    conn = d.admin()
    try:
        # a CheckpointError in the daemon; on the wire its code is `segment` (docs/protocol.md)
        with pytest.raises(SegmentError, match="live on cuda:0"):
            conn.call("checkpoint", to=str(tmp_path))
    finally:
        conn.close()
    err = start_fails(e2e_env, "--device", "cuda", "--resume")
    assert "cannot be combined with --resume" in err
