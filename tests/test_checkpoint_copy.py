"""Checkpoints at the service level, the copy while the daemon serves: rows overwritten during
the copy are saved first (copy-on-write), ``clear`` and a stop meanwhile, incremental links,
restores and forks, format 1. The helpers are tests/test_checkpoint.py's."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shmbuffer.daemon import checkpoint as ckpt
from shmbuffer.daemon import checkpoint_job
from shmbuffer.daemon.service import BufferService, Deferred
from shmbuffer.errors import CheckpointError
from shmbuffer.storage.segment import MANIFEST
from shmbuffer.wire.protocol import request, validate_request
from tests.test_checkpoint import (
    ADMIN,
    W,
    assert_same,
    call,
    close,
    fill,
    hello,
    make_service,
    restore,
    rows_of,
    table,
    write,
)


@pytest.fixture
def storage() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="shmbuffer-ckpt-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


# -- the live copy ----------------------------------------------------------------------------


def start_deferred(service: BufferService, to: Path) -> dict[str, Any]:
    """Send ``checkpoint`` as the server does: parked (Deferred) while its thread copies; the
    request the server parks is the one the Deferred names, which holds the job started."""
    service.defer_checkpoints = True
    fields = validate_request(request("checkpoint", 1, to=str(to)))
    with pytest.raises(Deferred) as waited:
        service.handle(ADMIN, "checkpoint", fields, [], 0.0)
    service.defer_checkpoints = False  # later calls wait in place again
    assert "_job" not in fields  # the request itself is never changed
    retry = waited.value.retry
    assert retry is not None and "_job" in retry
    return retry


def finish(service: BufferService, fields: dict[str, Any]) -> dict[str, Any]:
    """Retry the parked request until the copy is done (the server's background queue)."""
    job = fields["_job"]
    assert job.wait(30), "the checkpoint did not finish"
    return service.handle(ADMIN, "checkpoint", fields, [], 0.0, retry=True)[0]


@pytest.mark.parametrize("unit", ["episode", "transition"])
def test_rows_overwritten_during_the_copy_are_saved_first(
    storage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unit: str
) -> None:
    """The checkpoint holds the cut, though writers lap the whole ring while it copies."""
    monkeypatch.setenv(checkpoint_job.ENV_TEST_SLEEP, "0.01")  # 256 pieces: ~2.5 s of copy
    service = make_service(storage, unit=unit, capacity=4096)
    hello(service)
    for i in range(400):
        write(service, 10, float(i))
    open_at_cut = call(service, W, "reserve", rows=7)  # may be torn in the copy: not restored
    registry, rows = list(service.container.registry), rows_of(service)
    gens = service.generations.copy()
    fields = start_deferred(service, tmp_path)
    job = fields["_job"]
    call(service, W, "commit", reservation=open_at_cut["reservation"])  # finished after the cut
    laps = 0
    while not job.done and laps < 3:  # the daemon serves writers meanwhile
        for i in range(410):
            write(service, 10, 1000.0 + i)
        laps += 1
    assert laps >= 1 and job.saved_bytes > 0  # rows the copy had not reached were saved
    reply = finish(service, fields)
    assert reply["copied_bytes"] == reply["bytes"]
    restored = restore(storage, tmp_path, capacity=4096, unit=unit)
    assert list(restored.container.registry) == registry
    assert rows_of(restored) == rows  # every episode as committed at the cut, none torn
    assert restored.segment is not None
    live = np.array([r for ep in registry for r in range(ep.start, ep.end)])
    assert np.array_equal(restored.generations[live], gens[live])
    close(service, restored)


def test_a_clear_during_the_copy_leaves_the_cut_whole(
    storage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``clear`` changes metadata only; the writes after it start at row 0 and are saved first
    like any other."""
    monkeypatch.setenv(checkpoint_job.ENV_TEST_SLEEP, "0.005")
    service = make_service(storage, capacity=4096)
    hello(service)
    for i in range(300):
        write(service, 10, float(i))
    registry, rows = list(service.container.registry), rows_of(service)
    fields = start_deferred(service, tmp_path)
    call(service, ADMIN, "clear")
    for i in range(100):
        write(service, 10, -1.0 - i)
    assert service.container.pointer == 1000  # from row 0 again
    finish(service, fields)
    restored = restore(storage, tmp_path, capacity=4096)
    assert list(restored.container.registry) == registry
    assert rows_of(restored) == rows
    close(service, restored)


def test_the_daemon_serves_while_a_checkpoint_copies(
    storage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(checkpoint_job.ENV_TEST_SLEEP, "0.01")
    service = make_service(storage, capacity=4096)
    hello(service)
    write(service, 100, 1.0)
    fields = start_deferred(service, tmp_path)
    # reads, writes and a second checkpoint's refusal, all while the first one copies
    call(service, W, "sample", kind="rows", n=8)
    write(service, 10, 2.0)
    with pytest.raises(CheckpointError, match="one at a time"):
        call(service, ADMIN, "checkpoint", to=str(tmp_path / "other"))
    assert not fields["_job"].done
    with pytest.raises(Deferred):  # not done yet: the retry parks it again
        service.handle(ADMIN, "checkpoint", fields, [], 0.0, retry=True)
    finish(service, fields)
    monkeypatch.delenv(checkpoint_job.ENV_TEST_SLEEP)
    call(service, ADMIN, "checkpoint", to=str(tmp_path / "other"))  # one at a time: now free
    close(service)


def test_stopping_during_a_checkpoint_keeps_the_previous_one(
    storage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = make_service(storage, capacity=4096)
    hello(service)
    write(service, 100, 1.0)
    call(service, ADMIN, "checkpoint", to=str(tmp_path))
    before = rows_of(service)
    write(service, 100, 2.0)
    monkeypatch.setenv(checkpoint_job.ENV_TEST_SLEEP, "0.01")
    fields = start_deferred(service, tmp_path)
    service.stop_checkpoint()  # what the server does on SIGTERM
    with pytest.raises(CheckpointError, match="cancelled"):
        finish(service, fields)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "checkpoint"]
    restored = restore(storage, tmp_path, capacity=4096)
    assert rows_of(restored) == before
    close(service, restored)


# -- incremental ------------------------------------------------------------------------------


def test_an_unchanged_buffer_links_every_chunk(storage: str, tmp_path: Path) -> None:
    service = make_service(storage, capacity=4096)
    hello(service)
    for i in range(300):
        write(service, 10, float(i))
    first = call(service, ADMIN, "checkpoint", to=str(tmp_path))
    names = table(tmp_path)["chunks"]
    again = call(service, ADMIN, "checkpoint", to=str(tmp_path))
    assert again["linked_bytes"] == again["bytes"] == first["bytes"]
    assert again["copied_bytes"] == 0
    assert table(tmp_path)["chunks"] == names
    inode = {p.name: p.stat().st_ino for p in (tmp_path / "checkpoint/chunks").iterdir()}
    assert all(p.stat().st_nlink == 1 for p in (tmp_path / "checkpoint/chunks").iterdir())
    # after writes, only the chunks they reached are copied; the rest are the same files
    layout = fields_layout(service)
    rep = call(service, W, "reserve", rows=700)
    call(service, W, "commit", reservation=rep["reservation"])
    touched = {c for s, e in rep["ranges"] for c in range(s // layout, (e - 1) // layout + 1)}
    third = call(service, ADMIN, "checkpoint", to=str(tmp_path))
    chunk_bytes = layout * (service.schema.row_nbytes + 8)  # type: ignore[union-attr]
    assert third["copied_bytes"] == len(touched) * chunk_bytes
    assert third["linked_bytes"] == third["bytes"] - third["copied_bytes"]
    now = {p.name: p.stat().st_ino for p in (tmp_path / "checkpoint/chunks").iterdir()}
    kept = set(now) & set(inode)
    assert len(kept) == len(names) - len(touched) and all(now[n] == inode[n] for n in kept)
    assert_same(service, restore(storage, tmp_path, capacity=4096))


def fields_layout(service: BufferService) -> int:
    """Rows per chunk of the service's checkpoints."""
    from shmbuffer.daemon.checkpoint_layout import ChunkLayout

    assert service.segment is not None
    return ChunkLayout.of(service.segment.manifest).chunk_rows


def test_a_chunk_with_rows_in_flight_is_copied_again(storage: str, tmp_path: Path) -> None:
    """Rows reserved at the cut may be torn in the copy: their chunk never counts as kept."""
    service = make_service(storage, capacity=4096)
    hello(service)
    write(service, 100, 1.0)
    rep = call(service, W, "reserve", rows=10)  # open at the first cut
    call(service, ADMIN, "checkpoint", to=str(tmp_path))
    assert any("-open-" in name for name in table(tmp_path)["chunks"])
    assert service.segment is not None  # the writer finishes after the cut, then commits
    for start, stop in rep["ranges"]:
        service.segment.arrays[("obs",)][start:stop] = 5.0
    call(service, W, "commit", reservation=rep["reservation"])
    second = call(service, ADMIN, "checkpoint", to=str(tmp_path))
    assert second["copied_bytes"] > 0  # the chunk the stamps alone would have called kept
    assert_same(service, restore(storage, tmp_path, capacity=4096))


def test_restored_daemons_link_what_is_unchanged_and_forks_never_mix(
    storage: str, tmp_path: Path
) -> None:
    service = make_service(storage, capacity=4096)
    hello(service)
    for i in range(300):
        write(service, 10, float(i))
    call(service, ADMIN, "checkpoint", to=str(tmp_path / "base"))
    a = restore(storage, tmp_path / "base", capacity=4096)
    b = restore(storage, tmp_path / "base", capacity=4096)
    hello(a)
    hello(b)
    # restored and unchanged: its first checkpoint links the base's chunks
    shutil.copytree(tmp_path / "base", tmp_path / "shared", copy_function=os.link)
    assert call(a, ADMIN, "checkpoint", to=str(tmp_path / "shared"))["copied_bytes"] == 0
    # two forks write different bytes under the same stamps; neither may link the other's
    write(a, 50, 111.0)
    write(b, 50, 222.0)
    call(a, ADMIN, "checkpoint", to=str(tmp_path / "shared"))
    reply = call(b, ADMIN, "checkpoint", to=str(tmp_path / "shared"))
    assert reply["copied_bytes"] > 0
    assert_same(b, restore(storage, tmp_path / "shared", capacity=4096))
    # a fresh buffer with the very same writes: another lineage, nothing linked
    fresh = make_service(storage, capacity=4096)
    hello(fresh)
    for i in range(300):
        write(fresh, 10, float(i))
    again = call(fresh, ADMIN, "checkpoint", to=str(tmp_path / "base"))
    assert again["linked_bytes"] == 0
    close(service, a, b, fresh)


def test_format_1_checkpoints_still_restore(storage: str, tmp_path: Path) -> None:
    """A folder as earlier versions wrote it: one data.bin, a copy of the data file."""
    service = make_service(storage)
    fill(service)
    assert service.segment is not None
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / MANIFEST).write_text(json.dumps(service.segment.manifest))
    shutil.copyfile(service.segment.path / "data.bin", folder / "data.bin")
    np.save(folder / ckpt.USE_COUNTS, service.container.use_counts)
    state = {**service.persistent_state(), "checkpoint_format": 1}
    (folder / ckpt.STATE).write_text(json.dumps(state))
    (folder / ckpt.COMPLETE).write_text("{}")
    assert_same(service, restore(storage, tmp_path))
    state["checkpoint_format"] = 4
    (folder / ckpt.STATE).write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match="checkpoint_format 4"):
        restore(storage, tmp_path)
