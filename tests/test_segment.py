"""Segments: named shared memory, manifest, modes, names, space checks, two processes."""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import queue
import shutil
import stat
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from shmbuffer.errors import (
    InvalidNameError,
    NotFoundError,
    OutOfSpaceError,
    SchemaError,
    SegmentError,
)
from shmbuffer.storage import segment as segment_module
from shmbuffer.storage.schema import Schema
from shmbuffer.storage.segment import (
    ALIGN,
    FORMAT_VERSION,
    LocalSegment,
    Segment,
    default_storage_dir,
    segment_path,
    validate_name,
)

REPO = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).resolve().parent / "_segment_child.py"

SMALL = Schema.from_spec(
    {"obs": {"dtype": "uint8", "shape": [3, 4]}, "next": {"reward": {"dtype": "float32"}}}
)
ALL_DTYPES = Schema.from_spec(
    {
        "flag": {"dtype": "bool"},
        "img": {"dtype": "uint8", "shape": [2, 3, 4]},
        "i8": {"dtype": "int8", "shape": [5]},
        "i16": {"dtype": "int16"},
        "i32": {"dtype": "int32", "shape": [1]},
        "idx": {"dtype": "int64"},
        "half": {"dtype": "float16", "shape": [3]},
        "bf": {"dtype": "bfloat16", "shape": [2, 2]},
        "f32": {"dtype": "float32", "shape": [7]},
        "f64": {"dtype": "float64"},
        "c64": {"dtype": "complex64", "shape": [2]},
        "c128": {"dtype": "complex128"},
        "next": {"obs": {"dtype": "uint8", "shape": [2, 3, 4]}, "done": {"dtype": "bool"}},
        "deep": {"er": {"leaf": {"dtype": "int64", "shape": [2]}}},
        "empty": {"dtype": "float32", "shape": [0]},
    }
)


@pytest.fixture
def storage(tmp_path: Path) -> Iterator[Path]:
    """A private storage root on tmpfs when there is one, removed afterwards."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        root = shm / f"shmbuffer-test-{uuid.uuid4().hex}"
    else:
        root = tmp_path / "shm"
    try:
        yield root / "shmbuffer"  # one level down, so create() makes the storage root itself
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def name() -> str:
    return f"seg-{uuid.uuid4().hex[:12]}"


def fill(seg: Segment | LocalSegment, seed: int) -> None:
    """Deterministic, dtype-appropriate contents in every column."""
    g = torch.Generator().manual_seed(seed)
    for key, col in seg.columns.items():
        if col.dtype == torch.bool:
            col.copy_(torch.rand(col.shape, generator=g) > 0.5)
        elif col.dtype.is_floating_point or col.dtype.is_complex:
            col.copy_(torch.randn(col.shape, generator=g, dtype=torch.float64).to(col.dtype))
        else:
            col.copy_(torch.randint(0, 100, col.shape, generator=g).to(col.dtype))
        assert key in seg.schema


# -- create / attach / unlink --------------------------------------------------------------


def test_round_trip_same_memory(storage: Path, name: str) -> None:
    assert not Segment.exists(name, storage)
    a = Segment.create(name, SMALL, 10, storage_dir=storage)
    assert Segment.exists(name, storage)
    a.data["obs"][2] = 7
    a.columns[("next", "reward")][2] = 1.25
    b = Segment.attach(name, storage_dir=storage)
    assert b.schema == SMALL and b.capacity == 10 and b.nbytes == a.nbytes
    for key in SMALL:
        ca, cb = a.columns[key.key], b.columns[key.key]
        assert ca.data_ptr() != cb.data_ptr()  # two mappings ...
        assert torch.equal(ca, cb)  # ... of the same memory
    assert b.data["next", "reward"][2].item() == 1.25
    b.arrays[("obs",)][5] = 9  # writes through numpy views are shared too
    assert torch.all(a.data["obs"][5] == 9)
    a.generations[3] += 2  # the per-row stamps are shared as well, outside the schema
    assert b.generations.dtype == np.int64 and b.generations.shape == (10,)
    assert b.generations.tolist() == [0, 0, 0, 2, 0, 0, 0, 0, 0, 0]
    assert a.data["obs"].data_ptr() == a.columns[("obs",)].data_ptr()
    assert np.shares_memory(a.arrays[("obs",)], a.columns[("obs",)].numpy())
    a.close()
    b.close()
    assert Segment.unlink(name, storage) is True
    assert not Segment.exists(name, storage)
    assert Segment.unlink(name, storage) is False


def test_all_dtypes_nested_and_shapes(storage: Path, name: str) -> None:
    with Segment.create(name, ALL_DTYPES, 33, storage_dir=storage) as a:
        fill(a, 1)
        with Segment.attach(name, storage_dir=storage) as b:
            assert b.data.batch_size == torch.Size([33])
            for field in ALL_DTYPES:
                col = b.columns[field.key]
                assert col.dtype == field.dtype and col.shape == (33, *field.shape)
                assert torch.equal(col, a.columns[field.key])
                assert b.data[field.key].data_ptr() == col.data_ptr()
                offset = b.manifest["columns"][".".join(field.key)]["offset"]
                assert offset % ALIGN == 0
                arr = b.arrays[field.key]
                assert arr.shape == col.shape
                if field.dtype == torch.bfloat16:  # no numpy bfloat16: raw bits as uint16
                    assert arr.dtype == np.uint16
                    assert torch.equal(torch.from_numpy(arr).view(torch.bfloat16), col)
                else:
                    assert np.array_equal(arr, col.numpy())
            assert b.data["deep", "er", "leaf"].shape == (33, 2)
            assert b.arrays[("flag",)].dtype == np.bool_


def test_manifest(storage: Path, name: str) -> None:
    seg = Segment.create(name, SMALL, 5, storage_dir=storage, extra={"mode": "circular"})
    on_disk = json.loads((seg.path / "manifest.json").read_text())
    assert on_disk == seg.manifest
    assert on_disk["format_version"] == FORMAT_VERSION
    assert on_disk["name"] == name and on_disk["capacity"] == 5
    assert Schema.from_spec(on_disk["schema"]) == SMALL
    assert on_disk["extra"] == {"mode": "circular"}
    assert on_disk["pid"] == os.getpid() and on_disk["host"] and on_disk["created"] > 0
    assert on_disk["columns"]["obs"] == {"offset": 4096, "nbytes": 60}
    assert on_disk["columns"]["next.reward"] == {"offset": 0, "nbytes": 20}
    assert on_disk["generations"] == {"offset": 8192, "nbytes": 40}
    data = seg.path / on_disk["data_file"]
    assert data.stat().st_size == on_disk["size"] == seg.nbytes == 12288
    assert sorted(p.name for p in seg.path.iterdir()) == ["data.bin", "manifest.json"]
    assert Segment.attach(name, storage_dir=storage).manifest["extra"] == {"mode": "circular"}


def test_create_twice_refused_and_exist_ok_replaces(storage: Path, name: str) -> None:
    old = Segment.create(name, SMALL, 4, storage_dir=storage)
    old.data["obs"][:] = 3
    with pytest.raises(SegmentError, match="already exists") as err:
        Segment.create(name, SMALL, 4, storage_dir=storage)
    assert str(segment_path(name, storage)) in str(err.value)
    new = Segment.create(name, ALL_DTYPES, 8, storage_dir=storage, exist_ok=True)
    assert new.capacity == 8 and torch.all(new.data["img"] == 0)
    assert Segment.attach(name, storage_dir=storage).schema == ALL_DTYPES
    assert torch.all(old.data["obs"] == 3)  # the old mapping stays valid after the replace


def test_attach_errors(storage: Path, name: str) -> None:
    with pytest.raises(SegmentError, match="no segment") as err:
        Segment.attach(name, storage_dir=storage)
    assert isinstance(err.value, NotFoundError)
    assert str(segment_path(name, storage)) in str(err.value)

    seg = Segment.create(name, SMALL, 4, storage_dir=storage)
    manifest = seg.path / "manifest.json"
    spec = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**spec, "format_version": FORMAT_VERSION + 1}))
    with pytest.raises(SegmentError, match="format_version 2"):
        Segment.attach(name, storage_dir=storage)
    manifest.write_text("{not json")
    with pytest.raises(SegmentError, match="unreadable manifest"):
        Segment.attach(name, storage_dir=storage)
    manifest.write_text(json.dumps({**spec, "columns": {"obs": {"offset": 1, "nbytes": 9}}}))
    with pytest.raises(SegmentError, match="inconsistent"):
        Segment.attach(name, storage_dir=storage)
    manifest.write_text(json.dumps(spec))
    os.truncate(seg.path / "data.bin", 100)  # a short file would SIGBUS when touched
    with pytest.raises(SegmentError, match="shorter"):
        Segment.attach(name, storage_dir=storage)
    manifest.unlink()
    with pytest.raises(SegmentError, match=r"no manifest\.json"):
        Segment.attach(name, storage_dir=storage)


def test_half_made_segment_blocks_create(storage: Path, name: str) -> None:
    segment_path(name, storage).mkdir(parents=True)  # a creator that died before its manifest
    assert Segment.exists(name, storage)
    with pytest.raises(SegmentError, match="already exists"):
        Segment.create(name, SMALL, 4, storage_dir=storage)
    Segment.create(name, SMALL, 4, storage_dir=storage, exist_ok=True)
    Segment.attach(name, storage_dir=storage)


def test_close_keeps_live_views_valid(storage: Path, name: str) -> None:
    seg = Segment.create(name, SMALL, 4, storage_dir=storage)
    obs = seg.data["obs"]
    arr = seg.arrays[("obs",)]
    seg.close()
    seg.close()
    assert seg.columns == {} and seg.arrays == {}
    Segment.unlink(name, storage)
    obs[1] = 5  # still mapped: the views keep the mapping alive, even after unlink
    assert arr[1].sum() == 5 * 12


def resident(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s pages mapped in this process (``mincore``), rounded to pages."""
    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    pages = -(-(tensor.data_ptr() + tensor.nbytes - start) // page)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(start, pages * page, vec) == 0, os.strerror(ctypes.get_errno())
    return sum(b & 1 for b in vec) * page


MB_ROWS = Schema.from_spec({"obs": {"dtype": "uint8", "shape": [1 << 16]}})  # 64 KiB rows


@pytest.mark.parametrize("prefault", [True, False])
def test_create_reserves_every_page(storage: Path, name: str, prefault: bool) -> None:
    with Segment.create(name, MB_ROWS, 64, storage_dir=storage, prefault=prefault) as seg:
        obs = seg.columns[("obs",)]
        data = seg.path / "data.bin"
        assert data.stat().st_blocks * 512 >= seg.nbytes  # every page allocated in tmpfs
        if prefault:  # populated (and zeroed) now, not during the first pass of writes
            assert resident(obs) == obs.nbytes
        assert not obs.any()
        obs[-1] = 3
        with Segment.attach(name, storage_dir=storage) as other:
            assert torch.all(other.columns[("obs",)][-1] == 3)


def test_a_full_disk_during_reservation_cleans_up(
    storage: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fallocate(fd: int, offset: int, length: int) -> None:
        # the space was taken by someone else after the free-space check passed
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segment_module.os, "posix_fallocate", fallocate)
    with pytest.raises(OutOfSpaceError, match="no space"):
        Segment.create(name, MB_ROWS, 64, storage_dir=storage)
    assert not Segment.exists(name, storage)


def test_prefault_off(storage: Path, name: str) -> None:
    with Segment.create(name, SMALL, 4, storage_dir=storage, prefault=False) as a:
        a.data["obs"][0] = 1
        with Segment.attach(name, storage_dir=storage, prefault=False) as b:
            assert torch.all(b.data["obs"][0] == 1)


# -- files on disk --------------------------------------------------------------------------


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_file_modes_default(storage: Path, name: str) -> None:
    old = os.umask(0)  # the modes must not depend on the umask
    try:
        seg = Segment.create(name, SMALL, 4, storage_dir=storage)
    finally:
        os.umask(old)
    assert mode(storage) == 0o700
    assert mode(seg.path) == 0o700
    assert mode(seg.path / "data.bin") == 0o600
    assert mode(seg.path / "manifest.json") == 0o600


def test_file_modes_group(storage: Path, name: str) -> None:
    gid = os.getgid()
    seg = Segment.create(name, SMALL, 4, storage_dir=storage, file_mode=0o640, group=gid)
    assert mode(seg.path) == 0o750
    for f in ("data.bin", "manifest.json"):
        assert mode(seg.path / f) == 0o640
        assert (seg.path / f).stat().st_gid == gid


def test_private_root_is_opened_to_the_group(storage: Path, name: str) -> None:
    """A root of ours made owner-only (a daemon without --group was first) becomes
    traversable by the group of a --group segment, whose members must reach it."""
    storage.mkdir(parents=True, mode=0o700)
    os.chmod(storage, 0o700)
    gid = os.getgid()
    Segment.create(name, SMALL, 4, storage_dir=storage, file_mode=0o660, group=gid)
    assert mode(storage) == 0o750
    assert storage.stat().st_gid == gid


def test_unusable_root_is_a_segment_error_naming_it(storage: Path, name: str) -> None:
    storage.parent.mkdir(parents=True)
    storage.write_text("not a folder")  # so is a root another user made 0700: EACCES
    with pytest.raises(SegmentError) as err:
        Segment.create(name, SMALL, 4, storage_dir=storage)
    assert str(storage / name) in str(err.value)


@pytest.mark.parametrize(
    "bad", ["", ".", "..", ".hidden", "a/b", "../up", "/abs", "a\0b", "a b", "é", "x" * 65]
)
def test_invalid_names(storage: Path, bad: str) -> None:
    with pytest.raises(InvalidNameError) as err:
        validate_name(bad)
    assert repr(bad) in str(err.value) and "[A-Za-z0-9_.-]" in str(err.value)
    assert isinstance(err.value, SegmentError) and isinstance(err.value, ValueError)
    with pytest.raises(InvalidNameError):
        Segment.create(bad, SMALL, 4, storage_dir=storage)
    with pytest.raises(InvalidNameError):
        Segment.attach(bad, storage_dir=storage)
    with pytest.raises(InvalidNameError):
        Segment.unlink(bad, storage)
    assert not storage.exists()


@pytest.mark.parametrize("good", ["a", "A-b_c.1", "x" * 64, "run.0..1"])
def test_valid_names(good: str) -> None:
    assert validate_name(good) == good


def test_storage_dir_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SHMBUFFER_STORAGE_DIR", raising=False)
    uid = os.getuid()  # per user: one user's owner-only root must not lock the others out
    assert default_storage_dir() == Path(f"/dev/shm/shmbuffer-{uid}")
    assert segment_path("b") == Path(f"/dev/shm/shmbuffer-{uid}/b")
    monkeypatch.setenv("SHMBUFFER_STORAGE_DIR", str(tmp_path))
    assert segment_path("b") == tmp_path / "b"
    assert segment_path("b", "/elsewhere") == Path("/elsewhere/b")


def test_out_of_space_refused_before_allocating(storage: Path, name: str) -> None:
    st = os.statvfs(storage.parent.parent)
    free = st.f_bavail * st.f_frsize
    schema = Schema.from_spec({"obs": {"dtype": "uint8", "shape": [1 << 20]}})
    with pytest.raises(OutOfSpaceError) as err:
        Segment.create(name, schema, free // (1 << 20) + 16, storage_dir=storage)
    assert "needs" in str(err.value) and "free" in str(err.value)
    assert not Segment.exists(name, storage)
    assert not storage.exists()  # refused before a folder was made


def test_bad_extra_or_capacity_leaves_nothing(storage: Path, name: str) -> None:
    with pytest.raises(SegmentError, match="JSON"):
        Segment.create(name, SMALL, 4, storage_dir=storage, extra={"x": object()})
    with pytest.raises(SegmentError, match="capacity"):
        Segment.create(name, SMALL, 0, storage_dir=storage)
    assert not storage.exists()


def test_leaf_and_group_conflict_cleans_up(storage: Path, name: str) -> None:
    schema = Schema.from_spec({"a": {"dtype": "uint8"}, "a.b": {"dtype": "uint8"}})
    with pytest.raises(SchemaError, match="'a"):
        Segment.create(name, schema, 4, storage_dir=storage)
    assert not Segment.exists(name, storage)


# -- two unrelated processes ----------------------------------------------------------------


def _expect(lines: queue.Queue[str], want: str, timeout: float = 60.0) -> None:
    try:
        got = lines.get(timeout=timeout)
    except queue.Empty:
        pytest.fail(f"child said nothing within {timeout}s (wanted {want!r})")
    assert got == want, f"child said {got!r}, wanted {want!r}"


def test_two_processes_share_rows(storage: Path, name: str) -> None:
    seg = Segment.create(name, SMALL, 32, storage_dir=storage)
    obs, reward = seg.columns[("obs",)], seg.columns[("next", "reward")]
    for i in range(8):
        obs[i] = i
        reward[i] = i * 0.5
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    child = subprocess.Popen(
        [sys.executable, str(CHILD), name, str(storage)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )
    lines: queue.Queue[str] = queue.Queue()
    assert child.stdout is not None and child.stdin is not None
    stdout = child.stdout

    def read() -> None:
        for line in stdout:
            lines.put(line.strip())
        lines.put("<eof: the child exited>")  # fail at once rather than at the timeout

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        _expect(lines, "done")  # the child checked rows 0..7 and wrote rows 8..15
        for i in range(8, 16):
            assert torch.all(obs[i] == 100 + i), i
            assert reward[i].item() == -float(i)
        assert torch.all(obs[16:] == 0)
        obs[0] = 77  # both still mapped: the child sees this at once
        child.stdin.write("check\n")
        child.stdin.flush()
        _expect(lines, "ok")
        child.stdin.write("bye\n")
        child.stdin.flush()
        assert child.wait(timeout=30) == 0
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=30)
        reader.join(timeout=30)  # EOF once the child is gone
        child.stdin.close()
        stdout.close()


# -- in-process -----------------------------------------------------------------------------


def test_local_segment() -> None:
    with LocalSegment(ALL_DTYPES, 6) as seg:
        assert seg.data.batch_size == torch.Size([6])
        assert seg.nbytes == 6 * ALL_DTYPES.row_nbytes
        for field in ALL_DTYPES:
            col = seg.columns[field.key]
            assert col.shape == (6, *field.shape) and col.dtype == field.dtype
            assert not col.any()  # zero-filled like a fresh shared segment
            assert seg.data[field.key].data_ptr() == col.data_ptr()
        fill(seg, 2)
        seg.arrays[("idx",)][3] = 42
        assert seg.data["idx"][3].item() == 42
        assert seg.arrays[("bf",)].dtype == np.uint16
        assert seg.generations.tolist() == [0] * 6
    assert seg.columns == {}
    assert LocalSegment(SMALL, 3, prefault=False).columns[("obs",)].shape == (3, 3, 4)
    with pytest.raises(SegmentError):
        LocalSegment(SMALL, 0)


@pytest.mark.parametrize("prefault", [True, False])
def test_local_segment_reserves_every_page(prefault: bool) -> None:
    with LocalSegment(MB_ROWS, 64, prefault=prefault) as seg:
        obs = seg.columns[("obs",)]
        assert resident(obs) == (obs.nbytes if prefault else 0)
        assert not obs.any() and not seg.generations.any()
        obs[5] = 1
        assert seg.arrays[("obs",)][5].sum() == 1 << 16


def test_local_segment_larger_than_memory_is_refused() -> None:
    with open("/proc/meminfo") as f:
        total = int(f.readline().split()[1]) * 1024  # MemTotal
    rows = 2 * total // (1 << 16)
    with pytest.raises(OutOfSpaceError, match="memory available") as err:
        LocalSegment(MB_ROWS, rows)
    assert f"{rows:,} rows" in str(err.value) and "capacity" in str(err.value)
