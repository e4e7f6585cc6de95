"""The daemon's side of readers' own draws, without sockets: ``spans.bin`` beside a CPU segment,
its word in ``hello``, and the ``drawn`` report counted as the daemon counts its own draws (a
row overwritten or cleared since is not counted for its new data; a bad report is refused
whole, naming what is wrong)."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shmbuffer.daemon.config import DaemonConfig
from shmbuffer.daemon.service import BufferService
from shmbuffer.errors import InvalidArgumentError, LimitExceededError
from shmbuffer.registry.shared_spans import SPANS_FILE, SpansView
from shmbuffer.storage.segment import Segment
from shmbuffer.wire.protocol import request, validate_request

W, R, ADMIN = b"writer", b"reader", b"admin"
SPEC = {"x": {"dtype": "float32", "shape": [2]}}


@pytest.fixture
def service() -> Iterator[BufferService]:
    folder = tempfile.mkdtemp(prefix="shmbuffer-test-", dir="/dev/shm")
    config = DaemonConfig(name=f"drawn-{uuid.uuid4().hex[:8]}", storage_dir=folder, capacity=32)
    svc = BufferService(config)
    yield svc
    if svc.segment is not None:
        svc.segment.close()
    Segment.unlink(config.name, folder)
    shutil.rmtree(folder, ignore_errors=True)


def call(svc: BufferService, who: bytes, op: str, frames: Any = (), **fields: Any) -> Any:
    return svc.handle(who, op, validate_request(request(op, 1, **fields)), list(frames), 0.0)[0]


def write(svc: BufferService, rows: int) -> None:
    reservation = call(svc, W, "reserve", rows=rows)["reservation"]
    call(svc, W, "commit", reservation=reservation)


def report(svc: BufferService, rows: list[int], gens: Any, samples: int = 1) -> int:
    frames = [np.asarray(rows, dtype="<i8"), np.asarray(gens, dtype="<i8")]
    return int(call(svc, R, "drawn", frames, rows=len(rows), samples=samples)["counted"])


def test_a_cpu_segment_publishes_its_runs_and_hello_says_where(service: BufferService) -> None:
    hello = call(service, W, "hello", role="writer", pid=1, host="h")
    assert hello["buffer"]["local_draws"] == {"file": SPANS_FILE, "seed": None}
    call(service, W, "define_schema", schema=SPEC)
    write(service, 20)
    assert service.segment is not None
    view = SpansView.open(service.segment.path / SPANS_FILE)
    assert view is not None
    got = view.draw(np.random.default_rng(0), 100, service.generations)
    assert got is not None and got[2] == 20 and got[0].max() < 20


def test_a_report_counts_what_still_holds_the_rows_drawn(service: BufferService) -> None:
    for who, role in ((W, "writer"), (R, "reader"), (ADMIN, "admin")):
        call(service, who, "hello", role=role, pid=1, host="h")
    call(service, W, "define_schema", schema=SPEC)
    write(service, 32)
    stamps = service.generations.copy()
    counts = service.container.use_counts
    before = call(service, R, "stats")["stats"]
    assert report(service, [0, 0, 5, 31], stamps[[0, 0, 5, 31]], samples=2) == 4
    assert counts[0] == 2 and counts[5] == 1 and counts[31] == 1
    write(service, 8)  # rows 0..7 hold new data: their stamps moved
    assert counts[0] == 0
    assert report(service, [0, 5, 9], stamps[[0, 5, 9]]) == 1  # only row 9 still holds it
    assert counts[0] == 0 and counts[5] == 0 and counts[9] == 1
    after = call(service, R, "stats")["stats"]
    assert after["samples"] - before["samples"] == 3
    assert after["rows_sampled"] - before["rows_sampled"] == 7
    assert after["rate_limiter"]["sampled"] - before["rate_limiter"]["sampled"] == 7
    call(service, ADMIN, "clear")  # no stamp moves, but the rows hold nothing now
    assert report(service, [10], service.generations[[10]]) == 0
    assert counts[10] == -1


def test_a_bad_report_is_refused_whole(service: BufferService) -> None:
    call(service, R, "hello", role="reader", pid=1, host="h")
    call(service, R, "define_schema", schema=SPEC)
    write_as_reader = call(service, R, "reserve", rows=32)["reservation"]
    call(service, R, "commit", reservation=write_as_reader)
    counts = service.container.use_counts.copy()
    gens = service.generations[[1, 2]]
    with pytest.raises(InvalidArgumentError, match="row 32 is out of range"):
        report(service, [1, 32], gens)
    with pytest.raises(InvalidArgumentError, match="two payload frames of 16 bytes"):
        call(service, R, "drawn", [np.zeros(2, dtype="<i8")], rows=2, samples=1)
    with pytest.raises(InvalidArgumentError, match=r"\[16, 8\]"):
        call(service, R, "drawn", [np.zeros(2, "<i8"), np.zeros(1, "<i8")], rows=2, samples=1)
    service.config.max_payload_bytes = 16
    with pytest.raises(LimitExceededError, match="max_payload_bytes=16"):
        report(service, [1, 2], gens)
    assert np.array_equal(service.container.use_counts, counts)


def test_a_gpu_daemon_offers_no_local_draws(tmp_path: Path) -> None:
    config = DaemonConfig(name="gpu-like", storage_dir=str(tmp_path), capacity=8)
    svc = BufferService(config)
    svc.config.device = "cuda:0"  # what buffer_info reads; no segment is made here
    assert svc.buffer_info()["local_draws"] is None
