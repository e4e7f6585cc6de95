"""Hindsight relabelling at sample time (``sample(n, her=...)``): a relabelled goal is one
achieved in the drawn row's own episode at a step its strategy allows, the reward is the
user's function of it, the goal in the next observation follows, and the other rows are
untouched; at episode starts and ends, in chunks holding several episodes, and across the
ring's wrap, in both units; bad options refused before anything is drawn. The same property
through a real daemon's Reader is in tests/e2e/test_her_daemon.py (:func:`check_batch` here)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shmbuffer.buffer import Buffer
from shmbuffer.errors import InvalidArgumentError

#: The original goal every row was collected for, and its reward: nothing achieves it.
GOAL, REWARD = -1.0, -7.0
ENDS = ("terminated", "truncated", "open")


def reward_fn(achieved: torch.Tensor, desired: torch.Tensor) -> torch.Tensor:
    """A goal reward that also says which step's goal it was given: achieved id - goal id."""
    return achieved[:, 0] - desired[:, 0]


def episode(first_id: int, length: int, end: str) -> dict[str, Any]:
    """Steps with unique ids; the goal achieved after step id ``k`` is ``k + 0.5``."""
    ids = np.arange(first_id, first_id + length, dtype=np.float32)
    done = np.zeros(length, bool)
    return {
        "obs": ids,
        "desired_goal": np.full((length, 2), GOAL, np.float32),
        "reward": np.full(length, REWARD, np.float32),
        "terminated": done | (end == "terminated") & (np.arange(length) == length - 1),
        "truncated": done | (end == "truncated") & (np.arange(length) == length - 1),
        "next": {
            "obs": ids + 0.5,
            "achieved_goal": np.repeat((ids + 0.5)[:, None], 2, axis=1),
            "desired_goal": np.full((length, 2), GOAL, np.float32),
        },
    }


def check_batch(
    data: Any, episodes: dict[float, tuple[int, int]], strategy: str, k: int, n: int
) -> None:
    """Every row of a relabelled sample against the episodes it came from: ``episodes`` maps
    a step id to (its episode's first id, that episode's last id)."""
    relabelled = data["relabelled"]
    assert int(relabelled.sum()) == n * k // (k + 1)
    for i in range(len(data)):
        step = float(data["obs"][i])
        first, last = episodes[step]
        goal = data["desired_goal"][i]
        assert torch.equal(goal, data["next", "desired_goal"][i])
        if not relabelled[i]:
            assert goal.tolist() == [GOAL, GOAL]
            assert float(data["reward"][i]) == REWARD
            continue
        assert goal[0] == goal[1]
        goal_step = float(goal[0]) - 0.5
        assert first <= goal_step <= last, (step, goal_step, first, last)
        if strategy == "future":
            assert goal_step >= step
        elif strategy == "final":
            assert goal_step == last
        assert float(data["reward"][i]) == pytest.approx(step - goal_step)


episodes_strategy = st.lists(
    st.tuples(st.integers(1, 7), st.sampled_from(ENDS)), min_size=1, max_size=12
)


@settings(max_examples=60, deadline=None)
@given(
    episodes=episodes_strategy,
    unit=st.sampled_from(["transition", "episode"]),
    capacity=st.integers(8, 20),
    strategy=st.sampled_from(["future", "final", "episode"]),
    k=st.integers(0, 6),
    chunked=st.booleans(),
)
def test_relabelled_goals_come_from_the_episode(
    episodes: list[tuple[int, str]],
    unit: str,
    capacity: int,
    strategy: str,
    k: int,
    chunked: bool,
) -> None:
    by_id: dict[float, tuple[int, int]] = {}
    chunked = chunked and unit == "transition"  # a chunk of several episodes: extend's
    capacity = max(capacity, 14) if chunked else capacity  # a chunk of two fits the ring
    with Buffer(capacity, unit=unit, seed=1) as buffer:
        first, pending = 0, []
        for length, given in episodes:
            # inside a chunk only a done flag ends an episode
            end = "truncated" if chunked and given == "open" else given
            steps = episode(first, length, end)
            if chunked:
                pending.append(steps)
                if len(pending) == 2:
                    buffer.extend({key: _cat(pending, key) for key in steps})
                    pending = []
            else:
                buffer.add_episode(steps)
            for t in range(length):
                by_id[float(first + t)] = (first, first + length - 1)
            first += 100
        if pending:
            buffer.extend(pending[0])
        if unit == "transition":  # a head overwritten: the episode starts at its first row left
            live = buffer[:]["obs"].tolist()
            for step in live:
                start, last = by_id[step]
                by_id[step] = (min(s for s in live if start <= s <= last), last)
        data = buffer.sample(64, her={"strategy": strategy, "k": k, "reward_fn": reward_fn})
    check_batch(data, by_id, strategy, k, 64)


def _cat(parts: list[dict[str, Any]], key: str) -> Any:
    if key == "next":
        return {k: np.concatenate([p["next"][k] for p in parts]) for k in parts[0]["next"]}
    return np.concatenate([p[key] for p in parts])


def test_a_chunk_written_across_the_ring_end_is_followed_through_row_zero() -> None:
    with Buffer(10, seed=0) as buffer:
        buffer.add_episode(episode(0, 6, "terminated"))
        buffer.add_episode(episode(100, 6, "open"))  # rows 6..9 then 0..1
        data = buffer.sample(400, her={"strategy": "final", "reward_fn": reward_fn})
        episodes = buffer.sample(400, her={"strategy": "episode", "reward_fn": reward_fn})
    late = (data["obs"] >= 100) & data["relabelled"]
    assert late.any()
    assert (data["desired_goal"][late][:, 0] == 105.5).all()  # past the ring's end
    goals = episodes["desired_goal"][(episodes["obs"] == 105) & episodes["relabelled"]][:, 0]
    assert set(goals.tolist()) == {100.5, 101.5, 102.5, 103.5, 104.5, 105.5}


def test_the_last_row_of_an_episode_gets_its_own_goal_in_future() -> None:
    with Buffer(16, seed=0) as buffer:
        buffer.add_episode(episode(0, 4, "terminated"))
        buffer.add_episode(episode(100, 4, "terminated"))
        data = buffer.sample(200, her={"strategy": "future", "k": 1_000, "reward_fn": reward_fn})
    # every row but one is relabelled (k = 1000 of 1001): look only at those
    last = (data["obs"] == 3).reshape(-1) & data["relabelled"].reshape(-1)
    assert bool(last.any())
    assert (data["desired_goal"][last][:, 0] == 3.5).all()
    assert (data["reward"][last] == 0.0).all()  # achieved by the step itself


def test_without_a_next_goal_only_the_goal_changes() -> None:
    steps = episode(0, 5, "terminated")
    del steps["next"]["desired_goal"]
    with Buffer(16, seed=0) as buffer:
        buffer.add_episode(steps)
        data = buffer.sample(20, her={"reward_fn": reward_fn})
    assert ("next", "desired_goal") not in data.keys(include_nested=True)
    assert bool(data["relabelled"].any())


@pytest.mark.parametrize(
    ("her", "message"),
    [
        ({"reward_fn": reward_fn, "strategy": "later"}, "strategy must be one of"),
        ({"reward_fn": reward_fn, "k": -1}, "k must be an integer >= 0"),
        ({"reward_fn": reward_fn, "k": 1.5}, "k must be an integer >= 0"),
        ({}, "reward_fn must be a callable"),
        ({"reward_fn": reward_fn, "goal_key": "goal"}, "goal_key 'goal'"),
        ({"reward_fn": reward_fn, "achieved_key": "obs"}, r"goal_key 'desired_goal' has rows"),
        ({"reward_fn": reward_fn, "reward_key": "rew"}, "reward_key 'rew'"),
        ({"reward_fn": reward_fn, "done_keys": ["done"]}, "done_keys 'done'"),
        ({"reward_fn": reward_fn, "goal": "x"}, r"unknown option\(s\) \['goal'\]"),
        ({"reward_fn": lambda a, d: 1.0}, "reward_fn returned 1.0"),
        ([("reward_fn", reward_fn)], "her must be a dict"),
    ],
)
def test_bad_options_are_refused_before_the_draw(her: Any, message: str) -> None:
    with Buffer(8, seed=0, max_times_sampled=1, sampler="fifo") as buffer:
        buffer.add_episode(episode(0, 4, "terminated"))
        with pytest.raises(InvalidArgumentError, match=message):
            buffer.sample(2, her=her)
        if "returned" not in message:  # reward_fn is the user's: it runs after the draw
            assert len(buffer.sample(4)) == 4  # nothing was consumed by the refused call


def test_her_and_n_step_are_not_combined() -> None:
    with Buffer(8, seed=0) as buffer:
        buffer.add_episode(episode(0, 4, "terminated"))
        with pytest.raises(InvalidArgumentError, match="her and n_step"):
            buffer.sample(2, n_step=2, her={"reward_fn": reward_fn})


def test_a_seeded_buffer_relabels_alike_run_after_run() -> None:
    """The goals are drawn with the buffer's seeded generator, as its rows are."""
    batches = []
    for _ in range(2):
        with Buffer(32, seed=5) as buffer:
            buffer.add_episode(episode(0, 12, "terminated"))
            buffer.add_episode(episode(100, 12, "truncated"))
            batches.append(buffer.sample(64, her={"strategy": "future", "reward_fn": reward_fn}))
    assert torch.equal(batches[0]["desired_goal"], batches[1]["desired_goal"])
    assert torch.equal(batches[0]["obs"], batches[1]["obs"])
