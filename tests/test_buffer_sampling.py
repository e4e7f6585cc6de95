"""Every sampler feature on the in-process Buffer, with fixed seeds.

The Buffer runs the container's sampler and rate limiter, the same code the daemon runs; these
tests check what a user of ``Buffer`` sees: distributions (chi-square at p > P_MIN), exact
probabilities and weights, stale priority updates, padded slices, ``iterate`` across ranks,
epochs, FIFO order and its hold on writers, limiter refusals, and bad input refused with
nothing changed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from shmbuffer import Buffer
from shmbuffer.errors import EmptyBufferError, InvalidArgumentError, WaitTimeoutError
from shmbuffer.samplers import PrioritizedSampler
from tests._stats import P_MIN, chi2_p


def rows(n: int, first: int = 0) -> dict[str, Any]:
    """``n`` transitions whose ``obs`` names their write order (first + i), never 0."""
    ids = np.arange(first, first + n, dtype=np.int64) + 1
    return {"obs": ids.astype(np.float32)[:, None].repeat(3, 1), "id": ids}


def snapshot(buf: Buffer) -> tuple[Any, ...]:
    """Everything a refused call must leave as it was."""
    c = buf.container
    return (
        c.pointer,
        c.rows_written,
        list(c.registry),
        repr(c.sampler.state_dict()),
        repr(c.rate_limiter.state_dict()),
        c.use_counts.copy().tolist(),
        c.rng.bit_generator.state,
    )


# -- prioritized ----------------------------------------------------------------------------


def test_prioritized_frequencies_follow_priority_to_the_alpha() -> None:
    alpha = 0.7
    buf = Buffer(64, sampler="prioritized", priority_exponent=alpha, priority_eps=0.0, seed=3)
    priority = np.random.default_rng(0).uniform(0.1, 5.0, 64)
    buf.extend(rows(64), priority=priority)
    counts = np.zeros(64)
    for _ in range(200):
        _, info = buf.sample(256, return_info=True)
        counts += np.bincount(info["index"].numpy(), minlength=64)
    weight = priority**alpha
    assert chi2_p(counts, counts.sum() * weight / weight.sum()) > P_MIN
    # and a uniform buffer draws uniformly (and weighs everything 1)
    flat = Buffer(64, seed=3)
    flat.extend(rows(64))
    _, info = flat.sample(20_000, return_info=True)
    seen = np.bincount(info["index"].numpy(), minlength=64)
    assert chi2_p(seen, np.full(64, 20_000 / 64)) > P_MIN
    assert torch.all(info["weight"] == 1) and torch.allclose(
        info["probability"], torch.full((20_000,), 1 / 64, dtype=torch.float64)
    )


def test_probabilities_and_weights_match_their_formulas() -> None:
    alpha, beta, eps = 0.6, 0.4, 1e-6
    buf = Buffer(32, sampler="prioritized", seed=1)  # the defaults: 0.6, 0.4, 1e-6
    priority = np.linspace(0.5, 8.0, 32)
    buf.extend(rows(32), priority=priority)
    data, info = buf.sample(500, return_info=True)
    w = (priority + eps) ** alpha
    index = info["index"].numpy()
    assert np.allclose(info["probability"].numpy(), w[index] / w.sum())
    p_min = w.min() / w.sum()
    assert np.allclose(info["weight"].numpy(), (w[index] / w.sum() / p_min) ** -beta, rtol=1e-5)
    assert info["weight"].dtype == torch.float32 and float(info["weight"].max()) <= 1.0
    assert torch.equal(data["id"], torch.from_numpy(index + 1))  # rows match their index
    assert info["generation"].tolist() == [1] * 500  # every row written once
    _, annealed = buf.sample(500, return_info=True, beta=1.0)  # beta per call
    got = annealed["probability"].numpy()
    assert np.allclose(annealed["weight"].numpy(), (got / p_min) ** -1.0, rtol=1e-5)


def test_new_data_gets_the_largest_priority_seen_and_truncated_batches_keep_theirs() -> None:
    buf = Buffer(8, sampler="prioritized", priority_exponent=1.0, priority_eps=0.0, seed=2)
    with pytest.warns(RuntimeWarning, match="keeping the last 8"):
        buf.extend(rows(12), priority=np.arange(1.0, 13.0))  # keeps rows 4..11, prios 5..12
    _, info = buf.sample(1000, return_info=True)
    ids = buf[:]["id"].tolist()
    assert ids == list(range(5, 13))
    prio = {int(i): p for i, p in zip(info["index"], info["probability"], strict=True)}
    total = sum(range(5, 13))
    assert all(np.isclose(p, (row + 5) / total) for row, p in prio.items())
    buf.extend(rows(2, first=100))  # no priority: the largest seen, 12
    _, info = buf.sample(2000, return_info=True)
    total = sum(range(7, 13)) + 2 * 12
    newest = info["index"].numpy() < 2  # the wrap put them at rows 0 and 1
    assert np.allclose(info["probability"].numpy()[newest], 12 / total)


def test_add_episode_priorities_per_env_in_transition_and_episode_unit() -> None:
    steps = {"obs": torch.arange(6.0).reshape(3, 2, 1), "done": torch.zeros(3, 2, dtype=torch.bool)}
    buf = Buffer(12, sampler="prioritized", priority_exponent=1.0, priority_eps=0.0, seed=0)
    # [L, num_envs] like the data: sub-env 0 gets 1, 2, 3 and sub-env 1 gets 10, 20, 30
    buf.add_episode(steps, num_envs=2, priority=np.array([[1, 10], [2, 20], [3, 30]]))
    leaves = np.frombuffer(buf.sampler.state_dict()["leaves"], dtype=np.float64)
    assert leaves[:6].tolist() == [1, 2, 3, 10, 20, 30]  # env-major, as the rows are stored
    episodes = Buffer(12, unit="episode", sampler="prioritized", priority_exponent=1.0, seed=0)
    episodes.add_episode(steps, num_envs=2, priority=[1.0, 3.0])
    drawn = episodes.sample_episodes(4000)
    assert isinstance(drawn, TensorDict)
    second = int((drawn["obs"][:, 0, 0] == 1).sum())  # sub-env 1's first step holds obs 1
    assert chi2_p(np.array([4000 - second, second]), np.array([1000.0, 3000.0])) > P_MIN


def test_update_priorities_skips_rows_overwritten_since_their_sample() -> None:
    buf = Buffer(16, sampler="prioritized", priority_exponent=1.0, priority_eps=0.0, seed=4)
    buf.extend(rows(16))
    _, info = buf.sample(64, return_info=True)
    buf.extend(rows(4, first=16))  # overwrites rows 0..3: new data, new stamps
    before = np.frombuffer(buf.sampler.state_dict()["leaves"], dtype=np.float64).copy()
    updated = buf.update_priorities(info["index"], torch.full((64,), 7.0), info["generation"])
    stale = int((info["index"] < 4).sum())
    assert stale > 0 and updated == 64 - stale
    assert buf.stats()["priority_updates_stale"] == stale
    assert buf.stats()["priority_updates"] == updated
    after = np.frombuffer(buf.sampler.state_dict()["leaves"], dtype=np.float64)
    assert np.array_equal(after[:4], before[:4])  # the new rows kept their (max) priority
    sampled = np.unique(info["index"].numpy())
    assert np.all(after[sampled[sampled >= 4]] == 7.0)


def test_an_update_without_generation_takes_the_stamps_of_the_sample_it_answers() -> None:
    """The buffer remembers its last samples' stamps: ``update_priorities(info["index"], p)``
    skips the rows overwritten since as ``generation=info["generation"]`` would; an index
    array that is no recent sample's is applied as given."""
    buf = Buffer(16, sampler="prioritized", priority_exponent=1.0, priority_eps=0.0, seed=4)
    buf.extend(rows(16))
    _, info = buf.sample(64, return_info=True)
    buf.extend(rows(4, first=16))  # overwrites rows 0..3: new data, new stamps
    stale = int((info["index"] < 4).sum())
    assert stale > 0
    assert buf.update_priorities(info["index"], torch.full((64,), 7.0)) == 64 - stale
    assert buf.stats()["priority_updates_stale"] == stale
    leaves = np.frombuffer(buf.sampler.state_dict()["leaves"], dtype=np.float64)
    assert not np.any(leaves[:4] == 7.0)  # the new rows kept their (max) priority
    assert buf.update_priorities(np.arange(4), 2.0) == 4  # never one sample's index: applied
    # without generation every row is updated, the new data included
    assert buf.update_priorities(np.array([0, 1]), [0.5, 0.5]) == 2


def test_sample_episodes_and_slices_honor_the_prioritized_sampler() -> None:
    buf = Buffer(40, unit="episode", sampler="prioritized", priority_exponent=1.0, seed=5)
    for i, prio in enumerate([1.0, 2.0, 5.0]):
        buf.extend(rows(10, first=10 * i), priority=prio)
    drawn = buf.sample_episodes(3000)
    firsts = drawn["id"][:, 0].numpy()
    counts = np.array([(firsts == f).sum() for f in (1, 11, 21)])
    assert chi2_p(counts, 3000 * np.array([1, 2, 5]) / 8) > P_MIN
    data, info = buf.sample_slices(3000, 4, return_info=True)
    assert data.batch_size == torch.Size([3000, 4])
    first_ids = data["id"][:, 0].numpy()
    episode = (first_ids - 1) // 10
    counts = np.bincount(episode, minlength=3)
    assert chi2_p(counts, 3000 * np.array([1, 2, 5]) / 8) > P_MIN
    assert torch.all(data["id"][:, 1:] - data["id"][:, :-1] == 1)  # consecutive, one episode
    assert np.all((first_ids - 1) % 10 <= 6)  # a full slice fits in what is left
    assert np.array_equal(info["index"].numpy() + 1, first_ids)


# -- slices ---------------------------------------------------------------------------------


def test_slices_not_strict_are_padded_with_a_prefix_mask() -> None:
    buf = Buffer(64, unit="episode", seed=6)
    for i, length in enumerate([2, 3, 9, 12]):
        buf.extend(rows(length, first=100 * i))
    strict = buf.sample_slices(400, 5)
    assert "mask" not in strict.keys()
    assert set(((strict["id"][:, 0].numpy() - 1) // 100).tolist()) == {2, 3}  # long ones only
    data = buf.sample_slices(2000, 5, strict=False)
    mask = data["mask"]
    assert mask.dtype == torch.bool and mask.shape == (2000, 5)
    real = mask.sum(1)
    assert torch.all(mask == (torch.arange(5) < real[:, None]))  # a prefix
    assert torch.all(data["id"][~mask] == 0) and torch.all(data["obs"][~mask] == 0)
    assert torch.all(data["id"][mask] > 0)
    episode = (data["id"][:, 0] - 1) // 100
    assert torch.equal(real[episode == 0], torch.full_like(real[episode == 0], 2))
    assert torch.equal(real[episode == 1], torch.full_like(real[episode == 1], 3))
    assert torch.all(real[episode >= 2] == 5)
    # every start equally likely: 2 short episodes (1 start each) + 5 + 8 valid starts
    starts = np.bincount(episode.numpy(), minlength=4)
    assert chi2_p(starts, 2000 * np.array([1, 1, 5, 8]) / 15) > P_MIN
    counted = buf.use_counts[: 2 + 3].sum()  # padding rows are not counted as reads
    assert counted == int(real[episode <= 1].sum())


# -- iterate --------------------------------------------------------------------------------


@pytest.mark.parametrize("total", [50, 51])
def test_iterate_covers_every_row_once_across_two_ranks(total: int) -> None:
    buf = Buffer(64, seed=7)
    buf.extend(rows(total))
    shares = []
    for rank in (0, 1):
        batches = list(buf.iterate(8, rank=rank, world_size=2))
        assert all(len(b) == 8 for b in batches[:-1]) and 0 < len(batches[-1]) <= 8
        shares.append(torch.cat([b["id"] for b in batches]).tolist())
    assert len(shares[0]) == len(shares[1]) == -(-total // 2)  # every rank the same count
    seen = shares[0] + shares[1]
    assert sorted(set(seen)) == list(range(1, total + 1))  # every row
    assert len(seen) - len(set(seen)) == (2 - total % 2) % 2  # padding by wrapping: one repeat
    assert shares[0] != sorted(shares[0])  # shuffled
    # the second pass is another shuffle, still split between the ranks the same way
    again = [torch.cat([b["id"] for b in buf.iterate(8, rank=r, world_size=2)]) for r in (0, 1)]
    assert again[0].tolist() != shares[0]
    assert sorted(set(again[0].tolist() + again[1].tolist())) == list(range(1, total + 1))
    # drop_last: full batches only, no row twice
    full = [list(buf.iterate(8, drop_last=True, rank=r, world_size=2)) for r in (0, 1)]
    ids = [i for part in full for b in part for i in b["id"].tolist()]
    assert all(len(b) == 8 for part in full for b in part) and len(ids) == len(set(ids)) == 48
    # no shuffle: oldest first, round robin
    ordered = torch.cat([b["id"] for b in buf.iterate(10, shuffle=False, rank=1, world_size=2)])
    assert ordered.tolist()[:5] == [2, 4, 6, 8, 10]


def test_iterate_refuses_a_bad_rank() -> None:
    buf = Buffer(8)
    buf.extend(rows(8))
    with pytest.raises(InvalidArgumentError, match="rank"):
        buf.iterate(2, rank=2, world_size=2)
    with pytest.raises(InvalidArgumentError, match="batch_size"):
        buf.iterate(0)


# -- without replacement, fifo --------------------------------------------------------------


def test_without_replacement_epoch_hands_out_every_row_once() -> None:
    buf = Buffer(40, sampler="without-replacement", seed=8)
    buf.extend(rows(40))
    epoch = torch.cat([buf.sample(8)["id"] for _ in range(5)])
    assert sorted(epoch.tolist()) == list(range(1, 41))
    assert buf.stats()["sampler"]["epoch"] == 1
    before = snapshot(buf)
    with pytest.raises(InvalidArgumentError, match="episode unit"):
        buf.sample_episodes(2)  # a call this sampler does not serve in transition unit
    assert snapshot(buf) == before
    nxt = torch.cat([buf.sample(8)["id"] for _ in range(5)])
    assert sorted(nxt.tolist()) == list(range(1, 41)) and buf.stats()["sampler"]["epoch"] == 2


def test_fifo_hands_out_oldest_first_and_holds_writers_back() -> None:
    buf = Buffer(20, unit="episode", sampler="fifo", max_times_sampled=1, seed=9)
    for i in range(4):
        buf.extend(rows(5, first=10 * i))
    first = buf.sample_episodes(1)
    assert first["id"][0, 0].item() == 1  # the oldest
    two = buf.sample_episodes(2)
    assert two["id"][:, 0].tolist() == [11, 21]  # then in insertion order
    for i in range(3):  # overwriting consumed episodes is fine
        buf.extend(rows(5, first=100 + 10 * i))
    before = snapshot(buf)
    with pytest.raises(WaitTimeoutError, match="not handed out"):
        buf.extend(rows(5, first=200))  # would overwrite episode 3, not consumed yet
    assert snapshot(buf) == before
    assert buf.sample_episodes(1)["id"][0, 0].item() == 31
    buf.extend(rows(5, first=200))  # now it may
    assert [ep["id"][0].item() for ep in buf[:]] == [101, 111, 121, 201]
    for expected in (101, 111, 121, 201):
        assert buf.sample_episodes(1)["id"][0, 0].item() == expected
    with pytest.raises(EmptyBufferError):
        buf.sample_episodes(1)  # everything consumed


# -- rate limiter ---------------------------------------------------------------------------


def test_min_size_refuses_samples_until_enough_rows() -> None:
    buf = Buffer(32, rate_limiter="min-size", min_size=10, seed=0)
    buf.extend(rows(5))
    before = snapshot(buf)
    with pytest.raises(WaitTimeoutError, match=r"min-size\(min_size=10\).*size=5"):
        buf.sample(4)
    assert snapshot(buf) == before
    buf.extend(rows(5, first=5))
    assert len(buf.sample(4)) == 4


def test_sample_to_insert_ratio_refuses_both_ways_and_names_its_counts() -> None:
    buf = Buffer(
        64, rate_limiter="sample-to-insert", samples_per_insert=1.0, min_size=4, error_buffer=8
    )
    buf.extend(rows(4))
    buf.sample(8)  # diff 4 - 8 = -4 >= R*N - E = -4
    with pytest.raises(WaitTimeoutError, match=r"sample-to-insert.*sampled=8"):
        buf.sample(1)
    buf.extend(rows(16, first=4))  # (4 + 16) - 8 = 12 <= R*N + E
    before = snapshot(buf)
    with pytest.raises(WaitTimeoutError, match=r"cannot reserve 1 rows now: rate limiter"):
        buf.extend(rows(1, first=20))  # 13 > 12, and samples may go: inserts wait
    assert snapshot(buf) == before
    buf.sample(2)
    buf.extend(rows(1, first=20))
    stats = buf.stats()["rate_limiter"]
    assert (stats["inserted"], stats["sampled"]) == (21, 10)


@pytest.mark.parametrize(
    ("options", "word"),
    [
        ({"sampler": "uniform", "priority_exponent": 0.5}, "priority_exponent"),
        ({"sampler": "fifo", "importance_exponent": 0.5}, "importance_exponent"),
        ({"sampler": "nope"}, "unknown sampler"),
        ({"rate_limiter": "none", "min_size": 3}, "min_size"),
        ({"rate_limiter": "sample-to-insert", "samples_per_insert": 2}, "error_buffer"),
        ({"sampler": "prioritized", "priority_exponent": -1}, "priority_exponent"),
        ({"sampler": PrioritizedSampler(), "priority_eps": 0.1}, "constructor"),
    ],
)
def test_bad_sampler_or_limiter_options_are_refused(options: dict[str, Any], word: str) -> None:
    with pytest.raises(InvalidArgumentError, match=word):
        Buffer(8, **options)


# -- bad input changes nothing --------------------------------------------------------------


def prioritized(unit: str = "transition", **options: Any) -> Buffer:
    buf = Buffer(16, unit=unit, sampler="prioritized", seed=10, **options)
    buf.extend(rows(8), priority=np.arange(1.0, 9.0) if unit == "transition" else 2.0)
    return buf


@pytest.mark.parametrize(
    ("priority", "word"),
    [
        (-1.0, "priority"),
        (float("nan"), "priority"),
        (np.ones(3), "8 values"),
        ([1.0] * 7 + [-2.0], r"priority\[7\]"),
    ],
)
def test_bad_write_priority_is_refused_before_anything_is_written(priority: Any, word: str) -> None:
    buf = prioritized()
    before = snapshot(buf)
    with pytest.raises(InvalidArgumentError, match=word):
        buf.extend(rows(8, first=8), priority=priority)
    assert snapshot(buf) == before and buf.num_rows == 8


@pytest.mark.parametrize(
    ("index", "priority", "generation", "word"),
    [
        ([0, 1], [1.0, -1.0], None, "priority"),
        ([0, 1], [1.0, float("nan")], None, "priority"),
        ([0, 1, 2], [1.0, 2.0], None, "3 values"),
        ([0, 16], [1.0, 1.0], None, "index 16 out of range"),
        ([-1, 2], [1.0, 1.0], None, "index -1 out of range"),
        ([0, 1], [1.0, 1.0], [1], "generation"),
        ([[0, 1]], [1.0, 1.0], None, "1-D"),
    ],
)
def test_bad_priority_update_is_refused_and_nothing_applied(
    index: Any, priority: Any, generation: Any, word: str
) -> None:
    buf = prioritized()
    before = snapshot(buf)
    with pytest.raises(InvalidArgumentError, match=word):
        buf.update_priorities(np.array(index), np.array(priority), generation)
    assert snapshot(buf) == before
    assert buf.stats()["priority_updates"] == 0


def test_priorities_on_a_sampler_that_keeps_none_are_refused() -> None:
    buf = Buffer(16, seed=0)
    buf.extend(rows(8))
    before = snapshot(buf)
    with pytest.raises(InvalidArgumentError, match="keeps no priorities"):
        buf.extend(rows(4), priority=1.0)
    with pytest.raises(InvalidArgumentError, match="prioritized"):
        buf.update_priorities([0, 1], [1.0, 2.0])
    assert snapshot(buf) == before


@pytest.mark.parametrize(
    ("make", "call", "word"),
    [
        (lambda: Buffer(16, sampler="without-replacement"), "episodes", "episode unit"),
        (lambda: Buffer(16, sampler="without-replacement"), "slices", "episode unit"),
        (lambda: Buffer(16, unit="episode", sampler="without-replacement"), "rows", "transition"),
        (lambda: Buffer(16, sampler="prioritized", max_times_sampled=2), "episodes", "unit"),
        (lambda: Buffer(16), "n=0", "n must be >= 1"),
        (lambda: Buffer(16, sampler="prioritized"), "beta=-1", "beta"),
        (lambda: Buffer(16, sampler="fifo", max_times_sampled=1), "beta=nan", "beta"),
    ],
)
def test_a_call_the_sampler_cannot_serve_is_refused_and_changes_nothing(
    make: Any, call: str, word: str
) -> None:
    buf = make()
    buf.extend(rows(8))
    before = snapshot(buf)
    with pytest.raises(InvalidArgumentError, match=word):
        if call == "episodes":
            buf.sample_episodes(2)
        elif call == "slices":
            buf.sample_slices(2, 3)
        elif call == "rows":
            buf.sample(2)
        elif call == "n=0":
            buf.sample(0)
        else:
            buf.sample(2, beta=float(call.split("=")[1]))
    assert snapshot(buf) == before


def test_slices_mask_refused_when_the_schema_has_a_mask_key() -> None:
    buf = Buffer(16, unit="episode")
    buf.extend({"obs": torch.zeros(4, 2), "mask": torch.ones(4, dtype=torch.bool)})
    with pytest.raises(InvalidArgumentError, match="'mask'"):
        buf.sample_slices(2, 3, strict=False)


def test_a_sampler_serves_one_buffer_only() -> None:
    sampler = PrioritizedSampler()
    Buffer(8, sampler=sampler)
    with pytest.raises(InvalidArgumentError, match="already belongs"):
        Buffer(8, sampler=sampler)


# -- limits: the sum tree stays finite, a sample's size is capped, min_size fits ------------


@pytest.fixture(params=["numpy", "compiled"])
def tree_loops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The prioritized sampler's sum tree with numpy loops, then compiled (the fast extra)."""
    from shmbuffer.samplers import sumtree

    if request.param == "numpy":
        monkeypatch.setattr(sumtree, "jit_available", lambda: None)
    elif sumtree.jit_available() is None:
        pytest.skip("numba (the fast extra) is not installed")
    return str(request.param)


@pytest.mark.usefixtures("tree_loops")
@pytest.mark.parametrize("alpha", [1.0, 2.0])
def test_a_priority_that_could_overflow_the_sum_tree_is_refused_whole(alpha: float) -> None:
    """Finite priorities whose weights ``(p + eps) ** alpha`` would add up past float64's
    largest value (or overflow alone) are refused like inf and NaN, naming the value, with
    nothing changed; the largest accepted ones, on every leaf at once, keep the total finite.
    64 leaves: the compiled tree has levels above them (it walks 16 per step)."""
    buf = Buffer(64, sampler="prioritized", priority_exponent=alpha, seed=1)
    buf.extend(rows(64), priority=np.arange(1.0, 65.0))
    before = snapshot(buf)
    with pytest.raises(InvalidArgumentError, match=r"priority\[0\] = 1e\+308"):
        buf.update_priorities(np.arange(6), np.full(6, 1e308))
    with pytest.raises(InvalidArgumentError, match=r"priority\[2\] = 1e\+307"):
        buf.update_priorities(np.arange(6), [1.0, 2.0, 1e307, 1.0, 1.0, 1.0])
    with pytest.raises(InvalidArgumentError, match="priority"):
        buf.extend(rows(4, first=64), priority=1e308)
    assert snapshot(buf) == before and buf.stats()["priority_updates"] == 0
    largest = buf.sampler.priority_limit * (1 - 1e-9)  # what the tree can hold
    assert buf.update_priorities(np.arange(64), np.full(64, largest)) == 64
    total = buf.sampler.stats()["priority_total"]
    assert np.isfinite(total) and total > 0
    _, info = buf.sample(32, return_info=True)
    assert bool(torch.isfinite(info["weight"]).all()) and bool((info["probability"] > 0).all())


def test_a_sample_over_the_protocol_limits_is_refused_before_anything_is_drawn() -> None:
    """The in-process Buffer refuses what a daemon refuses: over ``MAX_SAMPLE`` items, or over
    ``MAX_SAMPLE_ROWS`` rows, with LimitExceededError naming the argument, nothing drawn."""
    from shmbuffer.errors import LimitExceededError
    from shmbuffer.wire.protocol import MAX_SAMPLE, MAX_SAMPLE_ROWS

    buf = Buffer(16, unit="episode", seed=0)
    buf.add_episode(rows(8))
    before = snapshot(buf)
    with pytest.raises(LimitExceededError, match=f"batch_size={MAX_SAMPLE + 1:,}"):
        buf.sample(MAX_SAMPLE + 1)
    with pytest.raises(LimitExceededError, match=f"n={MAX_SAMPLE + 1:,}"):
        buf.sample_episodes(MAX_SAMPLE + 1)
    with pytest.raises(LimitExceededError, match=f"n={MAX_SAMPLE + 1:,}"):
        buf.sample_slices(MAX_SAMPLE + 1, 1)
    with pytest.raises(LimitExceededError, match=f"of {MAX_SAMPLE_ROWS + 1:,} rows each"):
        buf.sample_slices(1, MAX_SAMPLE_ROWS + 1)
    with pytest.raises(LimitExceededError, match=f"{MAX_SAMPLE_ROWS:,} rows"):
        buf.sample_slices(2, MAX_SAMPLE_ROWS // 2 + 1)
    # episodes of 8 rows: 2**20 of them would be 2**23 rows, under the row limit
    assert snapshot(buf) == before
    assert buf.sample(MAX_SAMPLE).shape == (MAX_SAMPLE,)  # the limit itself is allowed


@pytest.mark.parametrize("limiter", ["min-size", "sample-to-insert"])
def test_a_min_size_above_the_capacity_is_refused(limiter: str) -> None:
    options: dict[str, Any] = {"samples_per_insert": 1.0, "error_buffer": 2.0}
    if limiter == "min-size":
        options = {}
    with pytest.raises(InvalidArgumentError, match=r"min_size=17 .*capacity of 16"):
        Buffer(16, rate_limiter=limiter, min_size=17, **options)
    buf = Buffer(16, rate_limiter=limiter, min_size=16, **options)  # a full ring samples
    buf.extend(rows(16))
    assert buf.sample(2).shape == (2,)
