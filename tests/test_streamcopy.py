"""The streaming copy into the ring (shmbuffer/storage/streamcopy.py): byte for byte numpy's."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmbuffer.storage import streamcopy

numba = pytest.importorskip("numba")

BLOCK = 64  # _copy_jit.BLOCK


@pytest.fixture(scope="module", autouse=True)
def loaded() -> Iterator[None]:
    """The loop loaded, and large gathers pinned to it (whatever this machine's trial chose:
    the tests below are about the streamed way)."""
    assert streamcopy.warm(), "numba is installed: the loop must load"
    decided = streamcopy.GATHER.streams
    streamcopy.GATHER.streams = True
    yield
    streamcopy.GATHER.streams = decided


def _pair(size: int, dst_shift: int, src_shift: int) -> tuple[np.ndarray, np.ndarray]:
    """uint8 arrays of ``size`` bytes whose starts lie ``*_shift`` bytes past a page."""
    dst_base = np.zeros(size + 2 * 4096, np.uint8)
    src_base = np.random.default_rng(size).integers(0, 256, size + 2 * 4096, dtype=np.uint8)
    d0 = -dst_base.ctypes.data % 4096 + dst_shift
    s0 = -src_base.ctypes.data % 4096 + src_shift
    return dst_base[d0 : d0 + size], src_base[s0 : s0 + size]


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(streamcopy.STREAM_MIN_BYTES, streamcopy.STREAM_MIN_BYTES + 3 * BLOCK + 7),
    dst_shift=st.integers(0, 4095),
    src_shift=st.integers(0, 4095),
)
def test_equals_numpy_at_every_alignment_and_direction(
    size: int, dst_shift: int, src_shift: int
) -> None:
    # the shifts cover both directions (dst - src just above a page multiple runs backward)
    dst, src = _pair(size, dst_shift, src_shift)
    base = dst.base
    assert isinstance(base, np.ndarray)
    before = base.copy()
    streamcopy.copy_into(dst, src)
    assert np.array_equal(dst, src)
    # nothing outside the destination changed
    start = dst.ctypes.data - base.ctypes.data
    assert np.array_equal(base[:start], before[:start])
    assert np.array_equal(base[start + size :], before[start + size :])


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((40, 4, 84, 84), np.uint8),
        ((3000, 64), np.float32),
        ((70_000,), np.int64),
        ((300_000,), np.bool_),
    ],
)
def test_rows_of_any_dtype(shape: tuple[int, ...], dtype: type) -> None:
    rng = np.random.default_rng(0)
    src: np.ndarray = (rng.random(shape) * 200).astype(dtype)
    ring: np.ndarray = np.zeros((shape[0] * 3, *shape[1:]), dtype)
    streamcopy.copy_into(ring[shape[0] + 1 : 2 * shape[0] + 1], src)
    assert np.array_equal(ring[shape[0] + 1 : 2 * shape[0] + 1], src)
    assert not ring[: shape[0] + 1].any() and not ring[2 * shape[0] + 1 :].any()


def test_what_cannot_stream_is_numpys_copy() -> None:
    n = streamcopy.STREAM_MIN_BYTES
    ring = np.zeros(2 * n, np.int64)
    # a cast (validated by the caller), a strided source, a small copy, a list
    wide = np.arange(n, dtype=np.int32)
    streamcopy.copy_into(ring[:n], wide)
    assert np.array_equal(ring[:n], wide)
    strided = np.arange(2 * n, dtype=np.int64)[::2]
    streamcopy.copy_into(ring[n:], strided)
    assert np.array_equal(ring[n:], strided)
    streamcopy.copy_into(ring[:3], [7, 8, 9])
    assert ring[:3].tolist() == [7, 8, 9]
    # overlapping source and destination: memmove's result, as numpy gives it
    data = np.arange(n, dtype=np.int64)
    expected = data.copy()
    expected[8:] = data[:-8].copy()
    streamcopy.copy_into(data[8:], data[:-8])
    assert np.array_equal(data, expected)


def test_small_rows_do_not_load_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streamcopy._Loop, "compiled", None)
    assert not streamcopy.warm(row_nbytes=streamcopy.STREAM_ROW_BYTES - 1)
    assert streamcopy._Loop.compiled is None
    assert streamcopy.warm(row_nbytes=streamcopy.STREAM_ROW_BYTES)


def test_jit_off_keeps_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streamcopy._Loop, "compiled", None)
    monkeypatch.setenv("SHMBUFFER_JIT", "0")
    streamcopy.kernels.cache_clear()
    try:
        assert not streamcopy.warm()
        src = np.arange(streamcopy.STREAM_MIN_BYTES, dtype=np.uint8)
        dst = np.zeros_like(src)
        streamcopy.copy_into(dst, src)
        assert np.array_equal(dst, src)
    finally:
        streamcopy.kernels.cache_clear()


def test_a_large_contiguous_copy_takes_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    compiled = streamcopy.kernels()
    assert compiled is not None
    calls: list[bool] = []

    def counted(dst: np.ndarray, src: np.ndarray, backward: bool) -> None:
        calls.append(backward)
        compiled.stream(dst, src, backward)

    monkeypatch.setattr(
        streamcopy._Loop,
        "compiled",
        type("Loop", (), {"BLOCK": BLOCK, "stream": staticmethod(counted)}),
    )
    n = streamcopy.STREAM_MIN_BYTES
    dst, src = _pair(n, 0, 16)  # dst - src = -16 (mod 4096): forward
    streamcopy.copy_into(dst, src)
    dst2, src2 = _pair(n, 16, 0)  # dst - src = +16: each forward load would alias, backward
    streamcopy.copy_into(dst2, src2)
    streamcopy.copy_into(dst[: n // 2], src[: n // 2])  # below the cut-off: numpy
    assert calls == [False, True]
    assert np.array_equal(dst, src) and np.array_equal(dst2, src2)


def test_a_loop_that_cannot_be_built_leaves_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(dst: np.ndarray, src: np.ndarray, backward: bool) -> None:
        raise RuntimeError("Intrinsic called with incompatible signature")

    monkeypatch.setattr(streamcopy._Loop, "compiled", None)
    monkeypatch.setattr(streamcopy._Loop, "failed", None)
    fake = type("Loop", (), {"BLOCK": BLOCK, "stream": staticmethod(broken)})
    monkeypatch.setattr(streamcopy, "kernels", lambda: fake)
    assert not streamcopy.warm()
    assert streamcopy._Loop.failed is not None and "incompatible" in streamcopy._Loop.failed
    src = np.arange(streamcopy.STREAM_MIN_BYTES, dtype=np.uint8)
    dst = np.zeros_like(src)
    streamcopy.copy_into(dst, src)  # numpy's copy, not the broken loop
    assert np.array_equal(dst, src)


# -- gathers: a learner's batch of large rows -------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    row_bytes=st.integers(streamcopy.STREAM_ROW_BYTES, 3 * streamcopy.STREAM_ROW_BYTES + 7),
    seed=st.integers(0, 2**32),
    out_shift=st.one_of(st.none(), st.integers(0, 4095)),
)
def test_a_gather_of_large_rows_equals_take(
    row_bytes: int, seed: int, out_shift: int | None
) -> None:
    # rows of any size (not only whole cache lines), in any order, repeated; into a fresh
    # array or into a caller's ``out`` at any offset, with bytes around it left alone
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, (200, row_bytes), dtype=np.uint8)
    rows = rng.integers(0, 200, streamcopy.STREAM_MIN_BYTES // row_bytes + 5).astype(np.int64)
    assert streamcopy._streams(src, rows.size, None)
    if out_shift is None:
        got = streamcopy.gather_into(src, rows)
        assert got.ctypes.data % BLOCK == 0
    else:
        base = np.zeros(rows.size * row_bytes + 8192, np.uint8)
        start = -base.ctypes.data % 4096 + out_shift
        out = base[start : start + rows.size * row_bytes].reshape(rows.size, row_bytes)
        got = streamcopy.gather_into(src, rows, out)
        assert got is out
        assert not base[:start].any() and not base[start + out.nbytes :].any()
    assert np.array_equal(got, src[rows])


def test_a_gather_keeps_dtype_and_row_shape() -> None:
    src = np.random.default_rng(0).integers(0, 255, (50, 4, 84, 84), dtype=np.uint8)
    rows = np.array([3, 49, 0, 3] * 4, dtype=np.int64)
    got = streamcopy.gather_into(src, rows)
    assert got.shape == (16, 4, 84, 84) and got.dtype == np.uint8
    assert np.array_equal(got, src[rows])
    wide = np.random.default_rng(1).standard_normal((40, 1024)).astype(np.float32)
    assert np.array_equal(
        streamcopy.gather_into(wide, rows[rows < 40].repeat(8)), wide[rows[rows < 40].repeat(8)]
    )


def test_small_gathers_and_odd_outs_stay_with_take() -> None:
    rng = np.random.default_rng(2)
    src = rng.integers(0, 255, (100, 8192), dtype=np.uint8)
    few = np.array([1, 2], dtype=np.int64)  # 16 KiB in all: below STREAM_MIN_BYTES
    many = rng.integers(0, 100, 64).astype(np.int64)
    small = rng.standard_normal((1000, 64)).astype(np.float32)  # 256 B rows
    assert not streamcopy._streams(src, few.size, None)
    assert not streamcopy._streams(small, 1000, None)
    assert not streamcopy._streams(src[:, ::2], many.size, None)  # not contiguous
    assert not streamcopy._streams(src, many.size, src)  # out overlaps the rows
    wrong = np.zeros((64, 8192), np.int8)
    assert not streamcopy._streams(src, many.size, wrong)  # another dtype: take casts
    assert np.array_equal(streamcopy.gather_into(src, few), src[few])
    assert np.array_equal(streamcopy.gather_into(small, many), small[many])
    assert np.array_equal(streamcopy.gather_into(src[:, ::2], many), src[:, ::2][many])


def test_copy_out_is_a_fresh_copy_streamed_when_large() -> None:
    src = np.random.default_rng(3).integers(0, 255, (40, 4, 84, 84), dtype=np.uint8)
    for part in (src[1:39], src[:2], src[:, :, :, ::2]):  # streamed; small; not contiguous
        got = streamcopy.copy_out(part)
        assert np.array_equal(got, part) and got.dtype == part.dtype
        assert not np.may_share_memory(got, src)
    assert streamcopy.copy_out(src[1:39]).ctypes.data % BLOCK == 0


def test_a_streamed_gather_refuses_a_row_out_of_range() -> None:
    src = np.zeros((100, 8192), np.uint8)
    rows = np.arange(64, dtype=np.int64)
    rows[40] = 100
    assert streamcopy._streams(src, rows.size, None)
    with pytest.raises(IndexError, match="row 100 is out of range for 100 rows"):
        streamcopy.gather_into(src, rows)
    rows[40] = -1
    with pytest.raises(IndexError, match="row -1"):
        streamcopy.gather_into(src, rows)


def test_the_gather_trial_keeps_the_faster_way_and_a_tie_streams() -> None:
    """Each way in turn until the trial is done, then the one with the lower median seconds
    per byte, whichever it is; at equal speed, streamed."""
    for take, streamed, expect in ((2.0, 1.0, True), (1.0, 2.0, False), (1.0, 1.0, True)):
        trial = streamcopy.GatherTrial()
        ways = []
        while trial.streams is None:
            way = trial.next_streams()
            ways.append(way)
            trial.record(way, streamed if way else take, 1)
        assert ways == [True, False] * (trial.TRIAL_CALLS // 2)
        assert trial.streams is expect and trial.next_streams() is expect


def test_gathers_made_during_the_trial_equal_take_either_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trial = streamcopy.GatherTrial()
    monkeypatch.setattr(streamcopy, "GATHER", trial)
    rng = np.random.default_rng(4)
    src = rng.integers(0, 255, (300, 8192), dtype=np.uint8)
    for _ in range(trial.TRIAL_CALLS + 2):
        rows = rng.integers(0, 300, 64).astype(np.int64)
        assert np.array_equal(streamcopy.gather_into(src, rows), src[rows])
    assert trial.streams is not None
    assert [len(t) for t in trial.seconds_per_byte] == [trial.TRIAL_CALLS // 2] * 2
