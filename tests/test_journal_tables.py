"""Every table of a container across restarts: its state saved and loaded by name, its draws
and priority updates journaled naming it and redone on it, its use counts in a file of its own;
a state or journal of one table (from before tables) loads as it did."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shmbuffer.daemon.journal import (
    PRIORITY,
    SAMPLE,
    USE_COUNTS_FILE,
    Journal,
    container_state,
    iter_records,
    restore_container,
)
from shmbuffer.ring.container import Container
from shmbuffer.samplers import FifoSampler, PrioritizedSampler, UniformSampler

COUNTERS = {"rows_committed": 0, "episodes_committed": 0}


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path


def two_tables(seed: int = 3) -> Container:
    """A prioritized replay table (the default) and a consume-once FIFO over one ring."""
    return Container.of_tables(
        60,
        {
            "replay": (PrioritizedSampler(priority_exponent=0.8), _no_limit()),
            "online": (FifoSampler(max_times_sampled=1), _no_limit()),
        },
        unit="episode",
        seed=seed,
    )


def _no_limit() -> Any:
    from shmbuffer.samplers import NoLimit

    return NoLimit()


def commit(container: Container, journal: Journal, rows: int, priority: Any = None) -> None:
    """Reserve and commit one episode the way the service does, with the commit's priorities
    journaled for every table that keeps them."""
    counters = COUNTERS
    evict = container.plan(rows).evict
    r = container.reserve_rows(rows)
    journal.append_reserve(
        evict, container.pointer, container.rows_written, container.next_reservation
    )
    given = container.commit_priorities(r.id, priority)
    ids = container.commit(r.id, priority)
    journal.append_commit([(ids[0], *r.episodes[0])], **counters)
    if given is not None:
        for index, table in enumerate(container.tables.values()):
            if table.sampler.has_priorities:
                journal.append_priorities(given.rows, given.priority, index)


def priorities(container: Container, name: str) -> Any:
    """The table's sampler's saved priorities (its sum tree's leaves and largest priority)."""
    state = container.tables[name].sampler.state_dict()
    return state["leaves"], state["max_priority"]


def test_a_state_keeps_every_table_by_name_and_the_default_one_where_it_was() -> None:
    c = two_tables()
    for _ in range(4):
        c.commit(c.reserve_rows(5).id)
    c.tables["replay"].update_priorities([0, 5], [4.0, 9.0])
    assert c.tables["online"].sample_episodes(2).ids.tolist() == [0, 1]
    state = c.state()
    assert state["sampler"]["name"] == "prioritized"  # the default table's, at the top
    assert state["table"] == "replay"
    assert list(state["tables"]) == ["online"]
    assert state["tables"]["online"]["sampler"]["name"] == "fifo"
    back = Container.from_state(state)
    assert list(back.tables) == ["replay", "online"]
    assert back.state() == state
    assert back.tables["online"].sample_episodes(2).ids.tolist() == [2, 3]  # never 0, 1 again
    assert back.tables["replay"].priority_updates == 2


def test_a_state_of_other_tables_is_refused_naming_them() -> None:
    c = two_tables()
    state = c.state()
    one = Container(60, unit="episode", sampler=PrioritizedSampler())
    with pytest.raises(ValueError, match="saved state has the tables replay, online"):
        one.load_state(state)
    other = Container.of_tables(
        60,
        {"replay": (PrioritizedSampler(), _no_limit()), "online": (UniformSampler(), _no_limit())},
        unit="episode",
    )
    with pytest.raises(ValueError, match="table 'online': saved state is for the 'fifo'"):
        other.load_state(state)


def test_an_old_state_of_one_table_loads_into_the_default_table() -> None:
    old = Container(60, unit="episode", sampler=FifoSampler(max_times_sampled=1), seed=1)
    for _ in range(3):
        old.commit(old.reserve_rows(5).id)
    old.sample_episodes(1)
    state = old.state()
    assert "tables" not in state and "table" not in state  # the layout of old, unchanged
    back = Container.from_state(state)
    assert list(back.tables) == ["default"]
    assert back.sample_episodes(2).ids.tolist() == [1, 2]


def test_each_tables_draws_and_priorities_replay_on_that_table(folder: Path) -> None:
    c = two_tables()
    journal = Journal(folder)
    journal.track(c)
    journal.start(container_state(c, COUNTERS))
    for i in range(6):
        commit(c, journal, 5, priority=float(i + 1))
    online, replay = c.tables["online"], c.tables["replay"]
    assert online.sample_episodes(2).ids.tolist() == [0, 1]
    drawn = replay.sample_episodes(3)
    update = replay.check_priorities(drawn.starts, [7.0, 8.0, 9.0])
    replay.apply_priorities(update)
    journal.append_priorities(update.rows, update.priority, 0)
    assert online.sample_episodes(1).ids.tolist() == [2]
    kinds = [int(body[0]) for body, *_ in _bodies(journal.path.read_bytes())]
    assert kinds.count(SAMPLE) == 2  # the FIFO's draws; the prioritized ones change nothing
    assert kinds.count(PRIORITY) == 6 + 1

    loaded = Journal(folder).load()
    assert loaded["diverged"] == 0
    back = restore_container(loaded)
    assert np.array_equal(back.tables["online"].use_counts, online.use_counts)
    assert np.array_equal(back.tables["replay"].use_counts, replay.use_counts)
    leaves, top = priorities(back, "replay")
    assert np.array_equal(leaves, priorities(c, "replay")[0])
    assert top == priorities(c, "replay")[1]
    assert back.tables["online"].sample_episodes(3).ids.tolist() == [3, 4, 5]  # each once
    journal.close()


def test_each_table_keeps_its_use_counts_in_a_file_of_its_own(folder: Path) -> None:
    c = Container.of_tables(
        20,
        {"a": (UniformSampler(), _no_limit()), "b": (UniformSampler(), _no_limit())},
        seed=0,
    )
    journal = Journal(folder)
    journal.track(c)
    journal.start(container_state(c, COUNTERS))
    commit(c, journal, 10)
    c.tables["b"].sample_rows(40)
    assert (folder / USE_COUNTS_FILE).is_file() and (folder / "use_counts.b.bin").is_file()
    on_disk = np.fromfile(folder / "use_counts.b.bin", dtype="<i4")
    assert on_disk[:10].sum() == 40
    assert np.fromfile(folder / USE_COUNTS_FILE, dtype="<i4")[:10].sum() == 0
    back = restore_container(Journal(folder).load())
    assert back.tables["b"].use_counts[:10].sum() == 40
    assert back.tables["a"].use_counts[:10].sum() == 0
    journal.close()


def test_a_one_table_journal_writes_what_it_always_did(folder: Path) -> None:
    c = Container(40, unit="episode", sampler=FifoSampler(max_times_sampled=1), seed=5)
    journal = Journal(folder)
    journal.track(c)
    journal.start(container_state(c, COUNTERS))
    commit(c, journal, 5)
    c.sample_episodes(1)
    sample = [body for body, *_ in _bodies(journal.path.read_bytes()) if body[0] == SAMPLE]
    assert [len(body) for body in sample] == [7]  # its type and six fields: no table named
    journal.close()


def _bodies(data: bytes) -> list[tuple[np.ndarray, int]]:
    return [(np.concatenate([[kind], fields]), end) for kind, fields, end in iter_records(data)]
