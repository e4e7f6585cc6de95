"""The ingestion rules Buffer and Writer share (shmbuffer/api/writeplan.py), alone: a batch's plan,
a write's priority shaped to what the plan keeps, a vector env's episode made env-major. Each
refusal names what is wrong; the Buffer/Writer parity is tests/clients/test_ingest_parity.py."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from shmbuffer.api.writeplan import WritePlan, plan_write, vector_episode, write_priority
from shmbuffer.errors import CapacityError, InvalidArgumentError, SchemaError
from shmbuffer.storage.schema import Schema


def batch(n: int) -> dict[str, np.ndarray]:
    return {"obs": np.arange(n, dtype=np.float32)[:, None].repeat(2, 1), "id": np.arange(n)}


def plan(n: int, num_sub: int = 1, capacity: int = 64, mode: str = "circular") -> WritePlan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the trim's warning, tested below
        made = plan_write(None, batch(n), num_sub, capacity, mode)
    assert made is not None
    return made


# -- the plan -------------------------------------------------------------------------------


def test_a_lazy_schema_is_taken_from_the_batch() -> None:
    made = plan(6)
    assert made.schema == Schema.from_batch(batch(6))
    assert (made.first_row, made.num_rows, made.episodes, made.given) == (0, 6, 1, 1)
    assert made.lengths == [6]


def test_a_batch_that_does_not_fit_the_schema_is_refused_naming_the_key() -> None:
    schema = Schema.from_batch(batch(1))
    with pytest.raises(SchemaError, match="obs"):
        plan_write(schema, {"obs": np.zeros((2, 3), np.float32), "id": np.arange(2)}, 1, 8, "fixed")


def test_a_batch_too_large_for_a_ring_keeps_its_newest_sub_episodes() -> None:
    with pytest.warns(RuntimeWarning, match="keeping the last 8"):
        made = plan_write(None, batch(12), 3, 9, "circular")
    assert made is not None
    # three sub-episodes of 4: the newest two fit 9 rows
    assert (made.first_row, made.num_rows, made.episodes, made.given) == (4, 8, 2, 3)
    assert made.lengths == [4, 4]
    with pytest.raises(CapacityError, match="capacity 9"):
        plan_write(None, batch(12), 3, 9, "fixed")


def test_an_empty_batch_plans_nothing() -> None:
    with pytest.warns(RuntimeWarning, match="zero rows"):
        assert plan_write(None, batch(0), 1, 8, "circular") is None


# -- priorities -----------------------------------------------------------------------------


def test_no_priority_is_none_whatever_the_sampler() -> None:
    assert write_priority(None, plan(4), "transition", sampler="uniform", keeps=False) is None


def test_a_priority_for_a_sampler_that_keeps_none_is_refused_naming_it() -> None:
    with pytest.raises(InvalidArgumentError, match="'fifo' keeps no priorities"):
        write_priority(1.0, plan(4), "transition", sampler="fifo", keeps=False)


def test_a_scalar_is_one_number_for_every_item() -> None:
    got = write_priority(np.float32(2.5), plan(4), "transition", sampler="p", keeps=True)
    assert got == 2.5 and type(got) is float


def test_per_row_priorities_are_cut_to_the_rows_kept() -> None:
    made = plan(12, 3, capacity=9)  # rows 4..11 kept
    got = write_priority(torch.arange(12.0), made, "transition", sampler="p", keeps=True)
    np.testing.assert_array_equal(got, np.arange(4.0, 12.0))


def test_per_episode_priorities_are_cut_to_the_sub_episodes_kept() -> None:
    made = plan(12, 3, capacity=9)  # sub-episodes 1 and 2 kept
    got = write_priority([1.0, 2.0, 3.0], made, "episode", sampler="p", keeps=True)
    np.testing.assert_array_equal(got, [2.0, 3.0])


@pytest.mark.parametrize(
    ("priority", "unit", "words"),
    [
        ([1.0, 2.0, 3.0], "transition", "priority needs 4 values"),
        ([1.0, 2.0], "episode", "priority needs 1 values"),
        ([1.0, math.nan, 1.0, 1.0], "transition", r"priority\[1\] = nan"),
        (-1.0, "transition", r"priority\[0\] = -1.0"),
        ([1.0, 1.0, 1.0, 5.0], "transition", r"priority\[3\] = 5.0.*at most 4"),
        ("high", "transition", "high"),
    ],
)
def test_a_bad_priority_is_refused_naming_it(priority: object, unit: str, words: str) -> None:
    with pytest.raises(InvalidArgumentError, match=words):
        write_priority(priority, plan(4), unit, sampler="p", keeps=True, most=4.0)


# -- vector envs ----------------------------------------------------------------------------


def test_a_vector_episode_is_env_major_and_so_is_its_per_row_priority() -> None:
    steps, envs = 3, 2
    episode = {"obs": torch.arange(steps * envs).reshape(steps, envs)}  # obs = 2 * t + env
    priority = np.arange(steps * envs, dtype=np.float64).reshape(steps, envs)
    data, per_row = vector_episode(episode, envs, "transition", priority)
    assert data["obs"].tolist() == [0, 2, 4, 1, 3, 5]
    np.testing.assert_array_equal(per_row, [0, 2, 4, 1, 3, 5])  # each row keeps its own


def test_a_vector_episode_keeps_its_per_episode_priority_as_given() -> None:
    episode = {"obs": torch.zeros(3, 2)}
    _, given = vector_episode(episode, 2, "episode", [1.0, 2.0])
    assert given == [1.0, 2.0]


def test_a_vector_episode_of_the_wrong_width_is_refused_naming_the_key() -> None:
    with pytest.raises(SchemaError, match=r"'obs'.*num_envs=4"):
        vector_episode({"obs": torch.zeros(3, 2)}, 4, "transition", None)
