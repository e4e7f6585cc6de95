"""n-step returns through a real daemon (``Reader.sample(n, n_step=, gamma=)``): each drawn row's
return, discount and next observation equal the ones computed directly from its episode
(terminated, truncated and unfinished episodes, a chunk holding several episodes, a ring that
wrapped, in both units, with and without prefetch); a writer process lapping a small ring while
the reader samples never yields a window mixing two writes; bad arguments, a remote reader and
a consume-once sampler's items are refused before anything is drawn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shmbuffer import Reader, Writer
from shmbuffer.errors import InvalidArgumentError
from tests.test_nstep import ENDS, _episode, _expected

pytestmark = pytest.mark.timeout(60)

Episodes = list[tuple[list[float], str]]


def _write(name: str, episodes: Episodes) -> dict[float, tuple[list[float], str, int, int]]:
    """Write each episode (step ids 100 apart) and return step id -> (rewards, end, t, first)."""
    by_id: dict[float, tuple[list[float], str, int, int]] = {}
    with Writer(name, timeout=5.0) as writer:
        for i, (rewards, end) in enumerate(episodes):
            writer.add_episode(_episode(100 * i, rewards, end))
            for t in range(len(rewards)):
                by_id[float(100 * i + t)] = (rewards, end, t, 100 * i)
        writer.flush()
    return by_id


def _check(data: Any, by_id: dict[float, Any], n: int, gamma: float) -> list[int]:
    """Every drawn row's n-step values against the direct computation; per row, the steps its
    window reached past it."""
    reached = []
    for i in range(len(data)):
        rewards, end, t, first = by_id[float(data["obs"][i])]
        total, discount, last = _expected(rewards, end, t, n, gamma)
        assert float(data["n_step_return"][i]) == pytest.approx(total, rel=1e-5, abs=1e-4)
        assert float(data["discount"][i]) == pytest.approx(discount, rel=1e-6)
        assert float(data["next", "obs"][i]) == first + last + 0.5
        reached.append(last - t)
    return reached


def _random_episodes(seed: int, count: int) -> Episodes:
    rng = np.random.default_rng(seed)
    return [
        ([float(r) for r in rng.uniform(-10, 10, int(rng.integers(1, 8)))], str(rng.choice(ENDS)))
        for _ in range(count)
    ]


@pytest.mark.parametrize("unit", ["transition", "episode"])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_readers_n_step_sample_equals_the_episode_on_a_wrapped_ring(
    daemon: Any, unit: str, seed: int
) -> None:
    d = daemon(capacity=24, unit=unit, args=["--seed", str(seed)])
    episodes = _random_episodes(seed, 14)  # about 56 steps: the ring of 24 wraps twice
    by_id = _write(d.name, episodes)
    gamma = (0.9, 0.5)[seed]
    with Reader(d.name, prefetch=2) as reader:  # the second batch of each pair: prefetched
        crossed = 0
        for n in (1, 3, 6, 3, 3):
            data, info = reader.sample(64, n_step=n, gamma=gamma, return_info=True)
            reached = np.asarray(_check(data, by_id, n, gamma))
            crossed += int((info["index"].numpy() + reached >= 24).sum())
    # windows that ran from the ring's last row into row 0 (in episode unit the ring wraps
    # before an episode that does not fit: none crosses)
    assert crossed if unit == "transition" else not crossed


def test_the_ring_end_a_terminated_and_a_truncated_episode_and_an_unfinished_one(
    daemon: Any,
) -> None:
    d = daemon(capacity=20, unit="transition", args=["--seed", "3"])
    episodes: Episodes = [
        ([1.0, 2.0, 3.0, 4.0, 5.0], "terminated"),
        ([1.0] * 7, "truncated"),
        ([2.0] * 6, "open"),  # rows 12..17
        ([1.0, 2.0, 4.0, 8.0], "terminated"),  # rows 18, 19, then 0, 1: written across the end
    ]
    by_id = _write(d.name, episodes)
    with Reader(d.name) as reader:
        data = reader.sample(400, n_step=3, gamma=0.9)
        _check(data, by_id, 3, 0.9)
        one_step = reader.sample(8)  # a plain sample after it: the rows as stored
    assert {300.0, 301.0} <= set(data["obs"].tolist())  # windows crossing the ring's end
    assert float(data["n_step_return"][data["obs"] == 300][0]) == pytest.approx(1 + 1.8 + 3.24)
    assert "n_step_return" not in one_step.keys()
    assert (one_step["next", "obs"] == one_step["obs"] + 0.5).all()


def test_a_chunk_of_several_episodes_stops_at_each_done_flag(daemon: Any) -> None:
    d = daemon(capacity=16, unit="transition")
    chunk = _episode(0, [1.0, 2.0, 4.0, 8.0], "open")
    chunk["terminated"] = np.array([False, True, False, False])
    with Writer(d.name, timeout=5.0) as writer:
        writer.extend(chunk)
        writer.flush()
    with Reader(d.name) as reader:
        data = reader.sample(100, n_step=3, gamma=1.0, return_info=True)[0]
    first, third = data["obs"] == 0, data["obs"] == 2
    assert float(data["n_step_return"][first][0]) == 3.0
    assert float(data["discount"][first][0]) == 0.0
    assert float(data["n_step_return"][third][0]) == 12.0
    assert float(data["discount"][third][0]) == 1.0


def test_a_writer_lapping_the_ring_never_yields_a_window_mixing_two_writes(
    daemon: Any, children: Any
) -> None:
    """Each write numbers its rows (``_workers.write_numbered_episodes``): a window holding a
    row of another write would show it in the return (reward = the write's number), in the
    next observation or in the discount (each episode is 8 steps, its last truncated). Rows
    of 2 KiB each way: the copies take long enough for the writer to lap the ring meanwhile."""
    length, n, gamma, width, episodes = 8, 3, 0.5, 512, 600
    d = daemon(capacity=32, unit="transition")
    steps = np.arange(length, dtype=np.float32)
    with Writer(d.name, timeout=5.0) as writer:  # the schema, and rows to draw from the start
        writer.add_episode(
            {
                "obs": np.repeat(steps[:, None], width, axis=1),
                "reward": np.zeros(length, np.float32),
                "terminated": np.zeros(length, bool),
                "truncated": steps == length - 1,
                "next": {"obs": np.repeat(steps[:, None], width, axis=1) + 0.5},
            }
        )
        writer.flush()
    proc = children.spawn("writer", "write_numbered_episodes", d.name, episodes, length, width)
    batches = 0
    with Reader(d.name, timeout=10.0, prefetch=False) as reader:
        while proc.is_alive() or batches < 5:
            data = reader.sample(256, n_step=n, gamma=gamma)
            batches += 1
            full = data["obs"].numpy()
            assert (full == full[:, :1]).all()  # the drawn rows untorn
            obs = full[:, 0].astype(np.int64)
            write, t = obs // 1000, obs % 1000
            m = np.minimum(n, length - t)
            np.testing.assert_allclose(data["discount"].numpy(), gamma**m)
            np.testing.assert_allclose(
                data["n_step_return"].numpy(), write * (1 - gamma**m) / (1 - gamma), rtol=1e-6
            )
            expected = np.repeat((obs + m - 1 + 0.5)[:, None], width, axis=1)
            np.testing.assert_array_equal(data["next", "obs"].numpy(), expected)
        resamples = reader.resamples
    assert children.collect({"writer"}, timeout=30.0)["writer"] == episodes
    print(f"{batches} batches, {resamples} items drawn again")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"n_step": 0}, InvalidArgumentError, "n_step must be >= 1"),
        ({"n_step": 2, "gamma": 1.5}, InvalidArgumentError, r"gamma must be in \[0, 1\]"),
        ({"n_step": 2, "n_step_keys": {"reward": "rew"}}, InvalidArgumentError, "reward key"),
        ({"n_step": 2, "n_step_keys": {"rewards": "r"}}, InvalidArgumentError, "unknown role"),
        ({"n_step": 2.0}, TypeError, "n_step must be an integer"),
    ],
)
def test_bad_arguments_are_refused_before_the_draw(
    daemon: Any, kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    d = daemon(
        capacity=8, unit="transition", args=["--sampler", "fifo", "--max-times-sampled", "1"]
    )
    _write(d.name, [([1.0] * 4, "terminated")])
    with Reader(d.name, sample_timeout=0.5) as reader:
        with pytest.raises(error, match=message):
            reader.sample(2, **kwargs)
        assert len(reader.sample(4, n_step=2, gamma=1.0)) == 4  # nothing was consumed


def test_a_remote_reader_is_refused_naming_why(daemon: Any) -> None:
    d = daemon(capacity=16, unit="transition", args=["--endpoint", "tcp://127.0.0.1:0"])
    with Writer(d.endpoint, remote=True) as writer:
        writer.add_episode(_episode(0, [1.0] * 4, "terminated"))
        writer.flush()
    with Reader(d.endpoint, remote=True) as reader:
        with pytest.raises(InvalidArgumentError, match=r"remote reader .* rows after them"):
            reader.sample(2, n_step=3)
        assert len(reader.sample(2)) == 2


def test_with_her_or_frame_stacks_it_is_refused_before_the_draw(
    daemon: Any, tmp_path: Path
) -> None:
    schema = tmp_path / "schema.toml"
    schema.write_text(
        'obs = { dtype = "int64", shape = [2], stack = 3 }\n'
        '"next.obs" = { next_of = "obs" }\n'
        'reward = { dtype = "float32", shape = [] }\n'
        'terminated = { dtype = "bool", shape = [] }\n'
    )
    d = daemon(capacity=32, unit="transition", args=["--schema", str(schema)])
    frames = np.stack([np.arange(5), np.zeros(5, np.int64)], 1)
    with Writer(d.name, timeout=5.0) as writer:
        writer.add_episode(
            {
                "obs": frames[:-1],
                "next": {"obs": frames[1:]},
                "reward": np.ones(4, np.float32),
                "terminated": np.arange(4) == 3,
            }
        )
        writer.flush()
    keys = {"truncated": None}
    with Reader(d.name) as reader:
        with pytest.raises(InvalidArgumentError, match="frame stacks"):
            reader.sample(2, n_step=3, n_step_keys=keys)
        her = {"goal_key": "obs", "achieved_key": "obs", "reward_fn": lambda a, g: a}
        with pytest.raises(InvalidArgumentError, match="her and n_step cannot be combined"):
            reader.sample(2, n_step=3, n_step_keys=keys, her=her)
        assert reader.sample(2)["obs"].shape == (2, 3, 2)
