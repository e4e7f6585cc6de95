"""Checkpoint checksums: a flipped byte anywhere in a checkpoint refuses the restore, naming the
file, and leaves no segment behind; linked chunks carry their checksum (a corrupted one is not
made valid by linking it); a checkpoint of an earlier format without checksums still restores,
with a warning. The helpers are tests/test_checkpoint.py's."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from shmbuffer.daemon import checkpoint as ckpt
from shmbuffer.errors import CheckpointError, RecoveryError
from shmbuffer.storage.segment import MANIFEST, segment_path
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
    table,
    write,
)


@pytest.fixture
def storage() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="shmbuffer-ckpt-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def flip(path: Path, offset: int) -> None:
    """Flip every bit of one byte of ``path`` (negative offsets count from its end)."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def refused(storage: str, source: Path, match: str) -> None:
    """Restoring ``source`` is refused with ``match`` in the error, and leaves no segment."""
    name = f"rs-{uuid.uuid4().hex[:8]}"
    with pytest.raises((CheckpointError, RecoveryError), match=match) as info:
        restore(storage, source, name=name, capacity=4096)
    assert "corrupt" in str(info.value)
    assert not segment_path(name, storage).exists()


def checkpointed(storage: str, folder: Path):  # type: ignore[no-untyped-def]
    service = make_service(storage, capacity=4096)
    hello(service)
    for i in range(300):
        write(service, 10, float(i))
    call(service, ADMIN, "checkpoint", to=str(folder))
    return service


@pytest.mark.parametrize("where", ["a row", "a stamp", "every 97th byte"])
def test_a_corrupted_chunk_is_refused_naming_it(storage: str, tmp_path: Path, where: str) -> None:
    service = checkpointed(storage, tmp_path)
    chunks = tmp_path / "checkpoint" / ckpt.CHUNKS
    names = table(tmp_path)["chunks"]
    victim = chunks / names[3]
    if where == "a row":
        flip(victim, victim.stat().st_size // 3)
    elif where == "a stamp":
        flip(victim, -1)  # the last row's stamp ends the file
    else:
        for name in names:
            data = bytearray((chunks / name).read_bytes())
            data[::97] = bytes(b ^ 0x01 for b in data[::97])
            (chunks / name).write_bytes(bytes(data))
    refused(storage, tmp_path, f"chunk file .*{names[0] if where[0] == 'e' else names[3]}")
    with pytest.raises(CheckpointError, match="corrupt"):
        ckpt.verify(tmp_path)
    call(service, ADMIN, "checkpoint", to=str(tmp_path / "again"))
    assert ckpt.verify(tmp_path / "again") == sum(f.stat().st_size for f in chunks.iterdir())
    close(service)


@pytest.mark.parametrize("file", [ckpt.USE_COUNTS, ckpt.STATE, ckpt.TABLE, MANIFEST])
def test_a_corrupted_small_file_is_refused_naming_it(
    storage: str, tmp_path: Path, file: str
) -> None:
    """The counters, registry and sampler state, the chunk table (and so the chunks'
    checksums) and the manifest are covered too: a changed digit there parses as well."""
    service = checkpointed(storage, tmp_path)
    path = tmp_path / "checkpoint" / file
    data = path.read_bytes()
    if file == ckpt.USE_COUNTS:
        flip(path, -1)
    else:  # a digit changed: still valid JSON, another value
        at = max(i for i, c in enumerate(data) if chr(c) in "12345678")
        path.write_bytes(data[:at] + bytes([data[at] + 1]) + data[at + 1 :])
        json.loads(path.read_text())
    refused(storage, tmp_path, f"file {path}")
    close(service)


def test_linked_chunks_carry_their_checksum(storage: str, tmp_path: Path) -> None:
    service = checkpointed(storage, tmp_path)
    first = table(tmp_path)
    assert first["checksum"] == "crc32" and len(first["checksums"]) == len(first["chunks"])
    again = call(service, ADMIN, "checkpoint", to=str(tmp_path))
    assert again["copied_bytes"] == 0  # every chunk linked: its checksum taken from the table
    assert table(tmp_path)["checksums"] == first["checksums"]
    assert_same(service, restore(storage, tmp_path, capacity=4096))
    # bytes that rot on disk after the checkpoint are not made valid by linking them again
    flip(tmp_path / "checkpoint" / ckpt.CHUNKS / first["chunks"][5], 100)
    assert call(service, ADMIN, "checkpoint", to=str(tmp_path))["copied_bytes"] == 0
    refused(storage, tmp_path, first["chunks"][5])
    close(service)


def as_format_2(folder: Path) -> None:
    """Make a checkpoint look as the previous version wrote it: no checksums anywhere."""
    folder = folder / "checkpoint"
    state = json.loads((folder / ckpt.STATE).read_text())
    (folder / ckpt.STATE).write_text(json.dumps({**state, "checkpoint_format": 2}))
    chunks = json.loads((folder / ckpt.TABLE).read_text())
    del chunks["checksum"], chunks["checksums"]
    (folder / ckpt.TABLE).write_text(json.dumps(chunks))
    summary = json.loads((folder / ckpt.COMPLETE).read_text())
    del summary["checksums"]
    (folder / ckpt.COMPLETE).write_text(json.dumps(summary))


def test_a_checkpoint_without_checksums_restores_with_a_warning(
    storage: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    service = make_service(storage)
    fill(service)
    call(service, ADMIN, "checkpoint", to=str(tmp_path))
    as_format_2(tmp_path)
    with caplog.at_level(logging.WARNING, logger="shmbuffer.daemon"):
        restored = restore(storage, tmp_path)
    assert "has no checksums" in caplog.text and "unverified" in caplog.text
    assert_same(service, restored)
    # nothing is linked from it (a linked chunk needs a checksum to carry): all copied again
    hello(restored)
    reply = call(restored, ADMIN, "checkpoint", to=str(tmp_path))
    assert reply["linked_bytes"] == 0 and reply["copied_bytes"] == reply["bytes"]
    assert len(table(tmp_path)["checksums"]) == len(table(tmp_path)["chunks"])
    # a format-3 checkpoint that lost its checksums is not taken for an older one
    call(service, W, "commit", reservation=service.container.next_reservation - 1)
    call(service, ADMIN, "checkpoint", to=str(tmp_path / "new"))
    summary = json.loads((tmp_path / "new/checkpoint" / ckpt.COMPLETE).read_text())
    del summary["checksums"]
    (tmp_path / "new/checkpoint" / ckpt.COMPLETE).write_text(json.dumps(summary))
    with pytest.raises(CheckpointError, match="no checksums"):
        restore(storage, tmp_path / "new")
    close(service, restored)
