"""Several tables over one ring of rows in an in-process Buffer: each draws by its own sampler,
generator and counts; rows are overwritten only once every table lets them go."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shmbuffer import Buffer
from shmbuffer.errors import EmptyBufferError, InvalidArgumentError, WaitTimeoutError

TABLES = {
    "replay": {"sampler": "prioritized", "priority_exponent": 1.0},
    "uniform": {"sampler": "uniform"},
}


def episode(index: int, length: int = 4) -> dict[str, torch.Tensor]:
    return {"ep": torch.full((length,), index, dtype=torch.int64)}


def _chi_square_ok(counts: np.ndarray, p: np.ndarray) -> bool:
    """Pearson's chi-square against ``p`` under its 99.9% point (3 degrees of freedom)."""
    expected = counts.sum() * p
    return float(((counts - expected) ** 2 / expected).sum()) < 16.27


def test_each_table_draws_by_its_own_sampler_over_the_same_rows() -> None:
    buf = Buffer(64, unit="episode", seed=3, tables=TABLES)
    for i in range(4):
        buf.add_episode(episode(i))
    # the prioritized table: episode i gets priority i + 1; the uniform one is left as it is
    drawn = buf.sample_episodes(4, table="replay")
    assert len(drawn) == 4
    starts = np.array([0, 4, 8, 12])
    buf.update_priorities(starts, [1.0, 2.0, 3.0, 4.0], table="replay")
    replay = [int(ep["ep"][0]) for ep in buf.sample_episodes(4000, table="replay")]
    uniform = [int(ep["ep"][0]) for ep in buf.sample_episodes(4000, table="uniform")]
    assert _chi_square_ok(np.bincount(replay, minlength=4), np.array([1, 2, 3, 4]) / 10)
    assert _chi_square_ok(np.bincount(uniform, minlength=4), np.full(4, 0.25))
    # the default table is the first one named
    assert buf.sampler.name == "prioritized"
    stats = buf.stats()["tables"]
    assert set(stats) == {"replay", "uniform"}


def test_a_consume_once_table_holds_writes_until_it_read_them_and_the_other_does_not_care() -> None:
    buf = Buffer(
        16,
        unit="episode",
        tables={"replay": {}, "online": {"sampler": "fifo", "max_times_sampled": 1}},
    )
    for i in range(4):
        buf.add_episode(episode(i))  # the ring is full
    for _ in range(10):  # the replay table reads as often as it likes
        buf.sample_episodes(2, table="replay")
    with pytest.raises(WaitTimeoutError, match=r"fifo sampler .* \(table 'online'\)"):
        buf.add_episode(episode(4))  # episode 0 not consumed by "online" yet
    assert [int(ep["ep"][0]) for ep in buf.sample_episodes(2, table="online")] == [0, 1]
    buf.add_episode(episode(4))
    buf.add_episode(episode(5))
    assert [int(ep["ep"][0]) for ep in buf.sample_episodes(4, table="online")] == [2, 3, 4, 5]
    with pytest.raises(EmptyBufferError):
        buf.sample_episodes(1, table="online")  # everything consumed: nothing to hand out


def test_tables_draw_with_generators_of_their_own_reproducibly() -> None:
    def draws(seed: int) -> tuple[list[int], list[int]]:
        buf = Buffer(1000, tables={"a": {}, "b": {}}, seed=seed)
        buf.extend({"x": torch.arange(1000)})
        a = buf.sample(64, table="a")["x"].tolist()
        b = buf.sample(64, table="b")["x"].tolist()
        return a, b

    a, b = draws(7)
    assert a != b  # not one stream shared
    assert draws(7) == (a, b)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tables": {}}, "non-empty mapping"),
        ({"tables": {"a": "uniform"}}, "table 'a': options must be a mapping"),
        ({"tables": {"a": {"sampler": "nope"}}}, "table 'a': .*unknown sampler 'nope'"),
        ({"tables": {"a": {"priority_exponent": 0.5}}}, "table 'a': .*priority_exponent"),
        ({"tables": {"a": {"colour": 1}}}, "table 'a': unknown table option 'colour'"),
        ({"tables": {"a": {}}, "sampler": "prioritized"}, "give sampler per table"),
        ({"tables": {"a": {}}, "min_size": 3}, "give min_size per table"),
    ],
)
def test_bad_table_options_are_refused_naming_the_table(
    kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        Buffer(10, **kwargs)  # type: ignore[arg-type]


def test_a_table_not_there_is_named_with_those_there() -> None:
    buf = Buffer(10, tables=TABLES)
    buf.extend({"x": torch.arange(4)})
    with pytest.raises(InvalidArgumentError, match="no table named 'online'; the tables are"):
        buf.sample(2, table="online")
    one = Buffer(10)
    one.extend({"x": torch.arange(4)})
    assert len(one.sample(2, table="default")) == 2
    assert "tables" not in one.stats()


def test_one_sampler_instance_cannot_serve_two_tables() -> None:
    from shmbuffer.samplers import UniformSampler

    shared = UniformSampler()
    with pytest.raises(InvalidArgumentError, match="'a' and 'b' were given the same"):
        Buffer(10, tables={"a": {"sampler": shared}, "b": {"sampler": shared}})
