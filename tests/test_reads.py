"""The read-argument checks every reading API shares (shmbuffer/api/reads.py), alone: each refusal
names the argument it refuses; the usual arguments pass unchanged. The parity of Buffer and
Reader is tests/clients/test_read_parity.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from shmbuffer.api.reads import (
    as_beta,
    as_count,
    check_episode_args,
    check_iterate_args,
    check_mask_free,
    check_rank,
    check_sample_args,
    check_slice_args,
    check_update_args,
    expand_slices,
    mask_slices,
    normalize_index,
)
from shmbuffer.errors import InvalidArgumentError, LimitExceededError
from shmbuffer.storage.schema import Schema
from shmbuffer.wire.protocol import MAX_SAMPLE, MAX_SAMPLE_ROWS

# -- counts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [3, np.int64(3), np.int32(3), torch.tensor(3)])
def test_a_count_is_a_python_int(value: object) -> None:
    got = as_count(value, "n")
    assert got == 3 and type(got) is int


@pytest.mark.parametrize(
    ("value", "error", "words"),
    [
        (True, TypeError, "n must be an integer, got True"),
        (2.0, TypeError, "n must be an integer, got float"),
        ("2", TypeError, "n must be an integer, got str"),
        (0, InvalidArgumentError, "n must be >= 1, got 0"),
    ],
)
def test_a_bad_count_is_refused_naming_it(value: object, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        as_count(value, "n")


def test_sample_names_its_count_as_the_caller_knows_it() -> None:
    assert check_sample_args(MAX_SAMPLE) == MAX_SAMPLE
    assert check_sample_args(np.int64(4)) == 4
    with pytest.raises(InvalidArgumentError, match="batch_size must be >= 1"):
        check_sample_args(0)
    with pytest.raises(TypeError, match="batch_size must be an integer"):
        check_sample_args(4.0)
    with pytest.raises(LimitExceededError, match=f"batch_size={MAX_SAMPLE + 1:,}"):
        check_sample_args(MAX_SAMPLE + 1)
    with pytest.raises(InvalidArgumentError, match="n must be >= 1"):
        check_sample_args(-3, what="n")


def test_slices_check_n_length_and_strict() -> None:
    assert check_slice_args(np.int32(2), np.int64(5), False) == (2, 5)
    with pytest.raises(TypeError, match="strict must be True or False, got 1"):
        check_slice_args(2, 5, 1)
    with pytest.raises(InvalidArgumentError, match="length must be >= 1"):
        check_slice_args(2, 0, True)
    with pytest.raises(InvalidArgumentError, match="n must be >= 1"):
        check_slice_args(0, 5, True)
    with pytest.raises(LimitExceededError, match=f"{MAX_SAMPLE_ROWS:,} rows"):
        check_slice_args(2, MAX_SAMPLE_ROWS // 2 + 1, True)


def test_episodes_are_bounded_by_their_mean_length_when_it_is_known() -> None:
    assert check_episode_args(MAX_SAMPLE) == MAX_SAMPLE
    with pytest.raises(LimitExceededError, match=f"n={MAX_SAMPLE + 1:,}"):
        check_episode_args(MAX_SAMPLE + 1)
    with pytest.raises(LimitExceededError, match="rows each"):
        check_episode_args(MAX_SAMPLE, mean_length=MAX_SAMPLE_ROWS // MAX_SAMPLE + 1)


def test_iterate_checks_its_batch_size_and_rank() -> None:
    assert check_iterate_args(np.int64(8), 1, 2) == (8, 1, 2)
    with pytest.raises(InvalidArgumentError, match="batch_size must be >= 1"):
        check_iterate_args(0, 0, 1)
    for rank in (2, -1):
        with pytest.raises(InvalidArgumentError, match=rf"rank must be in \[0, 2\), got {rank}"):
            check_rank(rank, 2)
    with pytest.raises(InvalidArgumentError, match="world_size must be >= 1"):
        check_rank(0, 0)
    with pytest.raises(TypeError, match="rank must be an integer"):
        check_rank(0.5, 2)


@pytest.mark.parametrize("beta", [-1.0, math.nan, math.inf, "high"])
def test_a_bad_beta_is_refused_naming_it(beta: object) -> None:
    with pytest.raises(InvalidArgumentError, match="beta"):
        as_beta(beta)
    with pytest.raises(InvalidArgumentError, match="beta"):
        check_sample_args(4, beta)
    with pytest.raises(InvalidArgumentError, match="beta"):
        check_slice_args(4, 2, True, beta)
    with pytest.raises(InvalidArgumentError, match="beta"):
        check_episode_args(4, beta=beta)


def test_a_good_beta_passes() -> None:
    assert as_beta(np.float32(0.5)) == 0.5
    assert check_sample_args(4, 0.0) == 4
    assert check_slice_args(4, 2, False, np.float64(1.0)) == (4, 2)


def test_a_padded_slice_may_not_shadow_a_mask_key() -> None:
    schema = Schema.from_batch({"mask": np.zeros(1, bool), "obs": np.zeros((1, 2), np.float32)})
    check_mask_free(schema, strict=True)  # strict slices add no mask
    check_mask_free(None, strict=False)  # no schema yet
    with pytest.raises(InvalidArgumentError, match="'mask'"):
        check_mask_free(schema, strict=False)


# -- update_priorities --------------------------------------------------------------------------


def test_update_arguments_come_back_as_arrays() -> None:
    rows, values, stamps = check_update_args(torch.tensor([1, 3]), 2.0, None, 8)
    assert rows.dtype == np.int64 and rows.tolist() == [1, 3]
    assert values.tolist() == [2.0, 2.0] and stamps is None
    _, _, stamps = check_update_args([1, 3], [1.0, 2.0], np.array([5, 6], np.int32), 8)
    assert stamps is not None and stamps.dtype == np.int64 and stamps.tolist() == [5, 6]


@pytest.mark.parametrize(
    ("index", "priority", "generation", "words"),
    [
        ([8], [1.0], None, "index 8 out of range"),
        ([-1], [1.0], None, "index -1 out of range"),
        ([0.5], [1.0], None, "index must be a 1-D integer array"),
        ([1, 2], [1.0], None, "priority needs 2 values"),
        ([1, 2], [1.0, math.nan], None, r"priority\[1\] = nan"),
        ([1, 2], [1.0, 2.0], [7], "generation needs 2 integer stamps"),
    ],
)
def test_bad_update_arguments_are_refused_naming_them(
    index: object, priority: object, generation: object, words: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=f"update_priorities: .*{words}"):
        check_update_args(index, priority, generation, 8)


# -- slices -----------------------------------------------------------------------------------


def test_strict_slices_are_runs_of_rows() -> None:
    rows, mask = expand_slices(np.array([2, 10]), 3)
    assert rows.tolist() == [2, 3, 4, 10, 11, 12] and mask is None


def test_a_padded_slice_repeats_its_first_row_past_its_real_ones() -> None:
    rows, mask = expand_slices(np.array([2, 10]), 3, np.array([3, 1]))
    assert rows.tolist() == [2, 3, 4, 10, 10, 10]
    assert mask is not None and mask.tolist() == [[True] * 3, [True, False, False]]


def test_the_padding_of_slices_is_zeroed_and_masked() -> None:
    data = TensorDict({"obs": torch.ones(2, 3, 4)}, batch_size=[2, 3])
    mask_slices(data, np.array([[True, True, True], [True, False, False]]))
    assert data["mask"].tolist() == [[True] * 3, [True, False, False]]
    assert data["obs"].sum(-1).tolist() == [[4, 4, 4], [4, 0, 0]]


# -- logical indexing -------------------------------------------------------------------------


def test_a_logical_index_counts_from_either_end() -> None:
    assert normalize_index(-1, 5) == (np.array([4]), True)
    positions, scalar = normalize_index(torch.tensor([0, -1, 2]), 5)
    assert positions.tolist() == [0, 4, 2] and not scalar
    assert normalize_index(slice(1, None, 2), 5)[0].tolist() == [1, 3]
    with pytest.raises(IndexError, match="out of range"):
        normalize_index([5], 5)
    with pytest.raises(IndexError, match="must be integers"):
        normalize_index(np.array([True, False]), 5)
