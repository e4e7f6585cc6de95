"""Container: modes and units, wrap-around, eviction, reservations in flight, use counters."""

from __future__ import annotations

import json

import msgpack
import numpy as np
import pytest

from shmbuffer.errors import CapacityError, InvalidArgumentError, NotFoundError, WaitTimeoutError
from shmbuffer.ring.container import Container
from shmbuffer.samplers import FifoSampler, MinSize, PrioritizedSampler


def episodes(c: Container) -> list[tuple[int, int, int]]:
    return [(ep.id, ep.start, ep.end) for ep in c.registry]


def put(c: Container, rows: int, sub: int = 1) -> list[int]:
    return c.commit(c.reserve_rows(rows, sub).id)


# -- construction ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["circular", "fixed"])
@pytest.mark.parametrize("unit", ["transition", "episode"])
def test_modes_and_units(mode: str, unit: str) -> None:
    c = Container(4, mode=mode, unit=unit)
    assert (c.mode, c.unit, c.pointer, len(c)) == (mode, unit, 0, 0)
    assert c.use_counts.tolist() == [-1] * 4


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"mode": "ring"}, "mode"),
        ({"mode": "Circular"}, "mode"),
        ({"unit": "step"}, "unit"),
    ],
)
def test_unknown_mode_or_unit_refused(kwargs: dict[str, str], word: str) -> None:
    with pytest.raises(ValueError, match=word):
        Container(4, **kwargs)


@pytest.mark.parametrize("capacity", [0, -1, 2.0, True])
def test_bad_capacity(capacity: object) -> None:
    with pytest.raises((ValueError, TypeError)):
        Container(capacity)  # type: ignore[arg-type]


def test_bad_reservation_sizes() -> None:
    c = Container(10)
    with pytest.raises(ValueError):
        c.reserve_rows(0)
    with pytest.raises(ValueError):
        c.reserve_rows(5, 2)
    with pytest.raises(CapacityError):
        c.reserve_rows(11)
    assert c.pointer == 0 and c.reservations == {}


# -- fixed mode ------------------------------------------------------------------------------


@pytest.mark.parametrize("unit", ["transition", "episode"])
def test_fixed_full_refuses_and_changes_nothing(unit: str) -> None:
    c = Container(10, mode="fixed", unit=unit)
    put(c, 6)
    before = (c.pointer, c.rows_written, episodes(c), c.use_counts.tolist())
    with pytest.raises(CapacityError, match="full"):
        c.reserve_rows(5)
    assert (c.pointer, c.rows_written, episodes(c), c.use_counts.tolist()) == before
    assert c.reservations == {}
    put(c, 3)  # what fits still fits


@pytest.mark.parametrize("unit", ["transition", "episode"])
def test_fixed_exactly_full_refuses(unit: str) -> None:
    c = Container(10, mode="fixed", unit=unit)
    put(c, 5)
    put(c, 5)
    with pytest.raises(CapacityError):
        c.reserve_rows(3)
    assert episodes(c) == [(0, 0, 5), (1, 5, 10)]


# -- circular, transition unit ---------------------------------------------------------------


def test_transition_wrap_splits_and_keeps_surviving_tail() -> None:
    c = Container(10)
    assert put(c, 6) == [0]
    c.count_use(np.array([0, 4, 5]))
    r = c.reserve_rows(6)
    assert r.ranges == [(6, 10), (0, 2)]
    assert r.evicted == []  # chunk 0 is only trimmed
    assert episodes(c) == [(0, 2, 6)]  # its surviving tail stays readable
    assert c.use_counts.tolist() == [-1, -1, 0, 0, 1, 1, -1, -1, -1, -1]
    assert c.pointer == 2
    assert c.commit(r.id) == [1, 2]  # a chunk straddling the wrap is two entries
    assert episodes(c) == [(0, 2, 6), (1, 6, 10), (2, 0, 2)]
    assert len(c) == 10


def test_transition_overwrite_evicts_whole_chunks_when_fully_covered() -> None:
    c = Container(10)
    put(c, 3)
    put(c, 3)
    put(c, 4)
    assert c.pointer == 0
    r = c.reserve_rows(4)  # covers chunk 0 [0, 3) whole and chunk 1 [3, 6) in part
    assert [ep.id for ep in r.evicted] == [0]
    assert episodes(c) == [(1, 4, 6), (2, 6, 10)]
    c.commit(r.id)
    assert episodes(c) == [(1, 4, 6), (2, 6, 10), (3, 0, 4)]
    assert len(c) == 10


# -- circular, episode unit ------------------------------------------------------------------


def test_episode_unit_early_wrap_evicts_skipped_tail() -> None:
    c = Container(10, unit="episode")
    put(c, 4)  # [0, 4)
    put(c, 4)  # [4, 8)
    r = c.reserve_rows(3)  # does not fit [8, 11): wraps early to row 0
    assert r.ranges == [(0, 3)]
    assert [ep.id for ep in r.evicted] == [0]
    assert c.pointer == 3
    c.commit(r.id)
    assert episodes(c) == [(1, 4, 8), (2, 0, 3)]
    assert len(c) == 2

    c2 = Container(10, unit="episode")
    put(c2, 6)  # [0, 6)
    put(c2, 3)  # [6, 9)
    r = c2.reserve_rows(2)  # skips row 9, wraps: evicts episode 0 (rows 0..1) and nothing at 9
    assert r.ranges == [(0, 2)]
    assert episodes(c2) == [(1, 6, 9)]
    assert c2.use_counts[9] == -1


def test_episode_unit_partial_overlap_evicts_whole_episode() -> None:
    c = Container(10, unit="episode")
    put(c, 5)
    put(c, 5)
    r = c.reserve_rows(2)
    assert [ep.id for ep in r.evicted] == [0]
    assert episodes(c) == [(1, 5, 10)]
    assert len(c) == 1


def test_episode_unit_eviction_resets_use_counts_of_whole_episode() -> None:
    c = Container(10, unit="episode")
    put(c, 5)
    put(c, 5)
    c.count_use(np.arange(10))
    c.reserve_rows(2)
    assert c.use_counts.tolist() == [-1] * 5 + [1] * 5


# -- reservations ----------------------------------------------------------------------------


@pytest.mark.parametrize("unit", ["transition", "episode"])
def test_in_flight_rows_never_evicted_or_overlapped(unit: str) -> None:
    c = Container(10, unit=unit)
    first = c.reserve_rows(6)
    with pytest.raises(CapacityError, match="in flight"):
        c.reserve_rows(6)
    assert c.pointer == 6 and list(c.reservations) == [first.id]
    second = c.reserve_rows(4)
    assert second.ranges == [(6, 10)]
    with pytest.raises(CapacityError, match="in flight"):
        c.reserve_rows(1)
    assert c.reserved_rows == 10
    c.commit(first.id)
    third = c.reserve_rows(2)
    assert third.ranges == [(0, 2)]
    assert c.reserved_rows == 6


def test_abort_leaves_rows_unpublished() -> None:
    c = Container(10)
    put(c, 3)
    r = c.reserve_rows(4)
    c.abort(r.id)
    assert episodes(c) == [(0, 0, 3)]
    assert c.use_counts.tolist() == [0, 0, 0] + [-1] * 7
    assert c.reservations == {}
    with pytest.raises(NotFoundError):
        c.commit(r.id)
    with pytest.raises(NotFoundError):
        c.abort(r.id)
    assert put(c, 2) == [1]  # the ring moves on; aborted rows stay holes
    assert episodes(c) == [(0, 0, 3), (1, 7, 9)]


def test_reservation_ids_and_owner() -> None:
    c = Container(10)
    a = c.reserve_rows(1, owner="w1")
    b = c.reserve_rows(1)
    assert (a.id, b.id, a.owner, b.owner) == (1, 2, "w1", None)
    assert a.num_rows == 1


# -- use counters ----------------------------------------------------------------------------


def test_use_counters() -> None:
    c = Container(6)
    assert c.use_counts.tolist() == [-1] * 6  # unwritten
    r = c.reserve_rows(4)
    assert c.use_counts.tolist() == [-1] * 6  # reserved is not written
    c.commit(r.id)
    assert c.use_counts.tolist() == [0, 0, 0, 0, -1, -1]  # fresh
    c.count_use(np.array([1, 1, 1, 3]))  # duplicates count each time
    assert c.use_counts.tolist() == [0, 3, 0, 1, -1, -1]
    c.clear()
    assert c.use_counts.tolist() == [-1] * 6
    assert c.pointer == 0 and len(c) == 0


def test_clear_keeps_open_reservations() -> None:
    c = Container(6)
    put(c, 2)
    r = c.reserve_rows(2)
    c.clear()
    assert c.pointer == 4 and r.id in c.reservations
    assert c.commit(r.id) == [1]
    assert episodes(c) == [(1, 2, 4)]


# -- sub-episodes ----------------------------------------------------------------------------


@pytest.mark.parametrize("unit", ["transition", "episode"])
def test_multi_sub_episode_reservation_registers_each(unit: str) -> None:
    c = Container(12, unit=unit)
    r = c.reserve_rows(6, 3)
    assert r.episodes == [(0, 2), (2, 4), (4, 6)]
    assert c.commit(r.id) == [0, 1, 2]
    assert episodes(c) == [(0, 0, 2), (1, 2, 4), (2, 4, 6)]
    assert len(c) == (6 if unit == "transition" else 3)


def test_sub_episode_straddling_wrap_becomes_two_entries() -> None:
    c = Container(10)
    put(c, 7)
    r = c.reserve_rows(6, 2)  # rows [7, 10) + [0, 3); sub-episodes of 3: [7,10) and [0,3)
    assert r.ranges == [(7, 10), (0, 3)]
    assert r.episodes == [(7, 10), (0, 3)]
    c.abort(r.id)

    c = Container(10)
    put(c, 8)
    r = c.reserve_rows(6, 2)  # rows [8, 10) + [0, 4); sub-episode 0 = rows 8, 9, 0
    assert r.ranges == [(8, 10), (0, 4)]
    assert r.episodes == [(8, 10), (0, 1), (1, 4)]
    assert c.commit(r.id) == [1, 2, 3]
    assert episodes(c) == [(0, 4, 8), (1, 8, 10), (2, 0, 1), (3, 1, 4)]


def test_episode_unit_sub_episodes_never_wrap() -> None:
    c = Container(10, unit="episode")
    put(c, 7)
    r = c.reserve_rows(6, 2)
    assert r.ranges == [(0, 6)]
    assert r.episodes == [(0, 3), (3, 6)]


# -- an abort gives back what its reservation evicted and left untouched -----------------------


def _state(c: Container) -> tuple[object, ...]:
    return (episodes(c), c.pointer, c.rows_written, c.use_counts.tolist())


@pytest.mark.parametrize(
    ("capacity", "unit", "mode", "writes", "rows"),
    [
        (6, "episode", "circular", [2, 2, 2], 4),  # evicts two whole episodes
        (8, "episode", "circular", [3, 3, 2, 3, 3], 3),  # early wrap: evicts the skipped tail
        (6, "transition", "circular", [3, 3], 4),  # evicts one chunk, trims the next
        (6, "transition", "circular", [2, 2, 2, 2], 5),  # wraps: two ranges
        (10, "transition", "fixed", [2, 2], 3),  # fixed mode gets its rows back
    ],
)
def test_abort_that_wrote_nothing_leaves_the_container_as_before(
    capacity: int, unit: str, mode: str, writes: list[int], rows: int
) -> None:
    c = Container(capacity, mode=mode, unit=unit)
    for n in writes:
        put(c, n)
    c.count_use(np.array([0, 1]))
    before = _state(c)
    r = c.reserve_rows(rows)
    assert (r.evicted or r.trimmed or mode == "fixed") and _state(c) != before
    restored = c.abort(r.id, written=0)
    assert _state(c)[:3] == before[:3]
    assert sorted(ep.id for ep in restored) == sorted(ep.id for ep in (*r.evicted, *r.trimmed))
    # use counts of the restored rows restart at 0; every other row is as it was
    published = np.array(before[3]) >= 0
    assert np.array_equal(np.array(_state(c)[3]) >= 0, published)
    assert put(c, 1) == [c.registry.next_id - 1]  # and the ring goes on from where it stood


def test_abort_after_a_partial_copy_gives_back_only_untouched_episodes() -> None:
    c = Container(8, unit="episode")
    for _ in range(4):
        put(c, 2)  # episodes 0..3 at [0,2) [2,4) [4,6) [6,8); pointer back at 0
    r = c.reserve_rows(6)  # evicts episodes 0, 1, 2
    assert [ep.id for ep in r.evicted] == [0, 1, 2]
    restored = c.abort(r.id, written=3)  # rows 0..2 may have changed
    assert [ep.id for ep in restored] == [2]
    assert episodes(c) == [(2, 4, 6), (3, 6, 8)]
    assert c.pointer == 6  # rows were touched: the ring does not go back over them
    assert c.use_counts.tolist() == [-1] * 4 + [0] * 4


def test_abort_gives_back_nothing_a_later_reservation_reached() -> None:
    c = Container(8, unit="episode")
    for _ in range(4):
        put(c, 2)
    first = c.reserve_rows(3)  # evicts episodes 0 [0,2) and 1 [2,4); ends at row 3
    second = c.reserve_rows(2)  # rows [3,5): reaches the rest of episode 1, evicts episode 2
    restored = c.abort(first.id, written=0)
    assert [ep.id for ep in restored] == [0]  # episode 1's row 3 belongs to `second` now
    assert c.pointer == 5  # a later reservation is open: the pointer stays
    c.commit(second.id)
    assert episodes(c) == [(0, 0, 2), (3, 6, 8), (4, 3, 5)]


def test_abort_without_written_or_after_clear_gives_back_nothing() -> None:
    c = Container(6, unit="episode")
    for _ in range(3):
        put(c, 2)
    r = c.reserve_rows(2)
    assert c.abort(r.id) == []  # a writer that died: nobody knows what it wrote
    assert [ep.id for ep in c.registry] == [1, 2]
    r = c.reserve_rows(2)
    c.clear()
    assert c.abort(r.id, written=0) == []
    assert len(c.registry) == 0


def test_restore_refuses_an_overlapping_episode() -> None:
    c = Container(6, unit="episode")
    put(c, 3)
    r = c.reserve_rows(3)
    c.commit(r.id)
    ghost = c.registry.get(0)
    with pytest.raises(ValueError, match="overlaps"):
        c.restore([type(ghost)(0, 2, 4)])


# -- sampler and limiter: counts follow the rows, state round-trips, blockers agree ------------


@pytest.mark.parametrize("unit", ["transition", "episode"])
def test_the_limiter_counts_follow_the_stored_rows(unit: str) -> None:
    """inserted - deleted is what the registry holds, through evictions, trims, aborts that
    give evictions back, and clears (the limiter's ``size`` gates min_size samples)."""
    rng = np.random.default_rng(3)
    c = Container(30, unit=unit)
    for step in range(600):
        n = int(rng.integers(1, 8))
        r = c.reserve_rows(n)
        if rng.random() < 0.25:
            c.abort(r.id, written=int(rng.integers(0, n + 1)))
        else:
            c.commit(r.id)
        if step % 97 == 96:
            c.clear()
        assert c.rate_limiter.size == c.registry.num_rows


def test_state_survives_json_and_msgpack_and_continues_the_same_draws() -> None:
    c = Container(40, sampler=PrioritizedSampler(priority_exponent=0.5), seed=9)
    put(c, 30)
    c.update_priorities(np.arange(0, 30, 3), np.arange(10.0))
    c.sample_rows(5)
    state = c.state()
    for codec in (lambda s: json.loads(json.dumps(s)), lambda s: msgpack.unpackb(msgpack.packb(s))):
        back = Container.from_state(codec(state))
        assert isinstance(back.sampler, PrioritizedSampler)
        assert back.sampler.priority_exponent == 0.5
        assert back.sampler.state_dict() == c.sampler.state_dict()
        assert back.rng.bit_generator.state == c.rng.bit_generator.state
        assert back.next_reservation == c.next_reservation
        assert (
            back.sample_rows(20).rows.tolist()
            == Container.from_state(state).sample_rows(20).rows.tolist()
        )


def test_blockers_say_why_and_reserve_refuses_the_same() -> None:
    c = Container(10, unit="episode", sampler=FifoSampler(max_times_sampled=1))
    assert c.plan(5).blocked is None and c.sample_blocker(5) is None
    put(c, 5)
    put(c, 5)
    reason = c.plan(5).blocked
    assert reason is not None and "rows [0, 5)" in reason and "max_times_sampled=1" in reason
    with pytest.raises(WaitTimeoutError, match="rows \\[0, 5\\)"):
        c.reserve_rows(5)
    assert c.pointer == 0 and c.reservations == {}
    assert c.sample_episodes(1).ids.tolist() == [0]
    assert c.plan(5).blocked is None
    limited = Container(10, rate_limiter=MinSize(4))
    assert "min-size" in (limited.sample_blocker(1) or "")
    with pytest.raises(WaitTimeoutError, match="min-size"):
        limited.sample_rows(1)


def test_a_bad_commit_priority_leaves_the_reservation_open() -> None:
    c = Container(10, sampler=PrioritizedSampler())
    r = c.reserve_rows(4)
    with pytest.raises(InvalidArgumentError, match="4 values"):
        c.commit(r.id, priority=[1.0, 2.0])
    assert r.id in c.reservations and len(c.registry) == 0
    assert c.commit(r.id, priority=[1.0, 2.0, 3.0, 4.0]) == [0]


def test_rows_reserved_and_not_committed_count_against_the_insert_window() -> None:
    # A writer holding a batch reserved ahead: each reservation was admitted against a count
    # without the others, and the limiter counts inserts at commit (the window overshot).
    from shmbuffer.samplers import make_rate_limiter

    limiter = make_rate_limiter(
        "sample-to-insert", samples_per_insert=2.0, min_size=4, error_buffer=4.0
    )  # inserts while inserted * 2 - sampled <= 12: 6 rows
    c = Container(100, unit="transition", rate_limiter=limiter)
    for _ in range(4):
        c.commit(c.reserve_rows(1).id)  # past min_size: the window applies
    held = [c.reserve_rows(1), c.reserve_rows(1)]  # 4 + 2 reserved = 6 rows: the edge
    reason = c.plan(1).blocked
    assert reason is not None and "diff=8" in reason
    for reservation in held:
        c.commit(reservation.id)
    assert limiter.diff == 12
    assert c.plan(1).blocked is not None  # 7 rows would pass 12
