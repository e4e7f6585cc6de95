"""Samplers against a real EpisodeRegistry fed the way the container feeds it.

Statistical tests use fixed seeds and a chi-square test at p > 1e-3; exact probabilities and
weights are checked against their formulas.
"""

from __future__ import annotations

import itertools
from typing import Any

import msgpack
import numpy as np
import pytest

from shmbuffer.errors import EmptyBufferError
from shmbuffer.registry.intervals import Episode, EpisodeRegistry
from shmbuffer.samplers import (
    FifoSampler,
    PrioritizedSampler,
    Sampler,
    UniformSampler,
    WithoutReplacementSampler,
    make_sampler,
    sumtree,
)
from shmbuffer.samplers.index import SliceMass
from shmbuffer.samplers.prioritized import last_writes
from tests._stats import P_MIN, chi2_p


class Feed:
    """What the container does around its sampler: reserve (evict, then tell the sampler),
    commit (register, then tell the sampler), in circular mode, both units."""

    def __init__(self, sampler: Sampler, capacity: int, unit: str = "transition") -> None:
        self.sampler, self.capacity, self.unit = sampler, capacity, unit
        self.registry = EpisodeRegistry(capacity)
        self.pointer = 0
        sampler.attach(self.registry, unit, capacity)

    def add(self, *lengths: int, priority: Any = None) -> list[Episode]:
        ranges, _ = self.reserve(*lengths)
        cuts = np.cumsum([0, *lengths]).tolist()
        bounds, offset = [], 0
        for s, e in ranges:  # a chunk straddling the wrap becomes two entries
            for a, b in itertools.pairwise(cuts):
                lo, hi = max(a, offset), min(b, offset + e - s)
                if lo < hi:
                    bounds.append((s + lo - offset, s + hi - offset))
            offset += e - s
        episodes = [Episode(self.registry.add(s, e), s, e) for s, e in bounds]
        self.sampler.on_commit(episodes, priority)
        return episodes

    def reserve(self, *lengths: int) -> tuple[list[tuple[int, int]], list[Episode]]:
        """The rows for ``lengths`` and the episodes their eviction touched (old bounds)."""
        n, cap = sum(lengths), self.capacity
        start, end = self.pointer, self.pointer + n
        if end <= cap:
            ranges = evict = [(start, end)]
        elif self.unit == "episode":  # early wrap: the skipped tail is evicted too
            ranges, evict = [(0, n)], [(start, cap), (0, n)]
        else:
            ranges = evict = [(start, cap), (0, end - cap)]
        touched = []
        for s, e in evict:
            touched += self.registry.overlapping(s, e)
            self._evict(s, e)
        self.pointer = ranges[-1][1] % cap
        return ranges, touched

    def abort(self, touched: list[Episode]) -> None:
        """Container.restore: publish ``touched`` again under their ids, in a new registry."""
        live = {ep.id: ep for ep in self.registry} | {ep.id: ep for ep in touched}
        rows = [[ep.id, ep.start, ep.end] for ep in sorted(live.values(), key=lambda e: e.id)]
        state = {"capacity": self.capacity, "next_id": self.registry.next_id, "episodes": rows}
        self.registry = EpisodeRegistry.from_state(state)
        self.sampler.on_restore(touched, self.registry)

    def _evict(self, start: int, stop: int) -> None:
        if self.unit == "episode":
            self.registry.evict(start, stop)
        else:
            for ep in self.registry.overlapping(start, stop):
                if start <= ep.start and ep.end > stop:
                    self.registry.trim_front(ep.id, stop)
                else:
                    self.registry.remove(ep.id)
        self.sampler.on_evict(start, stop)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def live_rows(reg: EpisodeRegistry) -> np.ndarray:
    return np.concatenate([np.arange(ep.start, ep.end) for ep in reg])


def valid_starts(reg: EpisodeRegistry, length: int) -> np.ndarray:
    return np.concatenate(
        [np.arange(ep.start, ep.end - length + 1) for ep in reg if ep.length >= length]
    )


def churned(sampler: Sampler, unit: str) -> Feed:
    """A ring that has wrapped, trimmed (transition) and evicted."""
    feed = Feed(sampler, 120, unit)
    for n in (17, 9, 30, 4, 25, 13, 21, 8, 19, 11, 27):
        feed.add(n)
    return feed


# ---------------------------------------------------------------------- uniform


@pytest.mark.parametrize("unit", ["transition", "episode"])
def test_uniform_rows_chi_square(unit: str) -> None:
    sampler = UniformSampler()
    feed = churned(sampler, unit)
    rows = live_rows(feed.registry)
    draw = sampler.sample_rows(40_000, rng(1))
    assert np.all(draw.probability == 1 / rows.size)
    counts = np.bincount(draw.rows, minlength=120)
    assert counts.sum() == counts[rows].sum()  # nothing outside committed data
    assert chi2_p(counts[rows], np.full(rows.size, 40_000 / rows.size)) > P_MIN


@pytest.mark.parametrize("unit", ["transition", "episode"])
@pytest.mark.parametrize("make", [UniformSampler, PrioritizedSampler])
def test_slices_uniform_over_valid_starts(unit: str, make: type[Sampler]) -> None:
    # Equal priorities: prioritized slices are uniform over starts in transition unit; in
    # episode unit they pick a (long enough) episode uniformly, then a start inside it.
    sampler = make()
    feed = churned(sampler, unit)
    length = 6
    starts = valid_starts(feed.registry, length)
    draw = sampler.sample_slices(30_000, length, rng(2))
    assert np.all(draw.lengths == length)
    ends = {ep.start: ep.end for ep in feed.registry}
    owner = {r: e for s, e in ends.items() for r in range(s, e)}
    assert all(owner[s] >= s + length for s in draw.starts.tolist())  # never crosses an end
    counts = np.bincount(draw.starts, minlength=120)
    assert counts.sum() == counts[starts].sum()
    if make is UniformSampler or unit == "transition":
        expected = np.full(starts.size, 1 / starts.size)
        assert np.allclose(draw.probability, 1 / starts.size, rtol=1e-12)
    else:
        long = [ep for ep in feed.registry if ep.length >= length]
        share = {
            r: 1 / len(long) / (ep.length - length + 1)
            for ep in long
            for r in range(ep.start, ep.end - length + 1)
        }
        expected = np.array([share[r] for r in starts.tolist()])
        assert np.allclose(draw.probability, 1 / len(long))  # the episode's probability
    assert chi2_p(counts[starts], 30_000 * expected) > P_MIN


@pytest.mark.parametrize("unit", ["transition", "episode"])
def test_uniform_slices_not_strict_pad_short_episodes(unit: str) -> None:
    sampler = UniformSampler()
    feed = Feed(sampler, 100, unit)
    feed.add(3, 12, 5, 20)
    length = 8
    short = [ep for ep in feed.registry if ep.length < length]
    starts = np.concatenate([valid_starts(feed.registry, length), [ep.start for ep in short]])
    draw = sampler.sample_slices(20_000, length, rng(3), strict=False)
    assert np.allclose(draw.probability, 1 / starts.size)
    by_start = {ep.start: ep for ep in short}
    for s, n in zip(draw.starts.tolist(), draw.lengths.tolist(), strict=True):
        assert n == (by_start[s].length if s in by_start else length)
    counts = np.bincount(draw.starts, minlength=100)
    assert counts.sum() == counts[starts].sum()
    assert chi2_p(counts[starts], np.full(starts.size, 20_000 / starts.size)) > P_MIN
    with pytest.raises(EmptyBufferError):
        sampler.sample_slices(1, 50, rng())  # strict: nothing that long


def test_uniform_episodes_and_empty() -> None:
    sampler = UniformSampler()
    feed = Feed(sampler, 50, "episode")
    with pytest.raises(EmptyBufferError):
        sampler.sample_rows(1, rng())
    feed.add(5, 6, 7)
    draw = sampler.sample_episodes(9_000, rng(4))
    assert np.all(draw.probability == 1 / 3)
    assert set(zip(draw.starts.tolist(), draw.ends.tolist(), strict=True)) == {
        (ep.start, ep.end) for ep in feed.registry
    }
    with pytest.raises(ValueError, match="uniform"):
        sampler.update_priorities([0], [1.0])
    with pytest.raises(ValueError, match="keeps no priorities"):
        sampler.check_commit_priority([Episode(9, 30, 31)], 1.0)
    assert np.all(sampler.weights(draw.probability, 0.5) == 1.0)


# ---------------------------------------------------------------------- prioritized


@pytest.fixture(params=["numpy", "compiled"])
def tree_loops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The prioritized sampler's sum tree with numpy loops, then compiled (the fast extra)."""
    if request.param == "numpy":
        monkeypatch.setattr(sumtree, "jit_available", lambda: None)
    elif sumtree.jit_available() is None:
        pytest.skip("numba (the fast extra) is not installed")
    return str(request.param)


@pytest.mark.usefixtures("tree_loops")
def test_prioritized_rows_match_priority_alpha() -> None:
    alpha, beta, eps = 0.7, 0.5, 1e-6
    sampler = PrioritizedSampler(priority_exponent=alpha, importance_exponent=beta)
    feed = Feed(sampler, 64)
    prio = np.linspace(0.1, 3.0, 40)
    feed.add(25, 15, priority=prio)
    w = (prio + eps) ** alpha
    draw = sampler.sample_rows(50_000, rng(5))
    assert np.allclose(draw.probability, w[draw.rows] / w.sum(), rtol=1e-12)
    counts = np.bincount(draw.rows, minlength=40)
    assert chi2_p(counts, 50_000 * w / w.sum()) > P_MIN
    p = draw.probability
    want = (40 * p) ** -beta / (40 * w.min() / w.sum()) ** -beta
    assert np.allclose(sampler.weights(p), want, rtol=1e-12)
    assert np.allclose(sampler.weights(p, 1.0), (p / (w.min() / w.sum())) ** -1.0, rtol=1e-12)
    assert sampler.weights(p).max() <= 1.0


@pytest.mark.usefixtures("tree_loops")
def test_prioritized_episodes_and_new_data_gets_max_priority() -> None:
    sampler = PrioritizedSampler(priority_exponent=1.0, priority_eps=0.0)
    feed = Feed(sampler, 100, "episode")
    feed.add(10, 5, 20, priority=[1.0, 4.0, 2.0])
    (newest,) = feed.add(7)  # no priority: the largest seen, 4
    draw = sampler.sample_episodes(40_000, rng(6))
    expected = {0: 1.0, 10: 4.0, 15: 2.0, newest.start: 4.0}
    assert np.allclose(draw.probability, [expected[s] / 11 for s in draw.starts.tolist()])
    counts = np.array([(draw.starts == s).sum() for s in expected])
    assert chi2_p(counts, 40_000 * np.array(list(expected.values())) / 11) > P_MIN
    rows = sampler.sample_rows(2_000, rng(7))  # episode by priority, a uniform row inside
    _, starts, ends = sampler.index.lookup(rows.rows)
    assert np.all((rows.rows >= starts) & (rows.rows < ends))
    assert np.allclose(rows.probability, [expected[s] / 11 for s in starts.tolist()])


@pytest.mark.usefixtures("tree_loops")
def test_prioritized_slices_in_transition_unit_follow_start_priority() -> None:
    sampler = PrioritizedSampler(priority_exponent=1.0, priority_eps=0.0)
    feed = Feed(sampler, 64)
    prio = np.arange(1, 41, dtype=np.float64)
    feed.add(12, 3, 25, priority=prio)
    length = 4
    starts = valid_starts(feed.registry, length)
    draw = sampler.sample_slices(40_000, length, rng(8))
    assert np.allclose(draw.probability, prio[draw.starts] / prio[starts].sum(), rtol=1e-12)
    counts = np.bincount(draw.starts, minlength=40)
    assert counts.sum() == counts[starts].sum()
    assert chi2_p(counts[starts], 40_000 * prio[starts] / prio[starts].sum()) > P_MIN
    loose = sampler.sample_slices(5_000, length, rng(9), strict=False)
    admitted = np.concatenate([starts, [12]])  # the 3-row chunk joins at its first row
    assert np.allclose(loose.probability, prio[loose.starts] / prio[admitted].sum())
    assert set(loose.starts.tolist()) <= set(admitted.tolist())
    assert np.all(loose.lengths[loose.starts == 12] == 3)


def test_prioritized_slices_in_episode_unit() -> None:
    sampler = PrioritizedSampler(priority_exponent=1.0, priority_eps=0.0)
    feed = Feed(sampler, 100, "episode")
    feed.add(10, 3, 20, priority=[2.0, 5.0, 1.0])
    draw = sampler.sample_slices(20_000, 5, rng(10))
    assert np.all(draw.lengths == 5)
    first = draw.starts < 10
    assert np.allclose(draw.probability, np.where(first, 2 / 3, 1 / 3))
    assert chi2_p(np.array([first.sum(), (~first).sum()]), 20_000 * np.array([2, 1]) / 3) > P_MIN
    assert np.all((draw.starts <= 5) | ((draw.starts >= 13) & (draw.starts <= 28)))
    loose = sampler.sample_slices(20_000, 5, rng(11), strict=False)
    short = loose.starts == 10
    assert np.all(loose.lengths[short] == 3) and np.allclose(loose.probability[short], 5 / 8)


@pytest.mark.usefixtures("tree_loops")
def test_update_priorities_skips_empty_rows_and_rejects_bad_input() -> None:
    sampler = PrioritizedSampler()
    feed = Feed(sampler, 50)
    feed.add(10, 10)
    before = sampler.state_dict()
    for rows, prio, match in [
        ([1, 2], [1.0, -1.0], "priority"),
        ([1, 2], [1.0, np.nan], "priority"),
        ([1, 2], [np.inf, 1.0], "priority"),
        ([1, 2], [1.0, 2.0, 3.0], "priority"),
        ([1, 2.5], [1.0, 2.0], "index"),
    ]:
        with pytest.raises(ValueError, match=match):
            sampler.update_priorities(rows, prio)
    with pytest.raises(IndexError, match="index"):
        sampler.update_priorities([1, 50], [1.0, 1.0])
    assert sampler.state_dict() == before
    assert sampler.update_priorities([3, 30, 45, 3], [2.0, 9.0, 9.0, 5.0]) == 2
    assert sampler.stats()["priority_max"] == 5.0  # rows 30 and 45 hold no data
    leaves = np.frombuffer(sampler.state_dict()["leaves"])
    assert leaves[3] == pytest.approx((5.0 + 1e-6) ** 0.6) and leaves[30] == 0.0


def test_commit_priority_validation_changes_nothing() -> None:
    sampler = PrioritizedSampler()
    feed = Feed(sampler, 50, "episode")
    feed.add(5)
    before = sampler.state_dict()
    with pytest.raises(ValueError, match="priority"):
        sampler.on_commit([Episode(1, 5, 9), Episode(2, 9, 12)], [1.0])
    with pytest.raises(ValueError, match="priority"):
        sampler.on_commit([Episode(1, 5, 9)], -2.0)
    assert sampler.state_dict() == before


@pytest.mark.parametrize("unit", ["transition", "episode"])
@pytest.mark.parametrize("make", [UniformSampler, PrioritizedSampler])
def test_slice_masses_stay_exact_under_churn(make: type[Sampler], unit: str) -> None:
    sampler = make()
    feed = Feed(sampler, 200, unit)
    gen = rng(12)
    feed.add(30)
    sampler.sample_slices(4, 7, gen)  # caches the masses for length 7
    for _ in range(60):
        feed.add(int(gen.integers(1, 25)))
        if isinstance(sampler, PrioritizedSampler):
            sampler.update_priorities(gen.integers(0, 200, 8), gen.random(8) * 5)
    leaves = sampler._sum.leaves if isinstance(sampler, PrioritizedSampler) else None
    cached = sampler._masses.get(7, sampler.index, leaves)
    fresh = SliceMass(7, exact=leaves is None)
    fresh.rebuild(sampler.index, leaves)
    assert cached.tail_count == fresh.tail_count and cached.first_count == fresh.first_count
    assert cached.tail_mass == pytest.approx(fresh.tail_mass, rel=1e-9)
    assert cached.first_mass == pytest.approx(fresh.first_mass, rel=1e-9)
    starts = valid_starts(feed.registry, 7)
    if make is UniformSampler:  # and the probabilities use them
        draw = sampler.sample_slices(10, 7, gen)
        assert np.allclose(draw.probability, 1 / starts.size)


# ---------------------------------------------------------------------- without replacement


def test_without_replacement_epoch_hands_each_row_out_once() -> None:
    sampler = WithoutReplacementSampler()
    feed = churned(sampler, "transition")
    rows = live_rows(feed.registry)
    gen, got = rng(13), []
    for n in (7, 30, 1, 50):
        got.append(sampler.sample_rows(n, gen).rows)
    rest = rows.size - sum(map(len, got))
    got.append(sampler.sample_rows(rest, gen).rows)
    assert sampler.stats()["epoch"] == 1
    assert sorted(np.concatenate(got).tolist()) == sorted(rows.tolist())
    sampler.sample_rows(1, gen)
    assert sampler.stats()["epoch"] == 2


def test_without_replacement_skips_evicted_and_defers_new_items() -> None:
    sampler = WithoutReplacementSampler()
    feed = Feed(sampler, 40, "episode")
    feed.add(10, 10, 10)  # ids 0, 1, 2
    gen = rng(14)
    first = int(sampler.sample_episodes(1, gen).ids[0])  # epoch 1 = {0, 1, 2}
    feed.add(10)  # id 3 joins epoch 2
    feed.add(10)  # id 4 at [0, 10): evicts id 0
    rest = []
    while True:
        (got,) = sampler.sample_episodes(1, gen).ids.tolist()
        if sampler.stats()["epoch"] == 2:
            break
        rest.append(got)
    assert sorted(rest) == sorted({1, 2} - {first})
    live = sorted(ep.id for ep in feed.registry)
    epoch2 = [got, *sampler.sample_episodes(len(live) - 1, gen).ids.tolist()]
    assert sorted(epoch2) == live == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="episode unit"):
        sampler.sample_rows(1, gen)


# ---------------------------------------------------------------------- fifo


def test_fifo_hands_episodes_out_in_order_once_and_blocks_overwrite() -> None:
    sampler = FifoSampler(max_times_sampled=1)
    feed = Feed(sampler, 30, "episode")
    eps = feed.add(5, 6, 7)
    assert sampler.blocks_overwrite(0, 3) and not sampler.blocks_overwrite(25, 30)
    a = sampler.sample_episodes(2, rng())
    assert a.ids.tolist() == [eps[0].id, eps[1].id]
    assert not sampler.blocks_overwrite(0, 11) and sampler.blocks_overwrite(10, 12)
    with pytest.raises(EmptyBufferError):
        sampler.sample_episodes(2, rng())  # one left: nothing changes
    b = sampler.sample_episodes(1, rng())
    assert b.ids.tolist() == [eps[2].id] and (b.starts[0], b.ends[0]) == (11, 18)
    assert not sampler.blocks_overwrite(0, 30)
    with pytest.raises(EmptyBufferError):
        sampler.sample_episodes(1, rng())
    assert sampler.stats()["consumed_episodes"] == 3


def test_fifo_rows_and_slices_walk_in_order() -> None:
    sampler = FifoSampler(max_times_sampled=1)
    feed = Feed(sampler, 50)
    feed.add(10)
    feed.add(7)
    assert sampler.sample_rows(4, rng()).rows.tolist() == [0, 1, 2, 3]
    s = sampler.sample_slices(2, 3, rng())  # [4, 7) [7, 10); then the 7-row chunk
    assert s.starts.tolist() == [4, 7] and s.lengths.tolist() == [3, 3]
    s = sampler.sample_slices(3, 3, rng(), strict=False)
    assert s.starts.tolist() == [10, 13, 16] and s.lengths.tolist() == [3, 3, 1]
    assert not sampler.blocks_overwrite(0, 50)
    feed.add(5)
    strict = sampler.sample_slices(1, 3, rng())
    assert strict.starts.tolist() == [17]
    with pytest.raises(EmptyBufferError):
        sampler.sample_slices(1, 3, rng())  # the 2-row tail can never fill a strict slice
    assert sampler.stats()["dropped_rows"] == 2 and not sampler.blocks_overwrite(0, 50)


def test_fifo_without_limit_keeps_returning_the_oldest() -> None:
    sampler = FifoSampler()
    feed = Feed(sampler, 20, "episode")
    feed.add(4, 4)
    for _ in range(3):
        assert sampler.sample_rows(3, rng()).rows.tolist() == [0, 1, 2]
    assert not sampler.blocks_overwrite(0, 20)


def test_fifo_episode_slices_walk_and_count_passes() -> None:
    sampler = FifoSampler(max_times_sampled=2)
    feed = Feed(sampler, 40, "episode")
    feed.add(7, 4)  # id 0 [0, 7), id 1 [7, 11)

    def take(n: int) -> list[int]:
        return sampler.sample_slices(n, 3, rng()).starts.tolist()

    assert take(2) == [0, 3]  # row 6 is left of episode 0's first pass
    with pytest.raises(EmptyBufferError):
        take(2)  # [7, 10), then one pass per episode and call: one slice short
    # The unservable 1-row rest of episode 0 was dropped anyway, ending its first pass.
    assert sampler.stats()["dropped_rows"] == 1
    assert take(2) == [0, 3]  # episode 0, second pass
    assert take(1) == [7]  # the rest of pass 2 is dropped: episode 0 is consumed
    assert sampler.stats()["consumed_episodes"] == 1
    assert not sampler.blocks_overwrite(0, 7) and sampler.blocks_overwrite(7, 8)
    with pytest.raises(EmptyBufferError):
        take(1)  # only episode 1's 1-row rest: dropped, pass 1 of episode 1 ends
    assert take(1) == [7]
    with pytest.raises(EmptyBufferError):
        take(1)
    assert sampler.stats()["consumed_episodes"] == 2 and not sampler.blocks_overwrite(0, 40)


def test_fifo_writer_waits_on_unconsumed_rows_then_wraps() -> None:
    sampler = FifoSampler(max_times_sampled=1)
    feed = Feed(sampler, 20)
    feed.add(12)
    assert sampler.blocks_overwrite(0, 8)  # a writer of 8 more rows would wrap onto them
    sampler.sample_rows(8, rng())
    assert not sampler.blocks_overwrite(0, 8) and sampler.blocks_overwrite(8, 12)
    feed.add(8)  # [12, 20)
    feed.add(8)  # wraps onto the consumed [0, 8): the ring trims, nothing unconsumed lost
    assert sampler.sample_rows(12, rng()).rows.tolist() == list(range(8, 20))
    assert sampler.sample_rows(8, rng()).rows.tolist() == list(range(8))
    assert not sampler.blocks_overwrite(0, 20)


# ---------------------------------------------------------------------- max_times_sampled


@pytest.mark.parametrize("make", [UniformSampler, PrioritizedSampler, FifoSampler])
@pytest.mark.parametrize("unit", ["transition", "episode"])
def test_max_times_sampled_retires_items(make: type[Sampler], unit: str) -> None:
    sampler = make(max_times_sampled=2)
    feed = Feed(sampler, 60, unit)
    feed.add(4, 6, 3, 7)
    gen, seen = rng(15), []
    while True:
        try:
            seen.append(
                sampler.sample_rows(3, gen).rows
                if unit == "transition"
                else sampler.sample_episodes(1, gen).starts
            )
        except EmptyBufferError:
            break
    counts = np.bincount(np.concatenate(seen), minlength=60)
    items = live_rows(feed.registry) if unit == "transition" else [0, 4, 10, 13]
    assert np.all(counts[items] == 2) if unit == "episode" else np.all(counts[items] <= 2)
    assert counts.sum() >= 2 * len(items) - 4  # all served twice but what a last call lacked
    feed.add(5)  # new data is sampleable again
    sampler.sample_rows(1, gen)


# ---------------------------------------------------------------------- state


RESTORABLE = [
    ("uniform", {}),
    ("prioritized", {"max_times_sampled": 5}),
    ("without-replacement", {}),
    ("fifo", {"max_times_sampled": 1}),
]


@pytest.mark.parametrize("unit", ["transition", "episode"])
@pytest.mark.parametrize(("name", "options"), RESTORABLE)
def test_abort_restores_what_eviction_took(name: str, options: dict[str, Any], unit: str) -> None:
    sampler = make_sampler(name, **options)
    feed = churned(sampler, unit)
    gen = rng(17)
    if isinstance(sampler, FifoSampler):
        sampler.sample_rows(30, gen) if unit == "transition" else sampler.sample_episodes(2, gen)
    elif sampler.has_priorities:
        sampler.sample_slices(3, 4, gen)  # a cached slice normaliser must follow the restore
        sampler.update_priorities(np.arange(0, 120, 3), np.arange(0, 120, 3) / 7)
    elif unit == "transition":
        sampler.sample_rows(9, gen)
    before = sampler.state_dict()
    rows = sampler.index.num_rows
    _, touched = feed.reserve(40)  # evicts (and in transition unit trims)
    assert touched and sampler.index.num_rows < rows
    feed.abort(touched)
    assert sampler.state_dict() == before
    assert sampler.index.num_rows == feed.registry.num_rows
    starts = valid_starts(feed.registry, 4)
    if isinstance(sampler, UniformSampler):
        assert np.allclose(sampler.sample_slices(5, 4, gen).probability, 1 / starts.size)
    if isinstance(sampler, PrioritizedSampler):
        w = np.frombuffer(before["leaves"])
        valid = w[starts].sum() if unit == "transition" else None
        draw = sampler.sample_slices(50 if unit == "transition" else 3, 4, gen)
        if valid is not None:
            assert np.allclose(draw.probability, w[draw.starts] / valid)


SAMPLERS = [
    ("uniform", {}),
    ("uniform", {"max_times_sampled": 20}),
    ("prioritized", {}),
    ("prioritized", {"max_times_sampled": 20}),
    ("without-replacement", {}),
    ("fifo", {"max_times_sampled": 2}),
]


def draw_some(sampler: Sampler, unit: str, gen: np.random.Generator) -> list[list[int]]:
    out = []
    for _ in range(3):
        if isinstance(sampler, WithoutReplacementSampler) and unit == "episode":
            out.append(sampler.sample_episodes(2, gen).ids.tolist())
            out.append(sampler.sample_slices(2, 3, gen).starts.tolist())
        elif isinstance(sampler, WithoutReplacementSampler):
            out.append(sampler.sample_rows(5, gen).rows.tolist())
        else:
            out.append(sampler.sample_rows(3, gen).rows.tolist())
            out.append(sampler.sample_slices(2, 3, gen, strict=False).starts.tolist())
    return out


@pytest.mark.parametrize("unit", ["transition", "episode"])
@pytest.mark.parametrize(("name", "options"), SAMPLERS)
def test_state_dict_round_trip(name: str, options: dict[str, Any], unit: str) -> None:
    sampler = make_sampler(name, **options)
    feed = churned(sampler, unit)
    gen = rng(16)
    draw_some(sampler, unit, gen)
    if sampler.has_priorities:
        sampler.update_priorities(np.arange(0, 120, 7), np.arange(0, 120, 7) / 10)
    state = msgpack.unpackb(msgpack.packb(sampler.state_dict()))  # msgpack-able
    copy = make_sampler(name, **options)
    copy.attach(feed.registry, unit, feed.capacity)
    copy.load_state_dict(state)
    assert copy.state_dict() == sampler.state_dict()
    a, b = np.random.default_rng(99), np.random.default_rng(99)
    assert draw_some(copy, unit, a) == draw_some(sampler, unit, b)


def test_load_state_dict_refuses_a_mismatch() -> None:
    sampler = PrioritizedSampler()
    feed = Feed(sampler, 30)
    feed.add(5)
    state = sampler.state_dict()
    other = PrioritizedSampler()
    Feed(other, 30, "episode")
    with pytest.raises(ValueError, match="unit"):
        other.load_state_dict(state)
    empty = PrioritizedSampler()
    Feed(empty, 30)
    with pytest.raises(ValueError, match="no committed data"):
        empty.load_state_dict(state)


def test_make_sampler_names_and_options() -> None:
    for name in ("uniform", "without-replacement", "prioritized", "fifo"):
        assert make_sampler(name).name == name
    with pytest.raises(ValueError, match="expected one of"):
        make_sampler("no-such-sampler")
    with pytest.raises(ValueError, match="priority_exponent"):
        make_sampler("uniform", priority_exponent=0.5)
    with pytest.raises(ValueError, match="max_times_sampled"):
        make_sampler("fifo", max_times_sampled=0)
    with pytest.raises(ValueError, match="priority_exponent"):
        PrioritizedSampler(priority_exponent=-1)


def test_samples_need_a_positive_size() -> None:
    sampler = UniformSampler()
    Feed(sampler, 10).add(5)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="n must be"):
            sampler.sample_rows(bad, rng())
    with pytest.raises(ValueError, match="length"):
        sampler.sample_slices(1, 0, rng())


# ---------------------------------------------------------------------- churn


CHURN = [
    ("uniform", {}),
    ("uniform", {"max_times_sampled": 3}),
    ("prioritized", {"max_times_sampled": 2}),
    ("without-replacement", {}),
    ("fifo", {"max_times_sampled": 1}),
]


@pytest.mark.parametrize("unit", ["transition", "episode"])
@pytest.mark.parametrize(("name", "options"), CHURN)
@pytest.mark.usefixtures("tree_loops")
def test_random_churn_keeps_the_mirror_exact(name: str, options: dict[str, Any], unit: str) -> None:
    """Commits, evictions, aborts, draws and reloads in random order: the sampler's row mirror
    equals the registry, its slice normalisers equal a recount, no dead row has weight."""
    gen = rng(18)
    sampler = make_sampler(name, **options)
    feed = Feed(sampler, 97, unit)
    rows_ok = name != "without-replacement" or unit == "transition"
    slices_ok = name != "without-replacement" or unit == "episode"
    for _ in range(80):
        op = int(gen.integers(0, 5))
        try:
            if op <= 1:
                feed.add(*(int(x) for x in gen.integers(1, 20, int(gen.integers(1, 3)))))
            elif op == 2:
                _, touched = feed.reserve(int(gen.integers(1, 30)))
                if gen.random() < 0.5:
                    feed.abort(touched)
            elif op == 3 and rows_ok:
                sampler.sample_rows(int(gen.integers(1, 9)), gen)
            elif slices_ok:
                strict = bool(gen.integers(0, 2))
                sampler.sample_slices(int(gen.integers(1, 5)), int(gen.integers(1, 8)), gen, strict)
            if sampler.has_priorities:
                sampler.update_priorities(gen.integers(0, 97, 3), gen.random(3))
        except EmptyBufferError:
            pass
        engine = getattr(sampler, "_engine", None) or sampler
        want = np.zeros(97, dtype=np.int64)
        for ep in feed.registry:
            want[ep.start : ep.end] = ep.end
        assert np.array_equal(engine.index.end_of_row, want)
        leaves = engine._sum.leaves if isinstance(engine, PrioritizedSampler) else None
        masses = getattr(engine, "_masses", None)
        for length, mass in masses._by_length.items() if masses is not None else []:
            fresh = SliceMass(length, leaves is None)
            fresh.rebuild(engine.index, leaves)
            assert (mass.tail_count, mass.first_count) == (fresh.tail_count, fresh.first_count)
            assert mass.tail_mass == pytest.approx(fresh.tail_mass, abs=1e-9)
        if leaves is not None:
            assert not np.any((leaves > 0) & (want == 0))
    copy = make_sampler(name, **options)
    copy.attach(feed.registry, unit, 97)
    copy.load_state_dict(sampler.state_dict())
    assert copy.state_dict() == sampler.state_dict()


@pytest.mark.parametrize("bound", [1000, 1 << 60])  # the packed sort, and the stable argsort
def test_last_writes_keeps_the_last_of_each_key(bound: int) -> None:
    """Keys ascending without repeats, each with the position of its last occurrence: what a
    loop of writes in batch order leaves behind."""
    rng = np.random.default_rng(4)
    for n in (1, 2, 7, 256, 1000):
        keys = rng.integers(0, min(bound, 50), n) * (bound // 50)
        uniq, last = last_writes(keys, bound)
        model: dict[int, int] = {}
        for pos, key in enumerate(keys.tolist()):
            model[key] = pos
        assert uniq.tolist() == sorted(model)
        assert last.tolist() == [model[k] for k in sorted(model)]
