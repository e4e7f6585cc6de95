"""Several tables over one ring, in process: each hears what the ring does, samples on its own.

A ring holds the rows (pointer, reservations, registry, eviction); a table is a sampler, a rate
limiter, a generator and use counts over it, told every commit, eviction, restore, clear and
load through the ring's listener contract, and asked before a reservation whether it must wait.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from shmbuffer.errors import EmptyBufferError, WaitTimeoutError
from shmbuffer.registry.intervals import Episode
from shmbuffer.ring.container import Container
from shmbuffer.ring.listeners import Range, RingListener, SampleRecord
from shmbuffer.ring.ring import Ring
from shmbuffer.ring.table import Table
from shmbuffer.samplers import (
    FifoSampler,
    PrioritizedSampler,
    SampleToInsertRatio,
    UniformSampler,
)


def put(ring: Ring, rows: int, episodes: int = 1) -> list[int]:
    return ring.commit(ring.reserve(ring.plan(rows, episodes)).id)


def live(table: Table) -> set[int]:
    """Episode ids the table's sampler hands out: a FIFO's oldest as many as the ring holds
    (it would hand out one it missed the eviction of), any other's in many draws."""
    n = table.ring.num_episodes if table.sampler.name == "fifo" else 64
    return {int(i) for i in table.sample_episodes(n).ids}


class Recorder(RingListener):
    """Writes down every notification and the registry as it stood when told."""

    def __init__(self, ring: Ring) -> None:
        self.ring = ring
        self.heard: list[tuple[Any, ...]] = []

    def ids(self) -> list[int]:
        return [ep.id for ep in self.ring.registry]

    def on_commit(
        self,
        episodes: Sequence[Episode],
        ranges: Sequence[Range],
        priority: Any,
        members: Any = None,
    ) -> None:
        self.heard.append(("commit", [ep.id for ep in episodes], list(ranges), self.ids()))

    def on_evict(self, start: int, stop: int, evicted: Sequence[Episode], rows: int) -> None:
        self.heard.append(("evict", (start, stop), [ep.id for ep in evicted], rows, self.ids()))

    def on_restore(self, episodes: Sequence[Episode], rows: int) -> None:
        self.heard.append(("restore", [ep.id for ep in episodes], rows, self.ids()))

    def on_clear(self, rows: int) -> None:
        self.heard.append(("clear", rows, self.ids()))

    def on_load(self) -> None:
        self.heard.append(("load", self.ids()))


def test_a_listener_is_told_each_change_after_the_registry_made_it() -> None:
    ring = Ring(6, unit="episode")
    heard = Recorder(ring)
    ring.listen(heard)
    put(ring, 3)
    put(ring, 3)
    wrap = ring.reserve(ring.plan(2))  # evicts episode 0 (rows 0-2)
    ring.abort(wrap.id, written=0)  # nothing touched: episode 0 comes back
    ring.clear()
    assert heard.heard == [
        ("commit", [0], [(0, 3)], [0]),
        ("commit", [1], [(3, 6)], [0, 1]),
        ("evict", (0, 2), [0], 3, [1]),
        ("restore", [0], 3, [0, 1]),
        ("clear", 6, []),
    ]


def test_a_listener_is_registered_once() -> None:
    ring = Ring(4)
    heard = Recorder(ring)
    ring.listen(heard)
    with pytest.raises(ValueError, match="already"):
        ring.listen(heard)
    assert ring.listeners == (heard,)


def test_a_listener_may_ask_a_reservation_to_wait() -> None:
    ring = Ring(4)

    class Gate(RingListener):
        closed: str | None = "the gate is closed"

        def insert_blocker(
            self, num_rows: int, evict: Sequence[Range], members: Any = None
        ) -> str | None:
            return self.closed

    gate = Gate()
    ring.listen(gate)
    plan = ring.plan(2)
    assert plan.blocked == "the gate is closed"
    with pytest.raises(WaitTimeoutError, match="gate"):
        ring.reserve(plan)
    assert (ring.pointer, ring.rows_written, ring.reservations) == (0, 0, {})
    gate.closed = None
    assert ring.plan(2).blocked is None


@pytest.mark.parametrize("unit", ["transition", "episode"])
def test_two_tables_hear_commits_evictions_restores_and_clear(unit: str) -> None:
    ring = Ring(9, unit=unit)
    uniform = Table(ring, seed=0)
    fifo = Table(ring, sampler=FifoSampler(), seed=1)
    assert ring.listeners == (uniform, fifo)
    ids = put(ring, 3) + put(ring, 3) + put(ring, 3)
    for table in (uniform, fifo):
        assert table.use_counts.tolist() == [0] * 9
        assert live(table) == set(ids)
        assert table.rate_limiter.inserted == 9
    wrap = ring.reserve(ring.plan(3))  # over the oldest chunk
    for table in (uniform, fifo):
        assert table.use_counts[:3].tolist() == [-1, -1, -1]
        assert live(table) == set(ids[1:])
        assert table.rate_limiter.deleted == 3
    ring.abort(wrap.id, written=0)  # nothing was copied: the evicted chunk comes back
    for table in (uniform, fifo):
        assert table.use_counts[:3].tolist() == [0, 0, 0]
        assert live(table) == set(ids)
        assert table.rate_limiter.deleted == 0
    ring.clear()
    for table in (uniform, fifo):
        assert table.use_counts.tolist() == [-1] * 9
        assert table.rate_limiter.deleted == 9
        with pytest.raises(EmptyBufferError):
            table.sample_rows(1)


def test_each_table_samples_with_its_own_generator_use_counts_and_limiter() -> None:
    c = Container(20, seed=0)
    second = c.add_table(
        "ratio",
        rate_limiter=SampleToInsertRatio(samples_per_insert=1.0, min_size=1, error_buffer=4.0),
        seed=7,
    )
    assert c.tables == {"default": c.table, "ratio": second}
    c.commit(c.reserve_rows(10).id)
    first = c.sample_rows(8)
    assert c.use_counts[:10].sum() == 8 and second.use_counts[:10].sum() == 0
    assert (c.rate_limiter.sampled, second.rate_limiter.sampled) == (8, 0)
    other = second.sample_rows(8)
    assert second.use_counts[:10].sum() == 8 and c.use_counts[:10].sum() == 8
    assert not np.array_equal(first.rows, other.rows)  # another seed, another generator
    # The second table's limiter holds its own reads back; the default table's has no limit.
    with pytest.raises(WaitTimeoutError):
        second.sample_rows(8)
    assert second.sample_blocker(8) is not None and c.sample_blocker(8) is None
    c.sample_rows(8)
    assert c.rate_limiter.sampled == 16


def test_a_fifo_tables_unconsumed_rows_hold_back_the_rings_writes() -> None:
    c = Container(6, unit="episode")  # a uniform default table: it never holds writes back
    queue = c.add_table("queue", sampler=FifoSampler(max_times_sampled=1))
    c.commit(c.reserve_rows(3).id)
    c.commit(c.reserve_rows(3).id)
    plan = c.plan(3)  # would overwrite episode 0, not consumed from the queue yet
    assert plan.blocked is not None and "fifo" in plan.blocked
    with pytest.raises(WaitTimeoutError):
        c.reserve(plan)
    c.sample_episodes(2)  # the default table's reads consume nothing
    assert c.plan(3).blocked is not None
    queue.sample_episodes(1)  # the queue hands episode 0 out: its rows may go
    assert c.plan(3).blocked is None
    c.reserve(c.plan(3))


def proportional() -> PrioritizedSampler:
    """Probabilities proportional to the priorities: what the tests below compute."""
    return PrioritizedSampler(priority_exponent=1.0, priority_eps=0.0)


def test_priorities_updated_in_one_table_leave_the_others_alone() -> None:
    c = Container(8, sampler=proportional(), seed=0)
    second = c.add_table("second", sampler=proportional(), seed=0)
    c.commit(c.reserve_rows(8).id, priority=1.0)
    assert second.update_priorities(np.array([0]), np.array([50.0])) == 1
    assert (c.priority_updates, second.priority_updates) == (0, 1)
    mine, theirs = c.sample_rows(64), second.sample_rows(64)
    assert np.allclose(mine.probability, 1 / 8)  # as committed
    assert np.allclose(theirs.probability, np.where(theirs.rows == 0, 50 / 57, 1 / 57))
    c.update_priorities(np.array([1]), np.array([0.0]))
    theirs = second.sample_rows(256)
    assert 1 in theirs.rows.tolist()  # still drawn there: the default table's update is its own
    assert np.allclose(theirs.probability, np.where(theirs.rows == 0, 50 / 57, 1 / 57))


def test_a_commit_priority_reaches_the_tables_that_keep_priorities() -> None:
    c = Container(4, unit="episode", sampler=proportional(), seed=0)
    plain = c.add_table("plain", sampler=UniformSampler())
    keeping = c.add_table("keeping", sampler=proportional())
    c.commit(c.reserve_rows(2).id, priority=9.0)
    c.commit(c.reserve_rows(2).id, priority=1.0)
    for table in (c.table, keeping):
        assert np.allclose(sorted(set(table.sample_episodes(32).probability)), [0.1, 0.9])
    assert np.allclose(plain.sample_episodes(32).probability, 0.5)


def test_each_table_tells_its_own_sample_log() -> None:
    c = Container(10)
    second = c.add_table("second")

    class Log:
        def __init__(self) -> None:
            self.draws: list[SampleRecord] = []

        def room_for_sample(self, n: int) -> None:
            return None

        def sampled(self, draw: SampleRecord) -> None:
            self.draws.append(draw)

    log = Log()
    second.listen(log)
    c.commit(c.reserve_rows(10).id)
    c.sample_rows(3)
    second.sample_rows(4)
    assert [draw.n for draw in log.draws] == [4]
    assert c.sample_log is None


def test_a_loaded_state_reaches_every_table() -> None:
    saved = Container(8, unit="episode", seed=0)
    for _ in range(4):
        saved.commit(saved.reserve_rows(2).id)
    state = saved.state()
    c = Container(8, unit="episode", seed=0)
    second = c.add_table("second", sampler=FifoSampler())
    c.load_state(state)
    now = c.state()
    assert list(now.pop("tables")) == ["second"]  # a table the state had not: started over
    assert now.pop("table") == "default"
    assert now == state  # the default table's parts, as saved
    assert second.use_counts.tolist() == [0] * 8
    assert second.rate_limiter.inserted == 8
    assert live(second) == {0, 1, 2, 3}


def test_a_table_over_a_ring_holding_episodes_starts_from_them() -> None:
    ring = Ring(6, unit="episode")
    put(ring, 2)
    put(ring, 2)
    late = Table(ring, sampler=FifoSampler(), seed=0)
    assert late.use_counts.tolist() == [0, 0, 0, 0, -1, -1]
    assert late.rate_limiter.inserted == 4
    assert live(late) == {0, 1}


def test_a_second_table_gets_its_own_sampler() -> None:
    c = Container(4)
    with pytest.raises(ValueError, match="already belongs"):
        c.add_table("again", sampler=c.sampler)
    with pytest.raises(ValueError, match="default"):
        c.add_table("default")
