"""Prioritized draws filtered by metadata: in proportion to priority among the episodes a filter
selects and never outside them, with the PER importance weights over the selection."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shmbuffer import Buffer
from shmbuffer.errors import EmptyBufferError
from shmbuffer.ring.container import Container
from shmbuffer.ring.meta import EpisodeMeta
from shmbuffer.samplers import PrioritizedSampler
from tests._stats import P_MIN, chi2_p

ALPHA = 0.7
EPS = 1e-6


def episode(index: int, length: int) -> dict[str, torch.Tensor]:
    return {
        "ep": torch.full((length,), index, dtype=torch.int64),
        "t": torch.arange(length, dtype=torch.int64),
    }


def prioritized(unit: str, n: int = 8, **table: object) -> Buffer:
    """``n`` episodes of 3 + i rows; episode i has env ``e{i % 2}`` and priority ``i + 1``
    (every row of it, in transition unit), in a buffer whose only table is prioritized."""
    options = {"sampler": "prioritized", "priority_exponent": ALPHA, "priority_eps": EPS}
    buf = Buffer(256, unit=unit, seed=5, tables={"replay": {**options, **table}})
    for i in range(n):
        length = 3 + i
        priority = float(i + 1) if unit == "episode" else np.full(length, float(i + 1))
        buf.add_episode(episode(i, length), priority=priority, meta={"env": f"e{i % 2}", "i": i})
    return buf


def weight(priority: np.ndarray | float) -> np.ndarray:
    return (np.asarray(priority, dtype=np.float64) + EPS) ** ALPHA


SELECTED = [1, 3, 5, 7]  # env == 'e1'


def test_rows_of_episode_unit_follow_the_selected_episodes_priorities() -> None:
    buf = prioritized("episode")
    batch = buf.sample(8000, where="env == 'e1'")
    counts = np.bincount(batch["ep"].numpy(), minlength=8)
    assert counts[[0, 2, 4, 6]].sum() == 0  # never outside the selection
    expected = weight(np.array(SELECTED) + 1.0)
    assert chi2_p(counts[SELECTED], 8000 * expected / expected.sum()) > P_MIN


def test_rows_of_transition_unit_follow_each_rows_priority_within_the_selection() -> None:
    buf = prioritized("transition")
    # within episode 7 its rows get different priorities: a row is drawn by its own
    rows_of_7 = np.arange(sum(3 + i for i in range(7)), sum(3 + i for i in range(8)))
    buf.update_priorities(rows_of_7, np.linspace(1.0, 20.0, rows_of_7.size))
    batch, info = buf.sample(20000, return_info=True, where="i >= 5")
    eps = batch["ep"].numpy()
    assert set(eps.tolist()) == {5, 6, 7}
    rows = np.concatenate([np.arange(r.start, r.stop) for r in _rows_of(buf, [5, 6, 7])])
    priority = np.concatenate([np.full(8, 6.0), np.full(9, 7.0), np.linspace(1.0, 20.0, 10)])
    expected = weight(priority) / weight(priority).sum()
    counts = np.bincount(info["index"].numpy(), minlength=rows.max() + 1)[rows]
    assert counts.sum() == 20000
    assert chi2_p(counts, 20000 * expected) > P_MIN
    # each row's probability and PER weight, over the selection
    drawn = info["index"].numpy()
    p = expected[np.searchsorted(rows, drawn)]
    np.testing.assert_allclose(info["probability"].numpy(), p)
    lowest = weight(priority).min()
    beta = 0.4  # the sampler's default importance exponent
    want = (weight(priority)[np.searchsorted(rows, drawn)] / lowest) ** -beta
    np.testing.assert_allclose(info["weight"].numpy(), want, rtol=1e-6)


def _rows_of(buf: Buffer, ids: list[int]) -> list[range]:
    found = buf.episodes(where=f"i in ({', '.join(map(str, ids))})")
    starts = [int(ep.start) for ep in buf.container.registry if ep.id in set(found.ids.tolist())]
    return [range(s, s + int(n)) for s, n in zip(starts, found["length"].tolist(), strict=True)]


@pytest.mark.parametrize("unit", ["episode", "transition"])
def test_episodes_are_drawn_by_priority_among_the_selected(unit: str) -> None:
    buf = prioritized(unit)
    drawn = buf.sample_episodes(6000, where="env == 'e1'")
    counts = np.bincount([int(ep["ep"][0]) for ep in drawn], minlength=8)
    assert counts[[0, 2, 4, 6]].sum() == 0
    mass = weight(np.array(SELECTED) + 1.0)
    if unit == "transition":  # a chunk by a row drawn by weight: its rows' summed weight
        mass = mass * (np.array(SELECTED) + 3)
    assert chi2_p(counts[SELECTED], 6000 * mass / mass.sum()) > P_MIN


@pytest.mark.parametrize("unit", ["episode", "transition"])
def test_slices_start_by_priority_among_the_selected_episodes_long_enough(unit: str) -> None:
    buf = prioritized(unit)
    data = buf.sample_slices(6000, 8, where="env == 'e1'")  # episodes 5 (8 rows) and 7 (10)
    eps = data["ep"][:, 0].numpy()
    assert set(eps.tolist()) == {5, 7}
    assert (data["ep"] == data["ep"][:, :1]).all()
    counts = np.bincount(eps, minlength=8)[[5, 7]]
    if unit == "episode":  # an episode by its weight, then a uniform start
        mass = weight(np.array([6.0, 8.0]))
    else:  # the start row by its weight: 1 start in episode 5, 3 in episode 7
        mass = weight(np.array([6.0, 8.0])) * np.array([1, 3])
    assert chi2_p(counts, 6000 * mass / mass.sum()) > P_MIN


def test_filtered_prioritized_draws_count_as_any_draw() -> None:
    buf = prioritized("episode")
    before = buf.stats()["rate_limiter"]["sampled"]
    batch = buf.sample(50, where="env == 'e0'")
    assert buf.stats()["rate_limiter"]["sampled"] == before + 50
    uses = buf.use_counts
    for ep in buf.container.registry:
        assert (uses[ep.start : ep.end] > 0).any() == (ep.id % 2 == 0 and ep.id in batch["ep"])
    with pytest.raises(EmptyBufferError, match="where='i > 100'"):
        buf.sample(4, where="i > 100")


def test_a_selection_whose_priorities_are_all_zero_has_nothing_to_draw() -> None:
    buf = Buffer(64, unit="episode", sampler="prioritized", priority_eps=0.0)
    buf.add_episode(episode(0, 3), priority=0.0, meta={"i": 0})
    buf.add_episode(episode(1, 3), priority=1.0, meta={"i": 1})
    with pytest.raises(EmptyBufferError, match="where='i == 0'"):
        buf.sample(4, where="i == 0")
    assert set(buf.sample(100, where="i <= 1")["ep"].tolist()) == {1}


# -- against a direct computation --------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    unit=st.sampled_from(["episode", "transition"]),
    episodes=st.lists(
        st.tuples(st.integers(1, 6), st.floats(0.0, 50.0), st.integers(0, 3)),
        min_size=1,
        max_size=12,
    ),
    pick=st.integers(0, 3),
    beta=st.floats(0.0, 1.0),
    call=st.sampled_from(["rows", "episodes", "slices"]),
)
def test_each_filtered_draw_has_the_probability_and_weight_of_a_direct_computation(
    unit: str,
    episodes: list[tuple[int, float, int]],
    pick: int,
    beta: float,
    call: str,
) -> None:
    """Episodes of random lengths, priorities and tags in a small ring (the oldest evicted);
    every item a filtered draw returns has the probability and weight computed here from the
    live episodes' values alone."""
    container = Container(32, unit=unit, sampler=PrioritizedSampler(priority_exponent=ALPHA))
    meta = EpisodeMeta(container.ring)
    priorities: dict[int, float] = {}
    tags: dict[int, int] = {}
    for length, priority, tag in episodes:
        plan = container.plan(length)
        reservation = container.reserve(plan)
        given = priority if unit == "episode" else np.full(length, priority)
        ids = container.commit(reservation.id, priority=given)
        meta.attach(ids, meta.check({"tag": tag}))
        for id_ in ids:  # a chunk that wraps around the ring's end is two entries
            priorities[id_], tags[id_] = priority, tag
    live = [ep for ep in container.registry if tags.get(ep.id) == pick]
    table = container.table
    where = f"tag == {pick}"
    length = 2
    if not live or (call == "slices" and all(ep.end - ep.start < length for ep in live)):
        with pytest.raises(EmptyBufferError):
            _draw(table, meta, where, call, length, beta)
        return
    got = _draw(table, meta, where, call, length, beta)
    w = {ep.id: float(weight(priorities[ep.id])) for ep in live}
    size = {ep.id: ep.end - ep.start for ep in live}
    start = {ep.id: ep.start for ep in live}
    by_row = unit == "transition"
    if call == "rows":
        total = sum(w[i] * size[i] for i in w) if by_row else sum(w.values())
        items = _episode_of(live, got.rows)
        want_p = [w[i] / total for i in items]
        mass = [w[i] for i in items]
    elif call == "episodes":
        mass_of = {i: w[i] * (size[i] if by_row else 1) for i in w}
        total = sum(mass_of.values())
        items = got.ids.tolist()
        want_p = [mass_of[i] / total for i in items]
        mass = [mass_of[i] for i in items]
    else:
        fits = {i: max(size[i] - length + 1, 0) for i in w}
        total = sum(w[i] * (fits[i] if by_row else fits[i] > 0) for i in w)
        items = _episode_of(live, got.starts)
        want_p = [w[i] / total for i in items]
        mass = [w[i] for i in items]
        assert all(0 <= s - start[i] < fits[i] for s, i in zip(got.starts, items, strict=True))
    assert set(items) <= set(w)
    np.testing.assert_allclose(got.probability, want_p, rtol=1e-9)
    lowest = min(w.values())
    np.testing.assert_allclose(got.weight, (np.array(mass) / lowest) ** -beta, rtol=1e-9)


def _draw(table, meta, where, call, length, beta):  # type: ignore[no-untyped-def]
    among = meta.subset(where, table)
    if call == "rows":
        return table.sample_rows(64, beta=beta, among=among)
    if call == "episodes":
        return table.sample_episodes(16, beta=beta, among=among)
    return table.sample_slices(16, length, beta=beta, among=among)


def _episode_of(live: list, rows: np.ndarray) -> list[int]:  # type: ignore[type-arg]
    out = []
    for row in rows.tolist():
        (found,) = [ep.id for ep in live if ep.start <= row < ep.end]
        out.append(found)
    return out
