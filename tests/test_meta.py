"""Episode metadata beside the registry, its queries and the draws filtered by them, in process."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shmbuffer import Buffer
from shmbuffer.errors import EmptyBufferError, InvalidArgumentError, QueryError
from shmbuffer.ring.meta import EpisodeMeta
from shmbuffer.ring.ring import Ring


def episode(index: int, length: int) -> dict[str, torch.Tensor]:
    """Rows that say which episode they belong to (``ep``) and their step (``t``)."""
    return {
        "ep": torch.full((length,), index, dtype=torch.int64),
        "t": torch.arange(length, dtype=torch.int64),
    }


def filled(n: int = 10, capacity: int = 1000, **kwargs: object) -> Buffer:
    buf = Buffer(capacity, unit="episode", seed=0, **kwargs)  # type: ignore[arg-type]
    for i in range(n):
        meta = {"ret": float(i), "version": i // 3, "env": f"e{i % 2}", "good": i % 4 == 0}
        buf.add_episode(episode(i, 5 + i), meta=meta)
    return buf


def test_a_filter_selects_the_episodes_whose_metadata_matches() -> None:
    buf = filled()
    found = buf.episodes(where="ret >= 4 and env == 'e0'")
    assert found.ids.tolist() == [4, 6, 8]
    assert found["ret"].tolist() == [4.0, 6.0, 8.0]
    assert found["length"].tolist() == [9, 11, 13]
    assert not found["commit_time"].mask.any()
    rows = found.rows()
    assert rows[0]["env"] == "e0" and rows[0]["version"] == 1 and rows[0]["good"] is True
    assert buf.episodes(where="version in (0, 3) and not good").ids.tolist() == [1, 2, 9]


def test_order_by_and_limit() -> None:
    buf = filled()
    assert buf.episodes(order_by="-ret", limit=3).ids.tolist() == [9, 8, 7]
    assert buf.episodes(order_by="length", limit=2).ids.tolist() == [0, 1]
    assert buf.episodes(where="env == 'e1'", order_by="-id").ids.tolist() == [9, 7, 5, 3, 1]
    with pytest.raises(InvalidArgumentError, match="order_by: no metadata named 'rett'"):
        buf.episodes(order_by="rett")
    with pytest.raises(InvalidArgumentError, match="limit"):
        buf.episodes(limit=-1)


def test_episodes_without_a_value_sort_last_and_fail_comparisons() -> None:
    buf = Buffer(100, unit="episode")
    buf.add_episode(episode(0, 3), meta={"ret": 2.0})
    buf.add_episode(episode(1, 3))
    buf.add_episode(episode(2, 3), meta={"ret": 5.0})
    assert buf.episodes(order_by="-ret").ids.tolist() == [2, 0, 1]
    assert buf.episodes(order_by="ret").ids.tolist() == [0, 2, 1]
    assert buf.episodes(where="ret > 0").ids.tolist() == [0, 2]
    assert buf.episodes(where="not ret > 3").ids.tolist() == [0, 1]
    assert buf.episodes()["ret"].mask.tolist() == [False, True, False]


def test_evicted_episodes_leave_the_queries_and_the_span_stays_short() -> None:
    buf = Buffer(40, unit="episode")
    for i in range(500):
        buf.add_episode(episode(i, 10), meta={"i": i})
    found = buf.episodes()
    assert found.ids.tolist() == [496, 497, 498, 499]
    assert found["i"].tolist() == [496, 497, 498, 499]
    assert buf.episodes(where="i < 496").ids.tolist() == []
    assert buf._metadata().stats()["span"] <= 64  # the dead front is dropped as it goes


@pytest.mark.parametrize(
    ("meta", "match"),
    [
        ({"ret": [1.0, 2.0]}, "metadata 'ret': a scalar"),
        ({"ret": "high"}, "metadata 'ret' holds float values, got a str"),
        ({"length": 3}, "metadata 'length' is recorded by the buffer itself"),
        ({"bad name": 1}, "must be an identifier"),
        ({"ret": None}, "metadata 'ret': a scalar"),
    ],
)
def test_a_bad_value_is_refused_by_name_and_nothing_is_written(
    meta: dict[str, object], match: str
) -> None:
    buf = filled(3)
    before = (len(buf), buf.num_rows, buf.episodes().ids.tolist())
    with pytest.raises(InvalidArgumentError, match=match):
        buf.add_episode(episode(9, 4), meta=meta)
    assert (len(buf), buf.num_rows, buf.episodes().ids.tolist()) == before


def test_declared_names_are_the_only_ones_taken_and_ints_count_as_floats() -> None:
    buf = Buffer(100, unit="episode", meta={"ret": "float", "env": "str"})
    buf.add_episode(episode(0, 3), meta={"ret": 1, "env": "a"})
    assert buf.episodes()["ret"].dtype == np.float64
    with pytest.raises(InvalidArgumentError, match="metadata 'seed' is not declared"):
        buf.add_episode(episode(1, 3), meta={"seed": 3})
    with pytest.raises(InvalidArgumentError, match="kind 'complex'"):
        Buffer(10, meta={"x": "complex"})
    # a declared name no episode has yet is known to a filter, and matches nothing
    assert Buffer(10, meta={"x": "int"}).episodes(where="x > 1").ids.tolist() == []


def test_tensors_and_numpy_scalars_are_taken_as_their_values() -> None:
    buf = Buffer(100, unit="episode")
    buf.add_episode(episode(0, 3), meta={"ret": torch.tensor(2.5), "v": np.int32(7)})
    assert buf.episodes().rows()[0] | {"commit_time": 0} == {
        "id": 0,
        "ret": 2.5,
        "v": 7,
        "length": 3,
        "commit_time": 0,
    }


def test_add_transition_merges_the_metadata_of_an_episodes_steps() -> None:
    buf = Buffer(100, unit="episode")
    buf.add_transition("a", {"x": 1.0, "terminated": False}, meta={"env": "a", "ret": 0.0})
    buf.add_transition("b", {"x": 1.0, "terminated": False}, meta={"env": "b"})
    buf.add_transition("a", {"x": 2.0, "terminated": True}, meta={"ret": 3.0})
    buf.add_transition("b", {"x": 2.0, "terminated": False})
    buf.end_episode("b")
    assert buf.episodes().rows() == [
        {"id": 0, "env": "a", "ret": 3.0, "length": 2, "commit_time": pytest.approx(0, abs=1e10)},
        {"id": 1, "env": "b", "length": 2, "commit_time": pytest.approx(0, abs=1e10)},
    ]
    with pytest.raises(InvalidArgumentError, match="metadata 'env' holds str values"):
        buf.add_transition("c", {"x": 1.0, "terminated": False}, meta={"env": 3})
    assert buf.assembler.pending() == 0  # the refused step was not taken either


def test_a_vector_step_gives_its_metadata_to_every_sub_episode() -> None:
    buf = Buffer(100, unit="episode", num_envs=2)
    step = {"x": torch.zeros(2), "terminated": torch.tensor([False, False])}
    buf.add_transition("v", step, meta={"policy": 4})
    buf.add_transition("v", {"x": torch.ones(2), "terminated": torch.tensor([True, True])})
    assert buf.episodes()["policy"].tolist() == [4, 4]


def test_a_buffer_asked_late_knows_the_lengths_and_not_the_commit_times() -> None:
    buf = Buffer(100, unit="episode")
    buf.add_episode(episode(0, 4))
    buf.add_episode(episode(1, 6), meta={"ret": 1.0})
    found = buf.episodes()
    assert found["length"].tolist() == [4, 6]
    assert found["commit_time"].mask.tolist() == [True, False]


def test_filters_that_do_not_parse_or_name_nothing_are_refused_with_where() -> None:
    buf = filled(3)
    with pytest.raises(QueryError, match="position"):
        buf.episodes(where="ret >")
    with pytest.raises(QueryError, match="rett"):
        buf.episodes(where="rett > 1")
    with pytest.raises(QueryError):
        buf.sample(4, where="__import__('os')")


# -- draws ------------------------------------------------------------------------------------


def test_sample_with_where_draws_only_rows_of_matching_episodes() -> None:
    buf = filled()
    batch = buf.sample(2000, where="env == 'e1' and ret > 2")
    assert set(batch["ep"].tolist()) == {3, 5, 7, 9}
    counts = np.bincount(batch["ep"].numpy(), minlength=10)[[3, 5, 7, 9]]
    rows = np.array([8, 10, 12, 14])  # uniform over their rows: by length
    assert _chi_square_ok(counts, rows / rows.sum())


def test_sample_episodes_with_where_is_uniform_over_matching_episodes() -> None:
    buf = filled()
    drawn = buf.sample_episodes(2000, where="good or ret == 9")
    firsts = [int(ep["ep"][0]) for ep in drawn]
    counts = np.bincount(firsts, minlength=10)[[0, 4, 8, 9]]
    assert sum(counts) == 2000
    assert _chi_square_ok(counts, np.full(4, 0.25))


def test_sample_slices_with_where_stays_inside_matching_episodes() -> None:
    buf = filled()
    data = buf.sample_slices(500, 12, where="ret <= 8")
    eps = data["ep"]
    assert (eps == eps[:, :1]).all()  # one episode per slice
    assert set(eps[:, 0].tolist()) <= {7, 8}  # the only ones long enough (12, 13 rows)
    assert ((data["t"][:, 1:] - data["t"][:, :-1]) == 1).all()
    loose = buf.sample_slices(500, 12, strict=False, where="ret < 2")
    assert loose["mask"][:, :5].all() and not loose["mask"][:, 6:].any()


def test_a_filter_that_matches_nothing_says_which() -> None:
    buf = filled()
    with pytest.raises(EmptyBufferError, match="where='ret > 100'"):
        buf.sample(4, where="ret > 100")


def test_where_is_refused_on_tables_whose_draws_it_would_bypass() -> None:
    consuming = filled(4, sampler="prioritized", max_times_sampled=2)
    with pytest.raises(InvalidArgumentError, match="consumes what it hands out"):
        consuming.sample(4, where="ret > 1")
    fifo = filled(4, sampler="fifo", max_times_sampled=1)
    with pytest.raises(InvalidArgumentError, match="'fifo'"):
        fifo.sample_episodes(1, where="ret > 1")
    lifo = filled(4, sampler="lifo")
    with pytest.raises(InvalidArgumentError, match="uniform or prioritized table"):
        lifo.sample_slices(1, 2, where="ret > 1")


def _chi_square_ok(counts: np.ndarray, p: np.ndarray) -> bool:
    """Pearson's chi-square against ``p`` below its 99.9% point for len(p) - 1 degrees
    (3 here: 16.27)."""
    expected = counts.sum() * p
    stat = float(((counts - expected) ** 2 / expected).sum())
    return stat < {1: 10.83, 2: 13.82, 3: 16.27}[len(p) - 1]


# -- the registry and the metadata agree through any run of writes ----------------------------


@settings(max_examples=60, deadline=None)
@given(
    unit=st.sampled_from(["transition", "episode"]),
    ops=st.lists(
        st.tuples(st.integers(1, 9), st.booleans()),  # rows; abort the write instead
        min_size=1,
        max_size=40,
    ),
)
def test_live_entries_and_their_bounds_always_match_the_registry(
    unit: str, ops: list[tuple[int, bool]]
) -> None:
    ring = Ring(24, unit=unit)
    meta = EpisodeMeta(ring)
    for rows, abort in ops:
        reservation = ring.reserve_rows(rows)
        if abort:
            ring.abort(reservation.id, 0)  # what it evicted is published again
        else:
            meta.attach(ring.commit(reservation.id), meta.check({"rows": rows}))
        ids, starts, ends = meta.bounds(None)
        live = list(ring.registry)
        assert ids.tolist() == [ep.id for ep in live]
        assert starts.tolist() == [ep.start for ep in live]
        assert ends.tolist() == [ep.end for ep in live]
        lengths = meta.select()["length"]
        assert lengths.tolist() == [ep.end - ep.start for ep in live]
    assert math.isfinite(meta.stats()["span"])


def test_strings_order_by_their_text_and_decode_in_the_records() -> None:
    buf = Buffer(100, unit="episode")
    for i, env in enumerate(["b", "c", "a", "c"]):
        buf.add_episode(episode(i, 2), meta={"env": env})
    assert buf.episodes(order_by="env").ids.tolist() == [2, 0, 1, 3]
    assert buf.episodes(order_by="-env").ids.tolist() == [1, 3, 0, 2]
    assert buf.episodes(where="env >= 'b'")["env"].tolist() == ["b", "c", "c"]
