"""No data lost, through a real daemon: writes that fail (validation, a copy that
breaks after the reservation, a full journal file system) lose nothing that was stored or
acknowledged, fail in their own call, and survive ``--resume``."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shmbuffer import Reader, Writer
from shmbuffer.errors import OutOfSpaceError, SchemaError
from tests.e2e.conftest import wait_for

CAPACITY = 40  # rows; 20 episodes of 2 fill it, so every later write evicts


def episode(mark: int, **override: Any) -> dict[str, Any]:
    """Two rows whose ``n`` is ``mark``; values that fit the schema unless overridden."""
    return {
        "x": np.full(2, mark % 200, dtype=np.uint8),
        "n": np.full(2, mark, dtype=np.int32),
        **override,
    }


def markers(name: str) -> set[int]:
    """The ``n`` of every stored episode (500 leased draws of 20 episodes find them all)."""
    with Reader(name, timeout=5) as reader, reader.sample_episodes(500) as episodes:
        return {int(ep["n"][0]) for ep in episodes}


def sigkill(d: Any) -> None:
    d.process.send_signal(signal.SIGKILL)
    d.process.wait(10)


def test_a_write_that_does_not_fit_fails_in_its_own_call_and_drops_no_neighbour(daemon):
    # int64 [300, -1] into uint8 passed validation and broke the copy later,
    # on another call: two committed episodes evicted and a batched neighbour never stored.
    # 2**40 + 5 into int32 was stored as 5.
    d = daemon(capacity=CAPACITY, unit="episode")
    with Writer(d.name, timeout=5, commit_delay=0.5) as writer:
        for n in range(20):
            writer.add_episode(episode(n))
        writer.flush()
        assert d.stats()["rows"] == CAPACITY
        writer.add_episode(episode(100))  # small: gathered, waiting for company
        with pytest.raises(SchemaError, match=r"'x'.*uint8"):
            writer.add_episode(episode(101, x=np.array([300, -1])))
        with pytest.raises(SchemaError, match=r"'x'.*uint8"):
            writer.add_episode(episode(102, x=torch.tensor([-1, 3])))
        with pytest.raises(SchemaError, match=r"'n'.*int32"):
            writer.add_episode(episode(103, n=np.array([2**40 + 5, 2**31])))
        # values that fit are stored, whatever their integer dtype
        writer.add_episode(episode(104, x=torch.tensor([4, 4]), n=np.array([104, 104])))
        writer.add_episode(episode(105, x=np.array([5, 5], dtype=np.int8)))
        writer.flush()
    stats = d.stats()
    assert (stats["rows"], stats["episodes"], stats["episodes_committed"]) == (CAPACITY, 20, 23)
    assert markers(d.name) == set(range(3, 20)) | {100, 104, 105}


class LostDevice(torch.Tensor):
    """Rows that cannot be read any more (a device gone mid-write): valid dtype and shape, so
    validation passes; the copy into the reserved rows fails."""

    def __getitem__(self, index: object) -> torch.Tensor:
        raise RuntimeError("device lost")


def test_a_copy_that_fails_after_reserve_gives_back_what_it_evicted_across_resume(daemon):
    # The rows a reservation evicted were gone when its copy failed; now its abort gives them
    # back, and the journal's RESTORE record keeps them across --resume.
    schema = {"x": np.zeros(2, dtype=np.float32), "n": np.zeros(2, dtype=np.int32)}
    d = daemon(capacity=CAPACITY, unit="episode")
    with Writer(d.name, timeout=5, batch_bytes=0) as writer:
        for n in range(20):
            writer.add_episode({**schema, "n": np.full(2, n, dtype=np.int32)})
        writer.flush()
        before = d.stats()
        lost = torch.zeros(6).as_subclass(LostDevice).requires_grad_()  # torch's copy path
        with pytest.raises(RuntimeError, match="device lost"):
            writer.add_episode({"x": lost, "n": np.arange(6, dtype=np.int32)})
        # the abort is not waited for; the daemon gives the three episodes back
        wait_for(lambda: d.stats()["reservations"] == 0, 5, what="the abort")
    after = d.stats()
    for key in ("rows", "episodes", "pointer", "episodes_committed"):
        assert after[key] == before[key], key
    assert markers(d.name) == set(range(20))
    sigkill(d)
    resumed = daemon(name=d.name, capacity=CAPACITY, unit="episode", args=["--resume"])
    assert resumed.stats()["episodes"] == 20
    assert markers(d.name) == set(range(20))


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs for ``--storage-dir``, so the journal's file system really fills up.
    Requested before ``daemon`` in a test's arguments, it is unmounted after the daemons stop."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(folder: Path) -> Path:
    """Take every free byte of ``folder``'s file system."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
        for _ in range(shutil.disk_usage(folder).free // 4096 + 1):
            f.write(b"\xff" * 4096)
    return filler


def test_acknowledged_commits_survive_a_full_journal_file_system_and_resume(small_fs, daemon):
    # ENOSPC surfaced as `internal`, a torn journal record was left in the middle, and
    # --resume dropped every episode acknowledged after it.
    args = ["--storage-dir", str(small_fs)]
    d = daemon(capacity=4000, unit="episode", args=args)
    acked = 0
    with Writer(d.name, timeout=5, batch_bytes=0, commit_delay=0) as writer:
        writer.add_episode({"v": np.zeros(1, dtype=np.int64)})
        writer.flush()
        acked = writer.episodes_committed
        filler = fill(small_fs)
        refused = None
        for n in range(1, 3000):  # the preallocated journal holds ~500; then a refusal
            try:
                writer.add_episode({"v": np.full(1, n, dtype=np.int64)})
                writer.flush()
            except OutOfSpaceError as exc:
                refused = exc
                break
            acked = writer.episodes_committed
        assert refused is not None, "the file system never filled"
        assert "journal" in str(refused) or "snapshot" in str(refused)
        assert d.stats()["episodes"] == acked  # nothing published that was not acknowledged
        filler.unlink()
        for n in range(10):  # space again: the same writer goes on
            writer.add_episode({"v": np.full(1, 10_000 + n, dtype=np.int64)})
        writer.flush()
        acked = writer.episodes_committed
    assert d.stats()["episodes"] == acked
    sigkill(d)
    resumed = daemon(name=d.name, capacity=4000, unit="episode", args=[*args, "--resume"])
    assert "0 torn bytes" in resumed.log()
    stats = resumed.stats()
    assert (stats["episodes"], stats["episodes_committed"]) == (acked, acked)


def test_reader_sample_takes_numpy_integers(daemon):
    # Reader.sample takes numpy integers, as Buffer does (np.int64(4) failed to serialise).
    d = daemon(capacity=100, unit="episode")
    with Writer(d.name, timeout=5) as writer:
        for n in range(3):
            writer.add_episode(episode(n))
    with Reader(d.name, timeout=5) as reader:
        assert reader.sample(np.int64(4))["n"].shape == (4,)
        assert reader.sample_slices(np.int32(2), np.int64(2))["n"].shape == (2, 2)
        with reader.sample_episodes(np.int64(2)) as episodes:
            assert len(episodes) == 2
        with pytest.raises(TypeError, match="batch_size must be an integer"):
            reader.sample(4.0)  # type: ignore[arg-type]
