"""Checkpoints at the service level: round trip, a failure or a crash in the middle, refusals,
sampler state (the copy while the daemon serves, and incremental ones: test_checkpoint_copy.py)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shmbuffer.daemon import checkpoint as ckpt
from shmbuffer.daemon import checkpoint_job
from shmbuffer.daemon.config import DaemonConfig
from shmbuffer.daemon.recovery import RecoveryError, restore_service
from shmbuffer.daemon.service import BufferService
from shmbuffer.errors import CheckpointError, NotFoundError, PermissionDeniedError, ShmBufferError
from shmbuffer.storage.segment import segment_path
from shmbuffer.wire.protocol import request, validate_request

SPEC = {"obs": {"dtype": "float32", "shape": [5]}, "act": {"dtype": "int64", "shape": []}}
W, ADMIN = b"writer", b"admin"


@pytest.fixture
def storage() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="shmbuffer-ckpt-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def make_service(
    storage: str, unit: str = "episode", capacity: int = 64, **extra: Any
) -> BufferService:
    config = DaemonConfig(
        name=f"ck-{uuid.uuid4().hex[:8]}",
        capacity=capacity,
        unit=unit,
        schema=SPEC,
        storage_dir=storage,
        seed=1,
        **extra,
    )
    return BufferService(config)


def call(service: BufferService, who: bytes, op: str, **fields: Any) -> dict[str, Any]:
    checked = validate_request(request(op, 1, **fields))
    return service.handle(who, op, checked, [], 0.0)[0]


def hello(service: BufferService) -> None:
    for who, role in ((W, "writer"), (ADMIN, "admin")):
        call(service, who, "hello", role=role, pid=os.getpid(), host="test-host")


def write(service: BufferService, rows: int, value: float, episodes: int = 1) -> list[int]:
    """Reserve, fill the rows like a local writer, commit."""
    rep = call(service, W, "reserve", rows=rows, episodes=episodes)
    assert service.segment is not None
    for start, stop in rep["ranges"]:
        service.segment.arrays[("obs",)][start:stop] = value
        service.segment.arrays[("act",)][start:stop] = np.arange(start, stop)
    return list(call(service, W, "commit", reservation=rep["reservation"])["episodes"])


def rows_of(service: BufferService) -> dict[int, tuple[bytes, bytes]]:
    assert service.segment is not None
    arrays = service.segment.arrays
    return {
        ep.id: (
            arrays[("obs",)][ep.start : ep.end].tobytes(),
            arrays[("act",)][ep.start : ep.end].tobytes(),
        )
        for ep in service.container.registry
    }


def assert_same(a: BufferService, b: BufferService) -> None:
    assert list(a.container.registry) == list(b.container.registry)
    assert a.container.registry.next_id == b.container.registry.next_id
    assert rows_of(a) == rows_of(b)
    assert a.container.pointer == b.container.pointer
    assert a.container.rows_written == b.container.rows_written
    assert a.counters.rows_committed == b.counters.rows_committed
    assert a.counters.episodes_committed == b.counters.episodes_committed
    assert a.counters.samples == b.counters.samples
    assert np.array_equal(a.container.use_counts, b.container.use_counts)
    assert np.array_equal(a.generations, b.generations)


def fill(service: BufferService) -> None:
    hello(service)
    for i in range(14):  # laps the 64-row ring: eviction, early wrap, ids > capacity / 5
        write(service, 5 + i % 3, float(i))
    write(service, 6, 99.0, episodes=3)
    call(service, W, "sample", kind="episodes", n=4)
    call(service, W, "sample", kind="rows", n=10)
    call(service, W, "reserve", rows=4)  # open at checkpoint time: must not be restored


def restore(storage: str, source: Path, name: str | None = None, **config: Any) -> BufferService:
    config.setdefault("capacity", 64)
    config.setdefault("unit", "episode")
    name = name or f"rs-{uuid.uuid4().hex[:8]}"
    return restore_service(DaemonConfig(name=name, storage_dir=storage, **config), source)


def close(*services: BufferService) -> None:
    for service in services:
        if service.journal is not None:
            service.journal.close()
        if service.segment is not None:
            service.segment.close()


def table(folder: Path) -> dict[str, Any]:
    return dict(json.loads((folder / "checkpoint" / ckpt.TABLE).read_text()))


# -- round trip -------------------------------------------------------------------------------


@pytest.mark.parametrize("unit", ["episode", "transition"])
def test_round_trip(storage: str, tmp_path: Path, unit: str) -> None:
    service = make_service(storage, unit=unit)
    fill(service)
    reply = call(service, ADMIN, "checkpoint", to=str(tmp_path))
    assert reply["path"] == str(tmp_path / "checkpoint")
    assert reply["bytes"] == 64 * (service.schema.row_nbytes + 8)  # type: ignore[union-attr]
    assert reply["copied_bytes"] == reply["bytes"] and reply["linked_bytes"] == 0
    assert reply["seconds"] >= 0 and reply["max_pause_ms"] >= 0
    assert (tmp_path / "checkpoint" / "COMPLETE").is_file()
    assert not list(tmp_path.glob(".tmp-*"))
    state = json.loads((tmp_path / "checkpoint" / ckpt.STATE).read_text())
    assert state["checkpoint_format"] == ckpt.CHECKPOINT_FORMAT == 3
    assert len(table(tmp_path)["chunks"]) == len(list((tmp_path / "checkpoint/chunks").iterdir()))

    restored = restore(storage, tmp_path, unit=unit)
    assert_same(service, restored)
    assert restored.container.reservations == {}
    # the sampler continues the same random stream
    hello(restored)
    a = call(service, W, "sample", kind="episodes", n=8)
    b = call(restored, W, "sample", kind="episodes", n=8)
    assert a["ids"] == b["ids"]
    # the restored daemon journals from the restored state: a resume would see the same
    from shmbuffer.daemon.journal import Journal

    assert restored.segment is not None
    loaded = Journal(restored.segment.path).load()
    assert loaded["registry"] == restored.container.registry.to_state()
    close(service, restored)


def test_second_checkpoint_replaces_the_first(storage: str, tmp_path: Path) -> None:
    service = make_service(storage)
    fill(service)
    call(service, ADMIN, "checkpoint", to=str(tmp_path))
    call(service, W, "commit", reservation=service.container.next_reservation - 1)
    write(service, 3, 7.0)
    call(service, ADMIN, "checkpoint", to=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "checkpoint"]
    assert_same(service, restore(storage, tmp_path))


# -- failures ---------------------------------------------------------------------------------


def test_a_failed_copy_keeps_the_previous_checkpoint(
    storage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = make_service(storage)
    fill(service)
    call(service, ADMIN, "checkpoint", to=str(tmp_path))
    before = {k: v for k, v in rows_of(service).items()}
    ids_before = list(service.container.registry)
    write(service, 8, 42.0)  # changes that the failed checkpoint would have had
    real, writes = checkpoint_job.write_views, []

    def boom(fd: int, views: list[memoryview], offset: int) -> int:
        writes.append(offset)
        if len(writes) > 2:  # midway
            raise OSError(28, "No space left on device")
        return real(fd, views, offset)

    monkeypatch.setattr(checkpoint_job, "write_views", boom)
    with pytest.raises(ShmBufferError, match="No space"):
        call(service, ADMIN, "checkpoint", to=str(tmp_path))
    monkeypatch.undo()
    assert not list(tmp_path.glob(".tmp-*"))  # cleaned up
    restored = restore(storage, tmp_path)
    assert list(restored.container.registry) == ids_before
    assert rows_of(restored) == before
    write(service, 3, 1.0)  # the loop is not left waiting for the failed job
    assert call(service, ADMIN, "checkpoint", to=str(tmp_path))["copied_bytes"] > 0


def _child_checkpoint(storage: str, dest: str, where: str, ready: Any) -> None:
    """In a child: fill a buffer, checkpoint once, then die (SIGKILL) in the middle of the
    second checkpoint at ``where``."""
    service = make_service(storage)
    fill(service)
    call(service, ADMIN, "checkpoint", to=dest)
    ready.send(sorted(ep.id for ep in service.container.registry))  # synchronous
    write(service, 8, 42.0)
    real_write, real_json, real_replace = checkpoint_job.write_views, ckpt.write_json, os.replace

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def write_piece(fd: int, views: list[memoryview], offset: int) -> int:
        real_write(fd, views, offset)
        if where == "copy":
            die()
        return 0

    def write_json(path: Path, value: Any) -> int:
        if where == "state" and path.name == ckpt.STATE:
            die()
        return real_json(path, value)

    def replace(src: Any, dst: Any) -> None:
        real_replace(src, dst)
        if where == "between_renames" and str(dst).endswith("checkpoint.prev"):
            die()
        if where == "after_rename" and str(dst).endswith("/checkpoint"):
            die()

    patch = pytest.MonkeyPatch()  # in this doomed child process only
    patch.setattr(checkpoint_job, "write_views", write_piece)
    patch.setattr(ckpt, "write_json", write_json)
    patch.setattr(os, "replace", replace)
    call(service, ADMIN, "checkpoint", to=dest)
    ready.send("finished")  # not reached


@pytest.mark.parametrize("where", ["copy", "state", "between_renames", "after_rename"])
def test_killed_in_the_middle_of_a_checkpoint(storage: str, tmp_path: Path, where: str) -> None:
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_checkpoint, args=(storage, str(tmp_path), where, theirs))
    proc.start()
    try:
        assert mine.poll(60), "the child did not write its first checkpoint"
        first_ids = mine.recv()
        proc.join(60)
        assert proc.exitcode == -signal.SIGKILL
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    folder = ckpt.resolve_checkpoint(tmp_path)
    restored = restore(storage, tmp_path)
    ids = sorted(ep.id for ep in restored.container.registry)
    if where == "after_rename":  # the new checkpoint was complete and in place
        assert folder == tmp_path / "checkpoint"
        assert ids != first_ids
    else:
        assert ids == first_ids
        if where == "between_renames":
            assert folder == tmp_path / "checkpoint.prev"
    for ep in restored.container.registry:  # every restored row is a committed row
        assert restored.segment is not None
        assert (
            restored.segment.arrays[("act",)][ep.start : ep.end] == np.arange(ep.start, ep.end)
        ).all()
    # the next checkpoint removes the leftovers and leaves one complete checkpoint
    call(restored, ADMIN, "hello", role="admin", pid=os.getpid(), host="test-host")
    call(restored, ADMIN, "checkpoint", to=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "checkpoint"]
    assert_same(restored, restore(storage, tmp_path))


def test_refusals(storage: str, tmp_path: Path) -> None:
    service = make_service(storage)
    hello(service)
    with pytest.raises(PermissionDeniedError):
        call(service, W, "checkpoint", to=str(tmp_path))
    with pytest.raises(NotFoundError, match="COMPLETE"):
        ckpt.resolve_checkpoint(tmp_path)
    call(service, ADMIN, "checkpoint", to=str(tmp_path))
    (tmp_path / "checkpoint" / "COMPLETE").unlink()
    with pytest.raises(NotFoundError, match="no complete checkpoint"):
        restore(storage, tmp_path)
    lazy = BufferService(DaemonConfig(name=f"lz-{uuid.uuid4().hex[:8]}", storage_dir=storage))
    call(lazy, ADMIN, "hello", role="admin", pid=os.getpid(), host="h")
    with pytest.raises(ShmBufferError, match="no schema"):
        call(lazy, ADMIN, "checkpoint", to=str(tmp_path / "lazy"))
    with pytest.raises(ShmBufferError, match="cannot create"):  # a file, not a folder
        (tmp_path / "file").write_text("x")
        call(service, ADMIN, "checkpoint", to=str(tmp_path / "file"))
    call(service, ADMIN, "checkpoint", to=str(tmp_path))
    chunk = next((tmp_path / "checkpoint" / "chunks").iterdir())
    os.truncate(chunk, 10)
    with pytest.raises(CheckpointError, match=f"{chunk.name}: 10 bytes"):
        restore(storage, tmp_path)


def test_restore_refuses_conflicting_settings(storage: str, tmp_path: Path) -> None:
    service = make_service(storage)
    hello(service)
    write(service, 4, 1.0)
    call(service, ADMIN, "checkpoint", to=str(tmp_path))
    config = DaemonConfig(name="other", capacity=65, unit="episode", storage_dir=storage)
    with pytest.raises(RecoveryError, match="capacity"):
        restore_service(config, tmp_path)


# -- priorities and sampler state survive journal and checkpoint -------------------------------


@pytest.mark.parametrize("unit", ["transition", "episode"])
def test_priorities_and_sampler_state_survive_journal_and_checkpoint(
    storage: str, tmp_path: Path, unit: str
) -> None:
    extra: dict[str, Any] = {
        "sampler": "prioritized",
        "priority_exponent": 1.0,
        "rate_limiter": "min-size",
        "min_size": 4,
    }
    service = make_service(storage, unit=unit, **extra)
    fill(service)
    assert service.segment is not None
    sampled = np.frombuffer(call(service, W, "sample", kind="rows", n=32)["rows"], "<i8")
    gens = service.generations[sampled].copy()
    write(service, 6, 5.0)  # overwrites some of the sampled rows: their updates are stale
    prio = np.linspace(0.5, 20.0, 32)
    applied = service.update_priorities(sampled, prio, gens)
    stale = int((service.generations[sampled] != gens).sum())
    assert applied == 32 - stale and service.container.priority_updates_stale == stale
    live = service.container.sampler.state_dict()
    leaves = np.frombuffer(live["leaves"], dtype=np.float64)
    if unit == "transition":  # each fresh row has its (last) new priority, plus eps
        fresh = service.generations[sampled] == gens
        last = {int(r): p for r, p, ok in zip(sampled, prio, fresh, strict=True) if ok}
        assert all(np.isclose(leaves[r], p + 1e-6) for r, p in last.items())
    # a SIGKILLed daemon's journal replays to the same priorities (resume)
    from shmbuffer.daemon.journal import Journal, restore_container

    resumed = restore_container(Journal(service.segment.path).load())
    assert resumed.sampler.state_dict()["leaves"] == live["leaves"]
    # a checkpoint keeps them, with the limiter's counts and the generator's state
    call(service, ADMIN, "checkpoint", to=str(tmp_path))
    config = DaemonConfig(
        name=f"rs-{uuid.uuid4().hex[:8]}", capacity=64, unit=unit, storage_dir=storage, **extra
    )
    restored = restore_service(config, tmp_path)
    assert_same(service, restored)
    assert restored.container.sampler.state_dict() == live
    limiter = service.container.rate_limiter.state_dict()
    assert restored.container.rate_limiter.state_dict() == limiter
    assert restored.container.priority_updates_stale == stale
    hello(restored)
    a = call(service, W, "sample", kind="rows", n=16)
    b = call(restored, W, "sample", kind="rows", n=16)
    assert a["rows"] == b["rows"]  # the same draws: same priorities, same generator
    # restoring into a daemon configured with another sampler is refused, naming both
    other = DaemonConfig(
        name=f"rs-{uuid.uuid4().hex[:8]}", capacity=64, unit=unit, storage_dir=storage
    )
    with pytest.raises(RecoveryError, match="prioritized"):
        restore_service(other, tmp_path)
    assert not segment_path(other.name, storage).exists()  # its fresh segment went again
