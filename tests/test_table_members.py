"""Episodes written into only some tables: each table counts, draws and is told of its own
episodes only, through evictions, aborts, clears and loads; a consume-once table never holds
back a write over rows it does not hold."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shmbuffer import Buffer
from shmbuffer.errors import EmptyBufferError, InvalidArgumentError, WaitTimeoutError
from shmbuffer.registry import shared_spans
from shmbuffer.registry.shared_spans import SpansFile, SpansView
from shmbuffer.ring.container import Container
from shmbuffer.ring.publisher import SpansPublisher
from shmbuffer.samplers import FifoSampler, NoLimit, PrioritizedSampler, UniformSampler

NAMES = ("u", "p", "f")
SUBSETS = [None, ["u"], ["p"], ["f"], ["u", "p"], ["p", "f"], ["u", "f"]]


def container(capacity: int, unit: str) -> Container:
    return Container.of_tables(
        capacity,
        {
            "u": (UniformSampler(), NoLimit()),
            "p": (PrioritizedSampler(), NoLimit()),
            "f": (FifoSampler(max_times_sampled=1), NoLimit()),
        },
        unit=unit,
        seed=5,
    )


def check_tables(c: Container, members: dict[int, frozenset[str]], handed: set[int]) -> None:
    """Every table holds exactly the live episodes written into it: its registry, its use
    counts, its limiter's size and its sampler's items and mass."""
    live = list(c.registry)
    for name in NAMES:
        table = c.tables[name]
        mine = [ep for ep in live if name in members[ep.id]]
        assert [tuple(ep) for ep in table.registry] == [tuple(ep) for ep in mine]
        rows = sorted(r for ep in mine for r in range(ep.start, ep.end))
        assert np.flatnonzero(table.use_counts >= 0).tolist() == rows
        assert table.rate_limiter.stats()["size"] == len(rows)
        sampler = table.sampler
        if name == "p":
            items = len(mine) if c.unit == "episode" else len(rows)
            stats = sampler.stats()
            assert stats["items"] == items
            weight = (1.0 + 1e-6) ** 0.6  # every item at the default priority 1
            assert stats["priority_total"] == pytest.approx(items * weight)
        if name == "f":  # its queue holds its own episodes, the ones it has not handed out
            assert isinstance(sampler, FifoSampler)
            queued = set(sampler._items)
            assert queued <= {ep.id for ep in mine}
            if c.unit == "episode":
                assert queued == {ep.id for ep in mine} - handed
        if mine and name != "f":
            drawn = table.sample_rows(64).rows
            assert set(drawn.tolist()) <= set(rows)


OPS = st.one_of(
    st.tuples(st.just("write"), st.integers(1, 4), st.sampled_from(range(len(SUBSETS)))),
    st.tuples(st.just("abort"), st.integers(1, 6), st.sampled_from(range(len(SUBSETS)))),
    st.tuples(st.just("consume"), st.integers(1, 3), st.just(0)),
    st.tuples(st.just("clear"), st.just(0), st.just(0)),
    st.tuples(st.just("load"), st.just(0), st.just(0)),
)


@settings(max_examples=120, deadline=None)
@given(unit=st.sampled_from(["episode", "transition"]), ops=st.lists(OPS, max_size=40))
def test_each_table_counts_exactly_its_own_episodes_through_every_change(
    unit: str, ops: list[tuple[str, int, int]]
) -> None:
    c = container(12, unit)
    members: dict[int, frozenset[str]] = {}
    handed: set[int] = set()  # what the consume-once table handed out
    for op, n, which in ops:
        tables = SUBSETS[which]
        into = frozenset(NAMES if tables is None else tables)
        if op in ("write", "abort"):
            plan = c.plan(n, 1, tables)
            if plan.blocked is not None:  # rows "f" has not handed out: only its own hold back
                held = {ep.id for s, e in plan.evict for ep in c.registry.overlapping(s, e)}
                assert any("f" in members[i] and i not in handed for i in held)
                continue
            reservation = c.reserve(plan)
            if op == "write":
                for episode_id in c.commit(reservation.id):
                    members[episode_id] = into
            else:
                c.abort(reservation.id, 0)  # nothing copied: what it evicted comes back
        elif op == "consume":
            f = c.tables["f"]
            if unit == "transition":
                with contextlib.suppress(EmptyBufferError):  # every row handed out already
                    assert set(f.sample_rows(n).rows.tolist()) <= {
                        r for ep in f.registry for r in range(ep.start, ep.end)
                    }
            elif queued(f):
                got = f.sample_episodes(min(n, queued(f))).ids.tolist()
                assert not handed & set(got)  # each once
                assert all("f" in members[i] for i in got)
                handed |= set(got)
        elif op == "clear":
            c.clear()
        elif op == "load":
            c.load_state(c.state())
            # every table's sampler is saved: "f" keeps what it handed out
        check_tables(c, members, handed)


def queued(table: Any) -> int:
    return len(table.sampler._items)


def test_a_load_brings_the_membership_back_and_an_abort_after_it_restores_each_table() -> None:
    saved = container(12, "episode")
    members: dict[int, frozenset[str]] = {}
    for tables in (["u"], ["p", "f"], None, ["f"]):
        for i in saved.commit(saved.reserve_rows(3, tables=tables).id):
            members[i] = frozenset(NAMES if tables is None else tables)
    state = saved.state()
    loaded = container(12, "episode")
    loaded.load_state(state)
    check_tables(loaded, members, set())
    wrap = loaded.reserve_rows(3, tables=["u"])  # evicts episode 0 ("u" only)
    loaded.abort(wrap.id, 0)
    check_tables(loaded, members, set())


def episode(index: int, length: int = 4) -> dict[str, torch.Tensor]:
    return {"ep": torch.full((length,), index, dtype=torch.int64)}


def _chi_square(counts: np.ndarray, p: np.ndarray) -> float:
    expected = counts.sum() * p
    return float(((counts - expected) ** 2 / expected).sum())


def test_a_uniform_and_a_prioritized_table_draw_only_their_members_in_proportion() -> None:
    buf = Buffer(
        64,
        unit="episode",
        seed=11,
        tables={"replay": {"sampler": "prioritized", "priority_exponent": 1.0}, "u": {}},
    )
    for i in range(8):  # even episodes into "u" alone, odd ones into "replay" alone
        buf.add_episode(episode(i), tables=["replay"] if i % 2 else ["u"])
    odd_starts = np.array([4, 12, 20, 28])
    buf.update_priorities(odd_starts, [1.0, 2.0, 3.0, 4.0], table="replay")
    u = np.bincount([int(e["ep"][0]) for e in buf.sample_episodes(4000, table="u")], minlength=8)
    p = np.bincount(
        [int(e["ep"][0]) for e in buf.sample_episodes(4000, table="replay")], minlength=8
    )
    assert u[1::2].sum() == 0 and p[0::2].sum() == 0
    # Pearson's chi-square under its 99.9% point, 3 degrees of freedom
    assert _chi_square(u[0::2], np.full(4, 0.25)) < 16.27
    assert _chi_square(p[1::2], np.array([1, 2, 3, 4]) / 10) < 16.27


def test_a_uniform_table_draws_rows_uniformly_over_its_own_rows_only() -> None:
    buf = Buffer(100, seed=2, tables={"all": {}, "some": {}})
    for i, length in enumerate([5, 10, 15, 20]):  # chunks 0 and 2 into "some"
        buf.extend(
            {"ep": torch.full((length,), i)}, tables=["all", "some"] if i % 2 == 0 else ["all"]
        )
    drawn = buf.sample(20000, table="some")["ep"].numpy()
    counts = np.bincount(drawn, minlength=4)
    assert counts[1] == 0 and counts[3] == 0
    assert _chi_square(counts[[0, 2]], np.array([5, 15]) / 20) < 10.83  # 1 d.o.f., 99.9%
    assert set(np.bincount(buf.sample(4000, table="all")["ep"].numpy()).nonzero()[0]) == {
        0,
        1,
        2,
        3,
    }


def test_a_fifo_table_of_some_episodes_hands_each_out_once_and_holds_back_no_other_write() -> None:
    buf = Buffer(
        16,
        unit="episode",
        tables={"replay": {}, "online": {"sampler": "fifo", "max_times_sampled": 1}},
    )
    for i in range(4):
        buf.add_episode(episode(i), tables=["replay", "online"] if i == 3 else ["replay"])
    for i in range(4, 7):  # the ring is full: these overwrite replay-only episodes 0-2
        buf.add_episode(episode(i), tables=["replay"])
    with pytest.raises(WaitTimeoutError, match=r"\(table 'online'\)"):
        buf.add_episode(episode(7), tables=["replay"])  # over episode 3, "online" still owes it
    assert [int(e["ep"][0]) for e in buf.sample_episodes(1, table="online")] == [3]
    buf.add_episode(episode(7), tables=["replay"])
    assert buf.stats()["tables"]["online"]["sampler"]["consumed_episodes"] == 1
    assert buf.stats()["tables"]["online"]["rate_limiter"]["size"] == 0


def test_a_write_into_other_tables_is_not_held_back_by_a_rate_limiter_it_does_not_feed() -> None:
    buf = Buffer(
        1000,
        unit="episode",
        tables={
            "replay": {
                "rate_limiter": "sample-to-insert",
                "samples_per_insert": 1.0,
                "error_buffer": 8.0,
                "min_size": 1,
            },
            "online": {},
        },
    )
    buf.add_episode(episode(0), tables=["replay"])
    with pytest.raises(WaitTimeoutError):
        for i in range(1, 10):  # "replay" is never sampled: its limiter holds its writes back
            buf.add_episode(episode(i), tables=["replay"])
    for i in range(20):
        buf.add_episode(episode(100 + i), tables=["online"])


def test_add_transition_writes_into_the_tables_last_named_for_its_episode() -> None:
    buf = Buffer(64, unit="episode", tables={"a": {}, "b": {}})
    step = {"x": torch.tensor(1.0), "terminated": torch.tensor(False)}
    buf.add_transition("e", step, tables=["a"])
    buf.add_transition("e", step)  # not said: the earlier stands
    buf.add_transition("e", step, tables=["b"])
    buf.add_transition("e", {**step, "terminated": torch.tensor(True)})
    buf.add_transition("f", {**step, "terminated": torch.tensor(True)})  # never said: both
    stats = buf.stats()["tables"]
    assert stats["a"]["rate_limiter"]["size"] == 1 and stats["b"]["rate_limiter"]["size"] == 5


@pytest.mark.parametrize(
    ("tables", "match"),
    [
        (["replay", "nope"], r"no table named 'nope'; the tables are replay, online"),
        ([], "an empty list puts the rows in no table"),
        ("replay", "must be a list of table names"),
    ],
)
def test_an_unknown_table_is_refused_naming_it_before_anything_is_written(
    tables: Any, match: str
) -> None:
    buf = Buffer(64, unit="episode", tables={"replay": {}, "online": {}})
    buf.add_episode(episode(0))
    before = (buf.container.pointer, len(buf))
    for call in (
        lambda: buf.add_episode(episode(1), tables=tables),
        lambda: buf.extend(episode(1), tables=tables),
        lambda: buf.add_transition("e", {"ep": torch.tensor(1)}, tables=tables),
    ):
        with pytest.raises(InvalidArgumentError, match=match):
            call()
    assert (buf.container.pointer, len(buf)) == before
    assert buf.assembler.pending() == 0


def test_a_priority_is_checked_by_the_tables_the_write_goes_into() -> None:
    buf = Buffer(64, unit="episode", tables={"u": {}, "p": {"sampler": "prioritized"}})
    with pytest.raises(InvalidArgumentError, match="sampler 'uniform' keeps no priorities"):
        buf.add_episode(episode(0), priority=2.0, tables=["u"])
    assert len(buf) == 0
    buf.add_episode(episode(0), priority=2.0)  # every table: the prioritized one keeps it
    buf.add_episode(episode(1), priority=3.0, tables=["p"])
    assert buf.stats()["tables"]["p"]["sampler"]["priority_max"] == 3.0


def test_the_journal_replays_a_commit_into_its_tables() -> None:
    live = container(12, "episode")
    reservation = live.reserve_rows(3, tables=["p"])
    ids = live.commit(reservation.id)
    replayed = container(12, "episode")
    replayed.replay_reserve([(0, 3)], 3, 3, 2)
    replayed.replay_commit([(ids[0], 0, 3)], ["p"])
    check_tables(replayed, {ids[0]: frozenset(["p"])}, set())
    with pytest.raises(InvalidArgumentError, match="no table named 'q'"):
        replayed.replay_commit([(1, 3, 6)], ["q"])


def test_a_filter_and_a_recent_bound_select_among_the_tables_own_episodes() -> None:
    buf = Buffer(
        200,
        unit="episode",
        seed=4,
        tables={"all": {}, "some": {}, "recent": {"max_episodes": 2}},
    )
    for i in range(10):  # "some" and "recent" hold the even episodes only
        into = ["all", "some", "recent"] if i % 2 == 0 else ["all"]
        buf.add_episode(episode(i), meta={"r": float(i)}, tables=into)
    drawn = {int(e["ep"][0]) for e in buf.sample_episodes(400, table="some", where="r >= 3")}
    assert drawn == {4, 6, 8}
    recent = {int(e["ep"][0]) for e in buf.sample_episodes(400, table="recent")}
    assert recent == {6, 8}  # its own newest two, not the ring's
    mixed = {int(e["ep"][0]) for e in buf.sample_episodes(400, table="recent", where="r < 7")}
    assert mixed == {6}


def test_readers_drawing_rows_themselves_see_only_the_tables_own_runs(tmp_path: Path) -> None:
    out = SpansFile(tmp_path / shared_spans.SPANS_FILE)
    view = SpansView.open(out.path)
    assert view is not None
    c = Container.of_tables(
        40, {"a": (UniformSampler(), NoLimit()), "b": (UniformSampler(), NoLimit())}
    )
    publisher = SpansPublisher(c.tables["b"], out)
    for i in range(4):
        c.commit(c.reserve_rows(10, tables=["a", "b"] if i in (1, 2) else ["a"]).id)
    publisher.flush()
    got = view.draw(np.random.default_rng(0), 2000, np.zeros(40, dtype=np.int64))
    assert got is not None
    rows, _, live = got
    assert live == 20 and rows.min() >= 10 and rows.max() < 30
