"""A table's bounds: the newest N episodes (a recent table), and staleness by policy version
(a bound on the lag, or a weight per lag), alone and with metadata filters."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shmbuffer import Buffer
from shmbuffer.api.tables import TABLE_OPTIONS, table_bounds
from shmbuffer.errors import EmptyBufferError, InvalidArgumentError
from shmbuffer.ring.bounds import TableBounds
from shmbuffer.ring.container import Container
from shmbuffer.ring.meta import EpisodeMeta
from tests._stats import P_MIN, chi2_p


def episode(index: int, length: int = 3) -> dict[str, torch.Tensor]:
    return {"ep": torch.full((length,), index, dtype=torch.int64)}


def drawn_ids(buf: Buffer, n: int, **kwargs: object) -> np.ndarray:
    return np.array([int(ep["ep"][0]) for ep in buf.sample_episodes(n, **kwargs)])  # type: ignore[arg-type]


def test_a_recent_table_draws_only_the_newest_episodes_and_the_other_all_of_them() -> None:
    tables = {"all": {}, "recent": {"sampler": "uniform", "max_episodes": 3}}
    buf = Buffer(1000, unit="episode", seed=1, tables=tables)
    for i in range(10):
        buf.add_episode(episode(i), meta={"odd": i % 2 == 1})
    recent = drawn_ids(buf, 3000, table="recent")
    assert chi2_p(np.bincount(recent, minlength=10)[7:], np.full(3, 1000.0)) > P_MIN
    assert set(drawn_ids(buf, 3000, table="all").tolist()) == set(range(10))
    # a filter selects among the newest three, not the newest three it matches
    assert set(drawn_ids(buf, 500, table="recent", where="odd").tolist()) == {7, 9}
    assert set(buf.sample(500, table="recent")["ep"].tolist()) == {7, 8, 9}
    slices = buf.sample_slices(200, 2, table="recent")
    assert set(slices["ep"][:, 0].tolist()) == {7, 8, 9}
    buf.add_episode(episode(10), meta={"odd": False})
    assert set(drawn_ids(buf, 500, table="recent").tolist()) == {8, 9, 10}
    assert buf.stats()["tables"]["recent"]["bounds"] == {"max_episodes": 3}


def staleness_buffer(sampler: str = "uniform", **bounds: object) -> Buffer:
    table = {"sampler": sampler, **bounds}
    return Buffer(1000, unit="episode", seed=2, tables={"fresh": table})


def test_max_staleness_draws_only_episodes_of_recent_policy_versions() -> None:
    buf = staleness_buffer(max_staleness=1)
    for i, version in enumerate([0, 0, 1, 1, 2, 2, 3, 3]):
        buf.add_episode(episode(i), meta={"policy_version": version})
    buf.add_episode(episode(8))  # no policy_version: no lag, never drawn
    assert set(drawn_ids(buf, 1000).tolist()) == {4, 5, 6, 7}
    buf.add_episode(episode(9), meta={"policy_version": 4})
    assert set(drawn_ids(buf, 1000).tolist()) == {6, 7, 9}
    assert set(drawn_ids(buf, 1000, where="policy_version == 4").tolist()) == {9}
    lags = buf.stats()["bounds"]
    assert lags["newest_policy_version"] == 4
    assert lags["lags"] == {"0": 1, "1": 2, "2": 2, "3": 2, "4+": 2, "none": 1}


def test_a_late_episode_of_an_old_policy_is_as_stale_as_its_version() -> None:
    buf = staleness_buffer(max_staleness=0)
    buf.add_episode(episode(0), meta={"policy_version": 5})
    buf.add_episode(episode(1), meta={"policy_version": 3})  # a slow actor's, committed last
    assert set(drawn_ids(buf, 200).tolist()) == {0}


def test_staleness_weights_weigh_each_lag_and_exclude_past_the_list() -> None:
    buf = staleness_buffer(staleness_weights=[1.0, 0.5, 0.25])
    versions = [0, 1, 2, 3, 3]  # lags 3 (excluded), 2, 1, 0, 0
    for i, version in enumerate(versions):
        buf.add_episode(episode(i), meta={"policy_version": version})
    counts = np.bincount(drawn_ids(buf, 8000), minlength=5)
    assert counts[0] == 0
    mass = np.array([0.25, 0.5, 1.0, 1.0])
    assert chi2_p(counts[1:], 8000 * mass / mass.sum()) > P_MIN
    # rows: by each episode's weight times its rows (uniform over weighted rows)
    rows = np.bincount(buf.sample(8000)["ep"].numpy(), minlength=5)
    assert chi2_p(rows[1:], 8000 * mass / mass.sum()) > P_MIN


def test_staleness_weights_multiply_priorities_and_leave_the_importance_weights_alone() -> None:
    buf = staleness_buffer("prioritized", staleness_weights=[1.0, 0.5], priority_exponent=1.0)
    for i, (version, priority) in enumerate([(0, 4.0), (1, 1.0), (1, 2.0)]):
        buf.add_episode(episode(i), priority=priority, meta={"policy_version": version})
    batch, info = buf.sample(9000, return_info=True)
    counts = np.bincount(batch["ep"].numpy(), minlength=3)
    mass = np.array([4.0 * 0.5, 1.0, 2.0])  # episode unit: an episode by weight, then a row
    assert chi2_p(counts, 9000 * mass / mass.sum()) > P_MIN
    ep = batch["ep"].numpy()
    np.testing.assert_allclose(info["probability"].numpy(), mass[ep] / mass.sum(), rtol=1e-5)
    priority = np.array([4.0, 1.0, 2.0])
    want = (priority[ep] / 1.0) ** -0.4
    np.testing.assert_allclose(info["weight"].numpy(), want, rtol=1e-5)


def test_a_table_bounded_by_staleness_with_no_policy_version_yet_has_nothing_to_draw() -> None:
    buf = staleness_buffer(max_staleness=2)
    buf.add_episode(episode(0))
    with pytest.raises(EmptyBufferError, match=r"table's bounds \(max_staleness=2\)"):
        buf.sample(4)


def test_bad_bounds_are_refused_naming_the_table_and_the_option() -> None:
    with pytest.raises(InvalidArgumentError, match="table 'r': max_episodes must be an int >= 1"):
        Buffer(10, tables={"r": {"max_episodes": 0}})
    with pytest.raises(InvalidArgumentError, match="'r': staleness_weights"):
        Buffer(10, tables={"r": {"staleness_weights": []}})
    with pytest.raises(InvalidArgumentError, match="not both"):
        Buffer(10, tables={"r": {"staleness_weights": [1.0], "max_staleness": 1}})
    with pytest.raises(InvalidArgumentError, match=r"table 'q'.*'fifo'"):
        Buffer(10, tables={"p": {}, "q": {"sampler": "fifo", "max_episodes": 5}})
    with pytest.raises(InvalidArgumentError, match="max_times_sampled"):
        Buffer(10, tables={"q": {"max_times_sampled": 1, "max_staleness": 1}})


def test_policy_version_must_be_an_int_name() -> None:
    with pytest.raises(InvalidArgumentError, match="'policy_version' as int, but it holds float"):
        Buffer(10, meta={"policy_version": "float"}, tables={"r": {"max_staleness": 1}})
    with pytest.raises(InvalidArgumentError, match="declare it"):
        Buffer(10, meta={"ret": "float"}, tables={"r": {"max_staleness": 1}})
    buf = Buffer(10, tables={"r": {"max_staleness": 1}})  # names taken lazily: int from now on
    with pytest.raises(InvalidArgumentError, match="'policy_version' holds int values"):
        buf.add_episode(episode(0), meta={"policy_version": 1.5})
    assert buf.num_episodes == 0


def test_table_options_are_declared_for_a_command_line() -> None:
    by_name = {option.name: option for option in TABLE_OPTIONS}
    assert set(by_name) == {"max_episodes", "max_staleness", "staleness_weights"}
    assert by_name["max_episodes"].flag == "--max-episodes"
    assert by_name["max_episodes"].parse("1000") == 1000
    weights = by_name["staleness_weights"].parse("1/0.5/0.25")
    assert table_bounds("t", {"staleness_weights": weights}) is not None
    assert weights == [1.0, 0.5, 0.25]


# -- against a direct computation --------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(
    unit=st.sampled_from(["episode", "transition"]),
    writes=st.lists(
        st.tuples(st.integers(1, 5), st.none() | st.integers(0, 6), st.booleans()),
        min_size=1,
        max_size=30,
    ),
    max_episodes=st.none() | st.integers(1, 6),
    lag=st.none() | st.integers(0, 3),
    where=st.none() | st.sampled_from(["tag", "not tag"]),
)
def test_the_episodes_a_bounded_table_draws_from_are_those_a_direct_computation_keeps(
    unit: str,
    writes: list[tuple[int, int | None, bool]],
    max_episodes: int | None,
    lag: int | None,
    where: str | None,
) -> None:
    """Writes of random lengths and versions into a small ring (evicting, aborting some), with
    draws between them so the kept selection carries over: every draw's selection is the live
    episodes' newest ``max_episodes``, of a version at most ``lag`` behind the largest given,
    matching ``where``."""
    if max_episodes is None and lag is None:
        max_episodes = 4
    spec = table_bounds("t", {"max_episodes": max_episodes, "max_staleness": lag})
    assert spec is not None
    container = Container(16, unit=unit)
    table = container.table
    table.bounds = TableBounds(spec)
    meta = EpisodeMeta(container.ring)
    table.bounds.bind(meta)
    versions: dict[int, int] = {}
    tags: dict[int, bool] = {}
    newest: int | None = None

    def check() -> None:
        live = [ep.id for ep in container.registry]
        want = sorted(live)[-max_episodes:] if max_episodes is not None else sorted(live)
        if lag is not None:
            want = [i for i in want if newest is not None and versions.get(i, -99) >= newest - lag]
        if where is not None:
            want = [i for i in want if tags[i] == (where == "tag")]
        among = table.bounds.subset(table) if where is None else meta.subset(where, table)
        assert among.ids.tolist() == want

    for length, version, abort in writes:
        reservation = container.reserve(container.plan(length))
        check()  # drawn while the reservation's evictions are out: an abort brings them back
        if abort:
            container.abort(reservation.id, written=0)  # nothing copied: every eviction comes back
            check()
            continue
        ids = container.commit(reservation.id)
        tag = length % 2 == 0
        given = {"tag": tag} if version is None else {"tag": tag, "policy_version": version}
        meta.attach(ids, meta.check(given))
        for id_ in ids:
            tags[id_] = tag
            if version is not None:
                versions[id_] = version
        if version is not None:
            newest = version if newest is None else max(newest, version)
        check()


def test_episodes_an_aborted_write_gives_back_are_drawn_again() -> None:
    """A draw while a write's evictions are out forgets them (most of the kept ids are dead
    then); the abort brings them back, and the next draw has them again."""
    buf = Buffer(18, unit="episode", seed=4, tables={"fresh": {"max_staleness": 5}})
    container = buf.container
    for i in range(6):  # the ring is full
        buf.add_episode(episode(i), meta={"policy_version": 1})
    reservation = container.reserve(container.plan(15))  # evicts all but the newest
    assert set(drawn_ids(buf, 300).tolist()) == {5}
    container.abort(reservation.id, written=0)  # nothing copied: every eviction comes back
    assert set(drawn_ids(buf, 600).tolist()) == set(range(6))


def test_the_lag_distribution_counts_the_tables_own_episodes() -> None:
    tables = {"replay": {}, "fresh": {"sampler": "uniform", "max_staleness": 9}}
    buf = Buffer(1000, unit="episode", seed=1, tables=tables)
    for i in range(6):  # versions 0..5; the even ones into "replay" only
        into = ["replay"] if i % 2 == 0 else None
        buf.add_episode(episode(i), meta={"policy_version": i}, tables=into)
    lags = buf.stats()["tables"]["fresh"]["bounds"]["lags"]
    assert lags == {"0": 1, "1": 0, "2": 1, "3": 0, "4+": 1, "none": 0}  # versions 5, 3, 1
    assert set(drawn_ids(buf, 300, table="fresh").tolist()) == {1, 3, 5}
