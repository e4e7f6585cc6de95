"""Hindsight relabelling through a real daemon (``Reader.sample(n, her=...)``): the rows are
drawn by the daemon with their context, the goals read from shared memory and checked
against the drawn rows' stamps; the same property as in process (tests/test_her.py), at
episode starts and ends and across the ring's wrap; a writer lapping the ring never hands a
goal of another write; bad options refused before the draw."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmbuffer import Reader, Writer
from shmbuffer.errors import InvalidArgumentError
from tests.test_her import ENDS, check_batch, episode, reward_fn

pytestmark = pytest.mark.timeout(120)


def test_relabelled_goals_through_the_daemon(daemon: Any) -> None:
    d = daemon(capacity=24, unit="transition", args=["--seed", "3"])
    by_id: dict[float, tuple[int, int]] = {}  # every step written, by id
    with Writer(d.name) as writer, Reader(d.name, prefetch=2) as reader:

        @settings(
            max_examples=15,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture],
        )
        @given(
            episodes=st.lists(
                st.tuples(st.integers(1, 7), st.sampled_from(ENDS)), min_size=1, max_size=8
            ),
            strategy=st.sampled_from(["future", "final", "episode"]),
            k=st.integers(0, 5),
        )
        def check(episodes: list[tuple[int, str]], strategy: str, k: int) -> None:
            first = check.first  # type: ignore[attr-defined]
            for length, end in episodes:  # later examples lap the ring of earlier ones
                writer.add_episode(episode(first, length, end))
                for t in range(length):
                    by_id[float(first + t)] = (first, first + length - 1)
                first += 100
            check.first = first  # type: ignore[attr-defined]
            writer.flush()
            data = reader.sample(32, her={"strategy": strategy, "k": k, "reward_fn": reward_fn})
            check_batch(data, by_id, strategy, k, 32)

        check.first = 0  # type: ignore[attr-defined]
        check()


def test_a_writer_lapping_the_ring_never_hands_a_goal_of_another_write(daemon: Any) -> None:
    d = daemon(capacity=40, unit="transition")
    stop = threading.Event()
    lengths = (3, 5, 7, 11)
    by_id = {
        float(e * 100 + t): (e * 100, e * 100 + lengths[e % 4] - 1)
        for e in range(2_000)
        for t in range(lengths[e % 4])
    }

    def write() -> None:
        with Writer(d.name) as writer:
            for e in range(2_000):
                if stop.is_set():
                    break
                writer.add_episode(episode(e * 100, lengths[e % 4], "terminated"))

    with Writer(d.name) as writer:
        writer.add_episode(episode(0, 3, "terminated"))
    thread = threading.Thread(target=write)
    thread.start()
    try:
        with Reader(d.name) as reader:
            for _ in range(40):
                data = reader.sample(64, her={"strategy": "episode", "reward_fn": reward_fn})
                check_batch(data, by_id, "episode", 4, 64)
    finally:
        stop.set()
        thread.join(timeout=30)


def test_bad_options_are_refused_before_the_draw(daemon: Any) -> None:
    d = daemon(capacity=16, unit="transition", args=["--sampler", "fifo"])
    with Writer(d.name) as writer:
        writer.add_episode(episode(0, 4, "terminated"))
        writer.flush()
    with Reader(d.name) as reader:
        with pytest.raises(InvalidArgumentError, match="goal_key 'goal'"):
            reader.sample(2, her={"reward_fn": reward_fn, "goal_key": "goal"})
        with pytest.raises(InvalidArgumentError, match="strategy must be one of"):
            reader.sample(2, her={"reward_fn": reward_fn, "strategy": "later"})
        assert len(reader.sample(4)) == 4  # nothing was consumed by the refused calls


def test_a_seeded_daemon_relabels_alike_run_after_run(daemon: Any) -> None:
    """With ``--seed`` the daemon draws the rows and each reader's goal draws are seeded from
    it (and the reader's place among the clients): two fresh runs relabel alike."""
    goals = []
    for _ in range(2):
        d = daemon(capacity=32, unit="transition", args=["--seed", "4"])
        with Writer(d.name) as writer, Reader(d.name, prefetch=False) as reader:
            writer.add_episode(episode(0, 12, "terminated"))
            writer.add_episode(episode(100, 12, "truncated"))
            writer.flush()
            data = reader.sample(64, her={"strategy": "future", "reward_fn": reward_fn})
            goals.append(data["desired_goal"])
        d.stop()
    assert torch.equal(goals[0], goals[1])
