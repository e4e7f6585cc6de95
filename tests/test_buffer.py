"""The in-process Buffer, including a regression test for each seed defect in DESIGN.md."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shmbuffer import Buffer
from shmbuffer.errors import CapacityError, SchemaError
from shmbuffer.storage.segment import Segment


def ep(value: int, length: int = 4) -> dict[str, torch.Tensor]:
    return {"x": torch.full((length,), value, dtype=torch.int64), "t": torch.arange(length)}


def test_episode_order_is_chronological_and_stable() -> None:
    # Seed: episode order came from iterating a set of intervals.
    buf = Buffer(100, unit="episode")
    for v in [5, 3, 9, 1, 7]:
        buf.add_episode(ep(v))
    assert [int(buf[i]["x"][0]) for i in range(5)] == [5, 3, 9, 1, 7]
    assert int(buf[-1]["x"][0]) == 7 and int(buf[-5]["x"][0]) == 5


def test_negative_indices_count_from_the_newest_stored_row() -> None:
    # Seed: negative indices and slices were normalised against capacity, not size.
    buf = Buffer(100)
    buf.extend({"x": torch.arange(10)})
    assert int(buf[-1]["x"]) == 9
    assert buf[-3:]["x"].tolist() == [7, 8, 9]
    assert buf[[-1, 0]]["x"].tolist() == [9, 0]


def test_out_of_range_indices_raise_and_never_read_unwritten_rows() -> None:
    # Seed: array indices skipped the range check and read uninitialised rows.
    buf = Buffer(100)
    buf.extend({"x": torch.arange(10)})
    for bad in (10, -11, [0, 10], np.array([3, 50]), torch.tensor([99])):
        with pytest.raises(IndexError):
            buf[bad]  # type: ignore[index]
    episodes = Buffer(100, unit="episode")
    episodes.add_episode(ep(1))
    with pytest.raises(IndexError):
        episodes[np.array([0, 1])]


@settings(max_examples=200, deadline=None)
@given(
    size=st.integers(0, 50),
    index=st.lists(st.integers(-60, 60), max_size=20),
    dtype=st.sampled_from([np.int64, np.int32, np.int16, np.uint8]),
)
def test_index_arrays_wrap_negatives_and_refuse_the_rest(
    size: int, index: list[int], dtype: type
) -> None:
    """``normalize_index`` against the rule it implements, in Python integers: a position in
    ``[-size, size)`` wraps to ``[0, size)``; one outside raises IndexError naming it; floats
    and bool masks raise; the caller's array is never changed."""
    from shmbuffer.buffer import normalize_index

    info = np.iinfo(dtype)
    index = [i for i in index if info.min <= i <= info.max]
    given_array = np.array(index, dtype=dtype)
    before = given_array.copy()
    if all(-size <= i < size for i in index):
        positions, scalar = normalize_index(given_array, size)
        assert positions.dtype == np.int64 and not scalar
        assert positions.tolist() == [i % size for i in index]
    else:
        with pytest.raises(IndexError, match="out of range"):
            normalize_index(given_array, size)
    assert np.array_equal(given_array, before)
    if index:
        for wrong in (given_array.astype(np.float64), given_array > 0):
            with pytest.raises(IndexError, match="must be integers"):
                normalize_index(wrong, size)


def test_use_counters_count_duplicate_indices() -> None:
    # Seed: `counter[idx] += 1` counted a repeated index once.
    buf = Buffer(10)
    buf.extend({"x": torch.arange(5)})
    buf[[1, 1, 1, 2]]
    assert buf.use_counts[:5].tolist() == [0, 3, 1, 0, 0]
    assert buf.use_counts[5:].tolist() == [-1] * 5


def test_zero_length_writes_warn_instead_of_crashing() -> None:
    # Seed: a zero-length episode crashed the interval tree.
    buf = Buffer(10, unit="episode")
    buf.add_episode(ep(1))
    with pytest.warns(RuntimeWarning, match="zero rows"):
        assert buf.add_episode(ep(2, length=0)) == []
    assert len(buf) == 1


def test_float_into_int_column_is_refused_and_nothing_changes() -> None:
    # Seed: a float pushed into an int schema was silently truncated.
    buf = Buffer(10)
    buf.extend({"x": torch.arange(3)})
    with pytest.raises(SchemaError, match=r"'x'.*float32.*int64"):
        buf.extend({"x": torch.tensor([1.5, 2.5])})
    assert buf[:]["x"].tolist() == [0, 1, 2] and len(buf) == 3


def test_schema_errors_name_the_key_and_shapes() -> None:
    buf = Buffer(10, schema={"obs": {"dtype": "float32", "shape": [4]}})
    with pytest.raises(SchemaError, match=r"'obs'.*\[3\].*\[4\]"):
        buf.extend({"obs": torch.zeros(2, 3)})
    with pytest.raises(SchemaError, match="'other' is not in the schema"):
        buf.extend({"other": torch.zeros(2, 4)})
    with pytest.raises(SchemaError, match="missing keys: \\['obs'\\]"):
        Buffer(
            10, schema={"obs": {"dtype": "float32", "shape": [4]}, "r": {"dtype": "float32"}}
        ).extend({"r": torch.zeros(2)})
    with pytest.raises(SchemaError, match="'extra' is not in the schema"):
        buf.extend({"obs": torch.zeros(2, 4), "extra": torch.zeros(2)})
    assert len(buf) == 0


def test_unknown_mode_or_unit_is_refused() -> None:
    # Seed: an unknown mode was accepted and then wrote out of bounds.
    with pytest.raises(ValueError, match="mode"):
        Buffer(10, mode="standard")
    with pytest.raises(ValueError, match="unit"):
        Buffer(10, unit="step")


def test_reads_are_copies_safe_from_later_writes() -> None:
    # Seed: reads returned views that later writes tore.
    buf = Buffer(4, unit="episode")
    buf.add_episode(ep(1, 4))
    first = buf[0]
    buf.add_episode(ep(2, 4))  # overwrites the same rows
    assert first["x"].tolist() == [1, 1, 1, 1]


def test_episode_unit_evicts_whole_episodes_fifo_with_early_wrap() -> None:
    buf = Buffer(10, unit="episode")
    ids = [buf.add_episode(ep(v, 4))[0] for v in range(3)]  # rows 0-4, 4-8, then wrap
    assert len(buf) == 2 and [int(buf[i]["x"][0]) for i in range(2)] == [1, 2]
    assert ids == [0, 1, 2]


def test_transition_unit_ring_keeps_the_newest_rows_in_order() -> None:
    buf = Buffer(10)
    buf.extend({"x": torch.arange(7)})
    buf.extend({"x": torch.arange(100, 107)})
    assert buf[:]["x"].tolist() == [4, 5, 6, *range(100, 107)]


def test_fixed_mode_refuses_when_full_and_keeps_data() -> None:
    buf = Buffer(6, mode="fixed")
    buf.extend({"x": torch.arange(6)})
    with pytest.raises(CapacityError):
        buf.extend({"x": torch.arange(1)})
    assert buf[:]["x"].tolist() == list(range(6))


def test_episode_longer_than_capacity_keeps_its_tail() -> None:
    buf = Buffer(5, unit="episode")
    with pytest.warns(RuntimeWarning, match="keeping the last 5"):
        buf.add_episode({"x": torch.arange(8)})
    assert buf[0]["x"].tolist() == [3, 4, 5, 6, 7]


def test_vector_episode_becomes_one_episode_per_sub_env() -> None:
    buf = Buffer(20, unit="episode")
    block = {"x": torch.arange(6).reshape(3, 2)}  # [L=3, num_envs=2]
    assert len(buf.add_episode(block, num_envs=2)) == 2
    assert buf[0]["x"].tolist() == [0, 2, 4] and buf[1]["x"].tolist() == [1, 3, 5]


def test_transitions_assemble_into_episodes_per_env() -> None:
    buf = Buffer(50, unit="episode")
    for t in range(3):
        buf.add_transition("a", {"x": t, "terminated": t == 2, "truncated": False})
        buf.add_transition("b", {"x": 10 + t, "terminated": False, "truncated": False})
    assert len(buf) == 1 and buf[0]["x"].tolist() == [0, 1, 2]
    buf.end_episode("b")
    buf.end_episode("b")  # idempotent
    assert len(buf) == 2 and buf[1]["x"].tolist() == [10, 11, 12]


def test_sampling_shapes_and_boundaries() -> None:
    buf = Buffer(200, unit="episode", seed=0)
    for v in range(5):
        buf.add_episode(ep(v, 20))
    assert buf.sample(64)["x"].shape == (64,)
    assert buf.sample_episodes(3)["x"].shape == (3, 20)
    slices = buf.sample_slices(16, 5)
    assert slices["t"].shape == (16, 5)
    assert (slices["x"] == slices["x"][:, :1]).all()  # never across an episode boundary
    assert (slices["t"].diff(dim=1) == 1).all()


def test_named_buffer_is_shared_memory_another_mapping_sees() -> None:
    name = f"test-buffer-{uuid.uuid4().hex[:8]}"
    with Buffer(10, name=name) as buf:
        buf.extend({"x": torch.arange(4)})
        other = Segment.attach(name)
        assert other.columns[("x",)][:4].tolist() == [0, 1, 2, 3]
        other.columns[("x",)][0] = 42
        assert int(buf[0]["x"]) == 42
        other.close()
    assert not Segment.exists(name)


def test_signed_ints_into_a_uint8_column_never_destroy_stored_rows() -> None:
    # Validation refuses what the copy would, before the reservation evicts anything: when it
    # let int64 into uint8 through, numpy's copy refused it after two episodes were evicted
    # (6 rows became 4, with a raw numpy TypeError).
    buf = Buffer(6, unit="episode", schema={"x": {"dtype": "uint8", "shape": []}})
    for v in range(3):
        buf.add_episode({"x": np.full(2, v, dtype=np.uint8)})
    for bad in (np.array([300, -1]), torch.tensor([300, -1]), np.array([-3, 1], dtype=np.int8)):
        with pytest.raises(SchemaError, match=r"'x'.*uint8"):
            buf.add_episode({"x": bad})
        assert buf.num_rows == 6 and [e["x"].tolist() for e in buf[:]] == [[0, 0], [1, 1], [2, 2]]
    buf.add_episode({"x": torch.tensor([7, 8])})  # int64 values that fit are stored
    assert [e["x"].tolist() for e in buf[:]] == [[1, 1], [2, 2], [7, 8]]


class _LostDevice(torch.Tensor):
    """A tensor whose rows cannot be read any more (a device gone mid-write): it passes
    validation (dtype and shape are fine) and fails inside the copy, after the reservation."""

    def __getitem__(self, index: object) -> torch.Tensor:
        raise RuntimeError("device lost")


@pytest.mark.parametrize("unit", ["episode", "transition"])
def test_a_copy_that_fails_after_reserve_loses_no_stored_rows(unit: str) -> None:
    buf = Buffer(6, unit=unit)
    for v in range(3):
        buf.add_episode({"x": torch.full((2,), float(v))})
    before = (list(buf.container.registry), buf.container.pointer, buf[:]["x"].tolist())
    lost = torch.zeros(4).as_subclass(_LostDevice).requires_grad_()  # torch's copy path
    with pytest.raises(RuntimeError, match="device lost"):
        buf.add_episode({"x": lost})
    assert (list(buf.container.registry), buf.container.pointer, buf[:]["x"].tolist()) == before
    assert buf.add_episode({"x": torch.full((2,), 9.0)}) == [3]  # and it goes on


@settings(max_examples=60, deadline=None)
@given(
    chunks=st.lists(st.integers(1, 9), min_size=1, max_size=12),
    start=st.integers(-30, 30),
    stop=st.integers(-30, 30),
    step=st.sampled_from([None, 1, 2, -1]),
)
def test_a_slice_reads_what_its_positions_read(
    chunks: list[int], start: int, stop: int, step: int | None
) -> None:
    # buf[a:b] takes the one-physical-range fast path where it can; buf[positions] never does
    buf = Buffer(16, unit="transition")
    value = 0
    for n in chunks:  # wraps the ring, chunks of every size
        buf.extend({"x": torch.arange(value, value + n)})
        value += n
    index = slice(start, stop, step)
    positions = np.arange(len(buf))[index]
    got = buf[index]
    assert got["x"].tolist() == (buf[positions]["x"].tolist() if len(positions) else [])
    # and the rows are the newest ones, oldest first, as the writes made them
    assert buf[:]["x"].tolist() == list(range(value - len(buf), value))
