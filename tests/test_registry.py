"""Tests of shmbuffer.registry.intervals: unit tests, a stateful model check, draw statistics."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from shmbuffer.errors import EmptyBufferError, NotFoundError
from shmbuffer.registry.intervals import Episode, EpisodeRegistry, uniform_integers


def make(capacity: int = 100, *intervals: tuple[int, int]) -> EpisodeRegistry:
    reg = EpisodeRegistry(capacity)
    for s, e in intervals:
        reg.add(s, e)
    return reg


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


# ---------------------------------------------------------------------- construction / add


def test_capacity_validation() -> None:
    with pytest.raises(ValueError, match="capacity"):
        EpisodeRegistry(0)
    with pytest.raises(ValueError):
        EpisodeRegistry(-3)
    reg = EpisodeRegistry(1)
    assert reg.capacity == 1
    assert reg.add(0, 1) == 0


def test_episode_length() -> None:
    assert Episode(3, 10, 17).length == 7
    with pytest.raises(AttributeError):
        Episode(3, 10, 17).start = 4  # type: ignore[misc]


def test_add_assigns_increasing_ids() -> None:
    reg = EpisodeRegistry(100)
    assert reg.next_id == 0
    assert [reg.add(0, 10), reg.add(10, 15), reg.add(50, 100)] == [0, 1, 2]
    assert reg.next_id == 3
    assert len(reg) == 3
    assert reg.num_rows == 10 + 5 + 50
    assert list(reg) == [Episode(0, 0, 10), Episode(1, 10, 15), Episode(2, 50, 100)]


@pytest.mark.parametrize(
    ("start", "end", "match"),
    [
        (5, 5, "start < end"),
        (6, 5, "start < end"),
        (-1, 5, "outside"),
        (90, 101, "outside"),
    ],
)
def test_add_rejects_bad_intervals(start: int, end: int, match: str) -> None:
    reg = EpisodeRegistry(100)
    with pytest.raises(ValueError, match=match):
        reg.add(start, end)
    assert len(reg) == 0
    assert reg.next_id == 0


@pytest.mark.parametrize(("start", "end"), [(5, 15), (15, 25), (12, 18), (0, 100), (19, 20)])
def test_add_rejects_overlap_and_names_both(start: int, end: int) -> None:
    reg = make(100, (10, 20))
    with pytest.raises(ValueError) as info:
        reg.add(start, end)
    msg = str(info.value)
    assert f"[{start}, {end})" in msg
    assert "[10, 20)" in msg
    assert len(reg) == 1
    assert reg.next_id == 1


def test_adjacent_intervals_do_not_overlap() -> None:
    reg = make(100, (10, 20))
    reg.add(0, 10)
    reg.add(20, 30)
    assert len(reg) == 3


def test_add_accepts_numpy_ints() -> None:
    reg = EpisodeRegistry(100)
    assert reg.add(np.int64(3), np.int32(7)) == 0
    assert reg.get(np.int64(0)) == Episode(0, 3, 7)


# ---------------------------------------------------------------------- evict / remove


def test_overlapping_and_evict() -> None:
    reg = make(100, (50, 60), (0, 10), (10, 20), (30, 40))
    assert reg.overlapping(5, 35) == [Episode(1, 0, 10), Episode(2, 10, 20), Episode(3, 30, 40)]
    assert reg.overlapping(20, 30) == []
    assert reg.overlapping(19, 21) == [Episode(2, 10, 20)]
    assert reg.overlapping(7, 7) == []
    assert reg.overlapping(0, 100) == list(reg)
    assert len(reg) == 4

    evicted = reg.evict(5, 35)
    assert evicted == [Episode(1, 0, 10), Episode(2, 10, 20), Episode(3, 30, 40)]
    assert list(reg) == [Episode(0, 50, 60)]
    assert reg.num_rows == 10
    assert reg.evict(0, 50) == []
    reg.add(0, 50)  # the freed space is reusable
    assert reg.evict(0, 100) == [Episode(0, 50, 60), Episode(4, 0, 50)]
    assert len(reg) == 0
    assert reg.num_rows == 0


def test_evict_rejects_reversed_range() -> None:
    reg = make(100, (0, 10))
    with pytest.raises(ValueError):
        reg.evict(10, 5)
    with pytest.raises(ValueError):
        reg.overlapping(10, 5)


def test_remove_and_get() -> None:
    reg = make(100, (0, 10), (10, 20), (20, 30))
    assert reg.get(1) == Episode(1, 10, 20)
    assert 1 in reg
    assert reg.remove(1) == Episode(1, 10, 20)
    assert 1 not in reg
    assert len(reg) == 2
    assert reg.num_rows == 20
    assert [ep.id for ep in reg] == [0, 2]
    with pytest.raises(NotFoundError, match="1"):
        reg.get(1)
    with pytest.raises(NotFoundError):
        reg.remove(1)
    with pytest.raises(NotFoundError):
        reg.get(99)
    with pytest.raises(KeyError):  # NotFoundError is a KeyError
        reg.get(-1)
    reg.add(10, 20)  # the interval is free again
    assert [ep.id for ep in reg] == [0, 2, 3]


def test_contains_odd_keys() -> None:
    reg = make(100, (0, 10), (10, 20))
    assert 0 in reg
    assert np.int64(1) in reg
    assert "0" not in reg
    assert 0.0 not in reg
    assert None not in reg
    assert True not in reg
    assert 5 not in reg
    with pytest.raises(NotFoundError):
        reg.get("0")  # type: ignore[arg-type]


def test_clear_never_reuses_ids() -> None:
    reg = make(100, (0, 10), (10, 20))
    reg.clear()
    assert len(reg) == 0
    assert reg.num_rows == 0
    assert list(reg) == []
    assert reg.next_id == 2
    assert reg.add(0, 10) == 2
    assert 0 not in reg
    assert reg.get(2) == Episode(2, 0, 10)


def test_fifo_ring_many_wraps() -> None:
    # A ring writer: episodes of varying length, evict before each add.
    cap = 97
    reg = EpisodeRegistry(cap)
    r = rng(1)
    pos = 0
    expected: list[tuple[int, int, int]] = []
    for _ in range(2000):
        n = int(r.integers(1, 12))
        if pos + n > cap:
            pos = 0
        gone = reg.evict(pos, pos + n)
        gone_ids = {ep.id for ep in gone}
        expected = [x for x in expected if x[0] not in gone_ids]
        expected.append((reg.add(pos, pos + n), pos, pos + n))
        pos += n
    assert [(ep.id, ep.start, ep.end) for ep in reg] == expected
    assert reg.num_rows == sum(e - s for _, s, e in expected)
    assert len(reg._ids) <= 256  # storage does not grow without bound


# ---------------------------------------------------------------------- positions


def test_at_and_negative_positions() -> None:
    reg = make(100, (50, 60), (0, 10), (10, 20))
    assert reg.at(0) == Episode(0, 50, 60)
    assert reg.at(2) == Episode(2, 10, 20)
    assert reg.at(-1) == Episode(2, 10, 20)
    assert reg.at(-3) == Episode(0, 50, 60)
    for bad in (3, -4, 100):
        with pytest.raises(IndexError, match="out of range for 3 live episodes"):
            reg.at(bad)
    reg.remove(1)
    assert reg.at(1) == Episode(2, 10, 20)
    assert reg.at(-2) == Episode(0, 50, 60)
    with pytest.raises(IndexError):
        EpisodeRegistry(5).at(0)


def test_at_many() -> None:
    reg = make(100, (50, 60), (0, 10), (10, 20))
    ids, starts, ends = reg.at_many(np.array([0, -1, 1, 1]))
    assert ids.dtype == np.int64
    assert starts.dtype == np.int64
    assert ends.dtype == np.int64
    assert ids.tolist() == [0, 2, 1, 1]
    assert starts.tolist() == [50, 10, 0, 0]
    assert ends.tolist() == [60, 20, 10, 10]
    with pytest.raises(IndexError):
        reg.at_many(np.array([0, 3]))
    with pytest.raises(IndexError):
        reg.at_many(np.array([-4]))
    with pytest.raises(TypeError):
        reg.at_many(np.array([0.5]))
    empty = reg.at_many(np.array([], dtype=np.int64))
    assert all(a.size == 0 for a in empty)


def test_rows_at() -> None:
    reg = make(100, (50, 53), (0, 2), (10, 14))
    # logical rows: 50 51 52 | 0 1 | 10 11 12 13
    all_rows = reg.rows_at(np.arange(9))
    assert all_rows.dtype == np.int64
    assert all_rows.tolist() == [50, 51, 52, 0, 1, 10, 11, 12, 13]
    assert reg.rows_at(np.array([-1, -9, 3])).tolist() == [13, 50, 0]
    with pytest.raises(IndexError, match="out of range for 9"):
        reg.rows_at(np.array([9]))
    with pytest.raises(IndexError):
        reg.rows_at(np.array([-10]))
    reg.remove(1)
    assert reg.rows_at(np.arange(7)).tolist() == [50, 51, 52, 10, 11, 12, 13]
    with pytest.raises(IndexError):
        EpisodeRegistry(10).rows_at(np.array([0]))


# ---------------------------------------------------------------------- sampling


def test_sampling_empty_and_bad_n() -> None:
    reg = EpisodeRegistry(10)
    with pytest.raises(EmptyBufferError, match="0 live episodes"):
        reg.sample_episodes(4, rng())
    with pytest.raises(EmptyBufferError, match="0 rows"):
        reg.sample_rows(4, rng())
    with pytest.raises(EmptyBufferError):
        reg.sample_slices(4, 1, rng())
    reg.add(0, 3)
    with pytest.raises(EmptyBufferError, match="long enough"):
        reg.sample_slices(4, 4, rng())
    for bad in (0, -1):
        with pytest.raises(ValueError):
            reg.sample_episodes(bad, rng())
        with pytest.raises(ValueError):
            reg.sample_rows(bad, rng())
        with pytest.raises(ValueError):
            reg.sample_slices(bad, 1, rng())
    with pytest.raises(ValueError):
        reg.sample_slices(1, 0, rng())


def test_sample_shapes_and_validity() -> None:
    reg = make(1000, (100, 150), (0, 10), (500, 503), (200, 260))
    reg.remove(2)  # a middle tombstone
    live = {ep.id: ep for ep in reg}
    ids, starts, ends = reg.sample_episodes(500, rng())
    assert ids.shape == starts.shape == ends.shape == (500,)
    assert ids.dtype == np.int64
    for i, s, e in zip(ids.tolist(), starts.tolist(), ends.tolist(), strict=True):
        assert (live[i].start, live[i].end) == (s, e)
    rows = reg.sample_rows(500, rng())
    assert rows.dtype == np.int64
    assert all(any(ep.start <= r < ep.end for ep in live.values()) for r in rows.tolist())
    starts = reg.sample_slices(500, 20, rng())
    assert starts.dtype == np.int64
    for s in starts.tolist():
        assert any(ep.start <= s and s + 20 <= ep.end for ep in live.values())
    # slices of the maximal length can only start at the start of the longest episode
    assert set(reg.sample_slices(50, 60, rng()).tolist()) == {200}


def test_sample_episodes_uniform() -> None:
    reg = EpisodeRegistry(10_000)
    for k in range(20):
        reg.add(k * 100, k * 100 + 1 + k * 3)
    for k in (3, 7, 11):  # tombstones exercise the rejection path
        reg.remove(k)
    n = 60_000
    ids, _, _ = reg.sample_episodes(n, rng(42))
    counts = np.bincount(ids, minlength=20)
    live = [ep.id for ep in reg]
    assert set(np.flatnonzero(counts).tolist()) == set(live)
    expected = n / len(live)
    chi2 = float((((counts[live] - expected) ** 2) / expected).sum())
    assert chi2 < 60  # 16 dof: mean 16, p(chi2 > 60) ~ 1e-7


def test_sample_rows_length_weighted() -> None:
    reg = EpisodeRegistry(10_000)
    lengths = [1, 2, 5, 10, 50, 100, 300]
    pos = 0
    for length in lengths:
        reg.add(pos, pos + length)
        pos += length + 7
    n = 200_000
    rows = reg.sample_rows(n, rng(7))
    eps = list(reg)
    counts = np.array([((rows >= ep.start) & (rows < ep.end)).sum() for ep in eps])
    assert counts.sum() == n  # every row inside a live episode
    expected = n * np.array(lengths) / sum(lengths)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 40  # 6 dof
    # within the longest episode, rows are uniform too
    last = eps[-1]
    within = np.bincount(rows[rows >= last.start] - last.start, minlength=last.length)
    assert within.min() > 0.5 * within.mean()


def test_sample_slices_weighting() -> None:
    reg = make(1000, (0, 4), (100, 110), (200, 203))  # weights for length 4: 1, 7, 0
    starts = reg.sample_slices(80_000, 4, rng(3))
    counts = np.bincount(starts, minlength=1000)
    assert counts[0] > 0
    assert counts[1:4].sum() == 0
    assert counts[200:].sum() == 0
    assert counts[107:].sum() == 0
    per_start = counts[[0, *range(100, 107)]]
    assert per_start.min() > 0.8 * 10_000
    assert per_start.max() < 1.2 * 10_000
    assert set(reg.sample_slices(100, 1, rng()).tolist()) <= set(
        [*range(4), *range(100, 110), *range(200, 203)]
    )


def test_slice_weights_kept_up_to_date_on_add() -> None:
    reg = make(1000, (0, 4))
    assert set(reg.sample_slices(10, 4, rng()).tolist()) == {0}  # builds the length-4 totals
    reg.add(100, 110)  # weight 7, appended to the cached totals
    reg.add(200, 203)  # weight 0
    counts = np.bincount(reg.sample_slices(80_000, 4, rng(9)), minlength=1000)
    assert counts[0] > 0.8 * 10_000
    assert counts[100] > 0.8 * 10_000
    assert counts[106] > 0.8 * 10_000
    assert counts[107:].sum() == 0
    reg.evict(0, 4)  # a head removal keeps the totals
    assert set(reg.sample_slices(1000, 4, rng()).tolist()) == set(range(100, 107))


def test_sampling_is_deterministic_for_a_seed() -> None:
    reg = make(1000, (0, 50), (100, 140), (500, 700))
    a = reg.sample_rows(64, rng(5))
    b = reg.sample_rows(64, rng(5))
    assert np.array_equal(a, b)


def test_cache_invalidated_on_mutation() -> None:
    reg = make(100, (0, 10))
    assert set(reg.sample_rows(100, rng()).tolist()) <= set(range(10))
    reg.add(50, 60)
    reg.evict(0, 10)
    assert set(reg.sample_rows(100, rng()).tolist()) <= set(range(50, 60))
    assert set(reg.sample_slices(100, 5, rng()).tolist()) <= set(range(50, 56))
    reg.add(0, 20)
    assert reg.rows_at(np.array([10])).tolist() == [0]
    assert set(reg.sample_slices(200, 15, rng()).tolist()) == set(range(6))


# ---------------------------------------------------------------------- state


def test_state_round_trip_json() -> None:
    reg = make(100, (50, 60), (0, 10), (10, 20))
    reg.remove(1)
    state = json.loads(json.dumps(reg.to_state()))
    assert state == {"capacity": 100, "next_id": 3, "episodes": [[0, 50, 60], [2, 10, 20]]}
    back = EpisodeRegistry.from_state(state)
    assert list(back) == list(reg)
    assert back.next_id == 3
    assert back.num_rows == reg.num_rows
    assert back.capacity == 100
    assert back.add(20, 30) == 3


def test_from_state_rejects_inconsistent() -> None:
    base = {"capacity": 100, "next_id": 3, "episodes": [[0, 0, 10], [2, 10, 20]]}
    EpisodeRegistry.from_state(base)
    for bad in (
        {**base, "next_id": 2},
        {**base, "episodes": [[2, 0, 10], [0, 10, 20]]},
        {**base, "episodes": [[0, 0, 10], [1, 5, 20]]},
        {**base, "episodes": [[0, 0, 101]]},
        {**base, "episodes": [[0, 5, 5]]},
    ):
        with pytest.raises(ValueError):
            EpisodeRegistry.from_state(bad)


def test_growth_and_compaction_with_middle_removals() -> None:
    reg = EpisodeRegistry(100_000)
    for k in range(1000):
        reg.add(k * 10, k * 10 + 5)
    for k in range(0, 1000, 3):
        reg.remove(k)
    kept = [k for k in range(1000) if k % 3]
    assert [ep.id for ep in reg] == kept
    assert reg.at(-1).id == 998
    assert reg.num_rows == 5 * len(kept)
    assert reg.rows_at(np.array([0, 5])).tolist() == [10, 20]
    assert reg._tombstones * 4 <= len(reg)


# ---------------------------------------------------------------------- stateful model check

CAP = 64


class RegistryMachine(RuleBasedStateMachine):
    """The registry against a list of (id, start, end) in insertion order."""

    @initialize()
    def setup(self) -> None:
        self.reg = EpisodeRegistry(CAP)
        self.model: list[tuple[int, int, int]] = []
        self.next_id = 0
        self.rng = np.random.default_rng(0)
        self.removed: list[tuple[int, int, int]] = []  # bounds an abort may bring back

    def _model_overlapping(self, start: int, end: int) -> list[tuple[int, int, int]]:
        return [x for x in self.model if start < end and x[1] < end and start < x[2]]

    @rule(start=st.integers(0, CAP - 1), length=st.integers(1, 12))
    def add(self, start: int, length: int) -> None:
        end = min(CAP, start + length)
        gone = self.reg.evict(start, end)
        expected = self._model_overlapping(start, end)
        assert [(e.id, e.start, e.end) for e in gone] == expected
        self.model = [x for x in self.model if x not in expected]
        self.removed += expected
        new_id = self.reg.add(start, end)
        assert new_id == self.next_id
        self.next_id += 1
        self.model.append((new_id, start, end))

    @rule(
        start=st.integers(0, CAP - 1), lengths=st.lists(st.integers(1, 6), min_size=2, max_size=5)
    )
    def add_run(self, start: int, lengths: list[int]) -> None:
        """A reservation's commit: adjacent episodes from ``start``, wrapping at the ring's
        end (an episode that straddles it becomes two), into rows just evicted."""
        bounds, row = [], start
        for length in lengths:
            left = length
            while left:
                take = min(left, CAP - row)
                bounds.append((row, row + take))
                row, left = (row + take) % CAP, left - take
        for s, e in bounds:
            gone = self.reg.evict(s, e)
            self.model = [x for x in self.model if x not in [(g.id, g.start, g.end) for g in gone]]
            self.removed += [(g.id, g.start, g.end) for g in gone]
        used = sorted(bounds)
        if any(a[1] > b[0] for a, b in itertools.pairwise(used)):  # more than the ring
            with pytest.raises(ValueError, match="overlap"):
                self.reg.add_run(bounds)
            return
        event(f"add_run of {min(len(bounds), 3)}+ episodes")
        first = self.reg.add_run(bounds)
        assert first == self.next_id
        self.model += [(first + i, s, e) for i, (s, e) in enumerate(bounds)]
        self.next_id += len(bounds)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def add_run_overlapping_fails(self, data: st.DataObject) -> None:
        _, s, e = data.draw(st.sampled_from(self.model))
        bounds = [(s, e), (e, e + 1)] if e < CAP else [(s - 1, s), (s, e)] if s else [(s, e)] * 2
        before = (list(self.reg), self.reg.next_id, self.reg._spans._starts[:])
        with pytest.raises(ValueError, match="overlap"):
            self.reg.add_run(bounds)
        assert (list(self.reg), self.reg.next_id, self.reg._spans._starts) == before

    @precondition(lambda self: len(self.model) >= 2)
    @rule(data=st.data(), how=st.sampled_from(["oldest", "run", "any"]))
    def remove_many(self, data: st.DataObject, how: str) -> None:
        """An eviction's removals: a run of consecutive ids (the vectorised path; the oldest
        or from the middle) or any subset."""
        if how == "any":
            picked = sorted(data.draw(st.sets(st.sampled_from(self.model), min_size=1)))
        else:
            i = 0 if how == "oldest" else data.draw(st.integers(0, len(self.model) - 2))
            picked = self.model[i : data.draw(st.integers(i + 2, len(self.model)))]
        event(f"remove_many: {how}")
        if self.removed and data.draw(st.booleans()):  # one dead id: refused, nothing changes
            dead = data.draw(st.sampled_from(self.removed))[0]
            if all(x[0] != dead for x in self.model):
                before = list(self.reg)
                with pytest.raises(NotFoundError):
                    self.reg.remove_many([x[0] for x in picked] + [dead])
                assert list(self.reg) == before
        self.reg.remove_many([x[0] for x in picked])
        self.model = [x for x in self.model if x not in picked]
        self.removed += picked

    @rule(start=st.integers(0, CAP - 1), length=st.integers(1, 12))
    def add_overlapping_fails(self, start: int, length: int) -> None:
        end = min(CAP, start + length)
        if self._model_overlapping(start, end):
            with pytest.raises(ValueError, match="overlaps"):
                self.reg.add(start, end)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        item = data.draw(st.sampled_from(self.model))
        assert self.reg.remove(item[0]) == Episode(*item)
        self.model.remove(item)
        self.removed.append(item)
        with pytest.raises(NotFoundError):
            self.reg.remove(item[0])
        # sample right away, while the tombstone may still be there (queries compact lazily)
        if self.model:
            live = {x[0]: x for x in self.model}
            ids, starts, ends = self.reg.sample_episodes(16, self.rng)
            for i, s, e in zip(ids.tolist(), starts.tolist(), ends.tolist(), strict=True):
                assert live[i] == (i, s, e)

    @rule(start=st.integers(0, CAP), length=st.integers(0, 30))
    def evict(self, start: int, length: int) -> None:
        end = start + length
        expected = self._model_overlapping(start, end)
        assert [(e.id, e.start, e.end) for e in self.reg.overlapping(start, end)] == expected
        gone = self.reg.evict(start, end)
        assert [(e.id, e.start, e.end) for e in gone] == expected
        self.model = [x for x in self.model if x not in expected]
        self.removed += expected

    @rule()
    def clear(self) -> None:
        self.reg.clear()
        self.removed += self.model
        self.model = []

    @precondition(lambda self: bool(self.removed))
    @rule(data=st.data())
    def restore(self, data: st.DataObject) -> None:
        """An aborted reservation's give-back: removed bounds under their old ids, published
        again if they fit between the live ones (a live id: its trimmed front comes back)."""
        picked = data.draw(st.lists(st.sampled_from(self.removed), min_size=1, max_size=4))
        live = {x[0]: x for x in self.model}
        runs, ok = [], True
        for i, s, e in picked:
            if i in live:
                ok &= e == live[i][2] and s < live[i][1]
                runs.append((s, live[i][1]))
            else:
                runs.append((s, e))
        runs.sort()
        ok &= all(a[1] <= b[0] for a, b in itertools.pairwise(runs))
        ok &= not any(s < e2 and s2 < e for s, e in runs for _, s2, e2 in self.model)
        event(f"restore {'applied' if ok else 'refused'}")
        if not ok:
            before = (list(self.reg), self.reg.num_rows, self.reg._spans._starts[:])
            with pytest.raises(ValueError, match="cannot restore"):
                self.reg.restore([Episode(*x) for x in picked])
            assert (list(self.reg), self.reg.num_rows, self.reg._spans._starts) == before
            return
        self.reg.restore([Episode(*x) for x in picked])
        for i, s, e in picked:
            if i in live:
                self.model[self.model.index(live[i])] = (i, s, e)
            else:
                self.model.append((i, s, e))
        self.model.sort()

    @precondition(lambda self: any(e - s > 1 for _, s, e in self.model))
    @rule(data=st.data())
    def trim_front(self, data: st.DataObject) -> None:
        item = data.draw(st.sampled_from([x for x in self.model if x[2] - x[1] > 1]))
        cut = data.draw(st.integers(item[1] + 1, item[2] - 1))
        assert self.reg.trim_front(item[0], cut) == Episode(item[0], cut, item[2])
        self.model[self.model.index(item)] = (item[0], cut, item[2])
        self.removed.append(item)  # an abort gives the front back

    @rule(n=st.integers(1, 20), length=st.integers(1, 8))
    def sample(self, n: int, length: int) -> None:
        if not self.model:
            with pytest.raises(EmptyBufferError):
                self.reg.sample_episodes(n, self.rng)
            with pytest.raises(EmptyBufferError):
                self.reg.sample_rows(n, self.rng)
            return
        live = {x[0]: x for x in self.model}
        ids, starts, ends = self.reg.sample_episodes(n, self.rng)
        for i, s, e in zip(ids.tolist(), starts.tolist(), ends.tolist(), strict=True):
            assert live[i] == (i, s, e)
        # At most CAP candidates and 4000 draws: all of them show up (fixed seed, p ~ 1e-25).
        live_rows = {r for _, s, e in self.model for r in range(s, e)}
        assert set(self.reg.sample_rows(n, self.rng).tolist()) <= live_rows
        assert set(self.reg.sample_rows(4000, self.rng).tolist()) == live_rows
        valid = {r for _, s, e in self.model for r in range(s, e - length + 1)}
        if valid:
            assert set(self.reg.sample_slices(n, length, self.rng).tolist()) <= valid
            assert set(self.reg.sample_slices(4000, length, self.rng).tolist()) == valid
        else:
            with pytest.raises(EmptyBufferError):
                self.reg.sample_slices(n, length, self.rng)

    @invariant()
    def spans_are_the_runs_of_live_rows(self) -> None:
        runs: list[list[int]] = []
        for _, s, e in sorted(self.model, key=lambda x: x[1]):
            if runs and runs[-1][1] == s:
                runs[-1][1] = e
            else:
                runs.append([s, e])
        spans = self.reg._spans
        assert [[s, spans._end_of[s]] for s in spans._starts] == runs
        assert spans._start_of == {e: s for s, e in runs}

    @invariant()
    def matches_model(self) -> None:
        reg, model = self.reg, self.model
        # checked first: the queries below compact lazily
        assert reg._tombstones * 4 <= len(reg)
        assert len(reg) == len(model)
        assert reg.next_id == self.next_id
        assert reg.num_rows == sum(e - s for _, s, e in model)
        assert [(e.id, e.start, e.end) for e in reg] == model
        if model:
            for i in {0, len(model) // 2, len(model) - 1, -1, -len(model)}:
                assert reg.at(i) == Episode(*model[i])
            ids, starts, ends = reg.at_many(np.arange(-len(model), len(model)))
            assert list(zip(ids.tolist(), starts.tolist(), ends.tolist(), strict=True)) == (
                model + model
            )
            rows = [r for _, s, e in model for r in range(s, e)]
            probe = sorted({0, len(rows) // 3, len(rows) - 1, -1, -len(rows)})
            assert reg.rows_at(np.array(probe)).tolist() == [rows[p] for p in probe]
        with pytest.raises(IndexError):
            reg.at(len(model))
        with pytest.raises(IndexError):
            reg.rows_at(np.array([reg.num_rows]))
        for i in range(max(0, self.next_id - 5), self.next_id + 1):
            in_model = any(x[0] == i for x in model)
            assert (i in reg) == in_model
            if not in_model:
                with pytest.raises(NotFoundError):
                    reg.get(i)
        for x in model:
            assert reg.get(x[0]) == Episode(*x)
        back = EpisodeRegistry.from_state(json.loads(json.dumps(reg.to_state())))
        assert list(back) == list(reg)
        assert back.next_id == reg.next_id
        assert back.num_rows == reg.num_rows


RegistryMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_registry_state_machine = RegistryMachine.TestCase


# ---------------------------------------------------------------------- uniform integers


@pytest.mark.parametrize("high", [1, 2, 7, 1000, 2**40 + 3])
def test_uniform_integers_range_and_chi_square(high: int) -> None:
    draws = uniform_integers(rng(3), high, 60_000)
    assert draws.dtype == np.int64 and draws.min() >= 0 and draws.max() < high
    if 1 < high <= 1000:
        counts = np.bincount(draws, minlength=high)
        expected = draws.size / high
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < high - 1 + 5 * np.sqrt(2 * (high - 1))  # ~5 sigma of chi2(high - 1)


def test_uniform_integers_redraws_words_past_the_last_multiple() -> None:
    # 2**64 // high == 2: a fifth of the raw words lie at or above 2 * high and are drawn
    # again (in index order, until none is left). Kept, they would land in the lower half of
    # the residues (1.5x as often there). The draws must be exactly those of the rule.
    high = 2**65 // 5
    limit = 2 * high
    draws = uniform_integers(rng(4), high, 5_000)
    source = rng(4).bit_generator
    words = [int(w) for w in source.random_raw(5_000)]
    bad = [i for i, w in enumerate(words) if w >= limit]
    assert 800 < len(bad) < 1_200
    while bad:
        for i, w in zip(bad, source.random_raw(len(bad)), strict=True):
            words[i] = int(w)
        bad = [i for i in bad if words[i] >= limit]
    assert draws.tolist() == [w % high for w in words]


def test_uniform_integers_is_reproducible() -> None:
    assert np.array_equal(uniform_integers(rng(9), 123, 50), uniform_integers(rng(9), 123, 50))
