"""n-step returns at sample time (``Buffer.sample(n, n_step=, gamma=)``): each drawn row's
return, next observation and discount equal the ones computed directly from its episode, at
episode starts and ends, terminations, truncations, unfinished episodes and across the ring's
wrap, in both units; bad arguments are refused before anything is drawn."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmbuffer.buffer import Buffer
from shmbuffer.errors import InvalidArgumentError

# How an episode ends: its last step terminated, truncated, or neither (the stored part of an
# episode still going on).
ENDS = ("terminated", "truncated", "open")


def _episode(first_id: int, rewards: list[float], end: str) -> dict[str, object]:
    length = len(rewards)
    obs = np.arange(first_id, first_id + length, dtype=np.float32)  # unique step ids
    terminated = np.zeros(length, bool)
    truncated = np.zeros(length, bool)
    if end == "terminated":
        terminated[-1] = True
    elif end == "truncated":
        truncated[-1] = True
    return {
        "obs": obs,
        "reward": np.asarray(rewards, np.float32),
        "terminated": terminated,
        "truncated": truncated,
        "next": {"obs": obs + 0.5},  # the observation after step id k is k + 0.5
    }


def _expected(
    rewards: list[float], end: str, t: int, n: int, gamma: float
) -> tuple[float, float, int]:
    """Return, discount and the index of the step whose next observation a draw of step
    ``t`` gets, computed from the whole episode one step at a time."""
    total, k = 0.0, 0
    while True:
        total += gamma**k * rewards[t + k]
        last = t + k
        k += 1
        if k == n or last == len(rewards) - 1:
            break
    terminated = end == "terminated" and last == len(rewards) - 1
    return total, 0.0 if terminated else gamma**k, last


episodes_strategy = st.lists(
    st.tuples(
        st.lists(st.floats(-10, 10, width=32), min_size=1, max_size=7),
        st.sampled_from(ENDS),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(
    episodes=episodes_strategy,
    unit=st.sampled_from(["transition", "episode"]),
    capacity=st.integers(8, 20),
    n=st.integers(1, 6),
    gamma=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
)
def test_n_step_matches_the_episode(
    episodes: list[tuple[list[float], str]], unit: str, capacity: int, n: int, gamma: float
) -> None:
    by_id: dict[float, tuple[list[float], str, int, int]] = {}  # step id -> episode, t, first
    with Buffer(capacity, unit=unit, seed=1) as buffer:
        first = 0
        for rewards, end in episodes:
            buffer.add_episode(_episode(first, rewards, end))
            for t in range(len(rewards)):
                by_id[float(first + t)] = (rewards, end, t, first)
            first += 100
        data = buffer.sample(128, n_step=n, gamma=gamma)
    for i in range(len(data)):
        rewards, end, t, first = by_id[float(data["obs"][i])]
        total, discount, last = _expected(rewards, end, t, n, gamma)
        assert float(data["n_step_return"][i]) == pytest.approx(total, rel=1e-5, abs=1e-4)
        assert float(data["discount"][i]) == pytest.approx(discount, rel=1e-6)
        assert float(data["next", "obs"][i]) == first + last + 0.5


def test_a_chunk_written_across_the_ring_end_is_followed_through_row_zero() -> None:
    with Buffer(10, seed=0) as buffer:
        buffer.add_episode(_episode(0, [1.0] * 6, "terminated"))
        buffer.add_episode(_episode(100, [1.0] * 6, "open"))  # rows 6..9 then 0..1
        assert buffer._ring.registry.get(2).start == 0  # the wrap split it in two entries
        data = buffer.sample(200, n_step=4, gamma=0.5)
    wrapped = data["obs"] == 102  # row 8: its window runs 102..105 through row 0
    assert bool(wrapped.any())
    assert float(data["n_step_return"][wrapped][0]) == pytest.approx(1.875)
    assert float(data["discount"][wrapped][0]) == pytest.approx(0.0625)
    assert float(data["next", "obs"][wrapped][0]) == 105.5


def test_two_chunks_meeting_at_the_ring_end_stay_apart() -> None:
    with Buffer(10, seed=0) as buffer:
        buffer.add_episode(_episode(0, [1.0] * 5, "open"))
        buffer.add_episode(_episode(100, [1.0] * 5, "open"))  # ends exactly at row 10
        buffer.add_episode(_episode(200, [1.0] * 3, "open"))  # starts at row 0
        data = buffer.sample(200, n_step=3, gamma=1.0)
    last = data["obs"] == 104
    assert float(data["n_step_return"][last][0]) == 1.0  # not into episode 200
    assert float(data["next", "obs"][last][0]) == 104.5


def test_a_chunk_holding_several_episodes_stops_at_each_done_flag() -> None:
    chunk = _episode(0, [1.0, 2.0, 4.0, 8.0], "open")
    chunk["terminated"] = np.array([False, True, False, False])  # type: ignore[index]
    with Buffer(16, seed=0) as buffer:
        buffer.extend(chunk)
        data = buffer.sample(100, n_step=3, gamma=1.0)
    first = data["obs"] == 0
    assert float(data["n_step_return"][first][0]) == 3.0
    assert float(data["discount"][first][0]) == 0.0
    third = data["obs"] == 2
    assert float(data["n_step_return"][third][0]) == 12.0
    assert float(data["discount"][third][0]) == 1.0


def test_keys_by_other_names_and_without_truncation() -> None:
    episode = _episode(0, [1.0, 1.0, 1.0], "terminated")
    renamed = {
        "obs": episode["obs"],
        "r": episode["reward"],
        "done": episode["terminated"],
        "next_obs": episode["next"]["obs"],  # type: ignore[index]
    }
    keys = {"reward": "r", "terminated": "done", "truncated": None, "next_obs": "next_obs"}
    with Buffer(8, seed=0) as buffer:
        buffer.add_episode(renamed)
        data = buffer.sample(50, n_step=2, gamma=1.0, n_step_keys=keys)
    assert set(data["n_step_return"].tolist()) == {1.0, 2.0}
    assert "next" not in data.keys()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_step": 0}, "n_step must be >= 1"),
        ({"n_step": 2, "gamma": 1.5}, r"gamma must be in \[0, 1\]"),
        ({"n_step": 2, "gamma": -0.1}, r"gamma must be in \[0, 1\]"),
        ({"n_step": 2, "gamma": float("nan")}, r"gamma must be in \[0, 1\]"),
        ({"n_step": 2, "n_step_keys": {"reward": "rew"}}, "reward key 'rew'"),
        ({"n_step": 2, "n_step_keys": {"next_obs": "next_obs"}}, "next_obs key 'next_obs'"),
        ({"n_step": 2, "n_step_keys": {"rewards": "reward"}}, "unknown role"),
    ],
)
def test_bad_arguments_are_refused_before_the_draw(kwargs: dict, message: str) -> None:
    with Buffer(8, seed=0, max_times_sampled=1, sampler="fifo") as buffer:
        buffer.add_episode(_episode(0, [1.0] * 4, "terminated"))
        with pytest.raises(InvalidArgumentError, match=message):
            buffer.sample(2, **kwargs)
        assert len(buffer.sample(4)) == 4  # nothing was consumed by the refused call


def test_n_step_of_a_wrong_type_is_a_type_error() -> None:
    with Buffer(8, seed=0) as buffer:
        buffer.add_episode(_episode(0, [1.0] * 4, "terminated"))
        with pytest.raises(TypeError, match="n_step"):
            buffer.sample(2, n_step=2.0)  # type: ignore[arg-type]
