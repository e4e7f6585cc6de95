"""``--sampler max-heap`` / ``min-heap``: the n distinct items of highest / lowest priority, ties
newest first, priorities taken as the prioritized sampler takes them; against a brute-force
model, in process (``Buffer``, ``Container``) and in a real daemon, across an abort's restore,
a checkpoint and a SIGKILL + ``--resume``."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmbuffer import Buffer, Reader, Writer, cli
from shmbuffer.daemon.journal import Journal, container_state, restore_container
from shmbuffer.errors import EmptyBufferError, InvalidArgumentError
from shmbuffer.ring.container import Container
from shmbuffer.samplers import SAMPLERS, make_sampler
from shmbuffer.samplers.heap import RankTree
from tests.e2e.conftest import daemon, e2e_env  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(60)

SIGN = {"max-heap": 1.0, "min-heap": -1.0}


class Model:
    """What the heaps should hand out, kept apart from the code: every item's priority (by
    its slot: the row, or the episode's first row), new data at the largest priority seen."""

    def __init__(self, container: Container, name: str) -> None:
        self.container, self.sign = container, SIGN[name]
        self.priority: dict[int, float] = {}
        self.largest = 1.0

    def commit(self, lengths: list[int], priority: Any) -> None:
        reservation = self.container.reserve_rows(sum(lengths), lengths)
        slots = [
            slot
            for start, end in reservation.episodes
            for slot in (range(start, end) if self.container.unit == "transition" else [start])
        ]
        values = [self.largest] * len(slots) if priority is None else list(priority)
        self.container.commit(reservation.id, None if priority is None else np.array(values))
        self.priority.update(zip(slots, values, strict=True))
        self.largest = max([self.largest, *values])

    def update(self, rows: list[int], values: list[float]) -> int:
        where = self.episode_of()
        applied = [(row, p) for row, p in zip(rows, values, strict=True) if row in where]
        for row, p in applied:
            self.priority[row if self.container.unit == "transition" else where[row][1]] = p
        if applied:
            self.largest = max(self.largest, *(p for _, p in applied))
        return len(applied)

    def episode_of(self) -> dict[int, tuple[int, int, int]]:
        registry = self.container.registry
        return {r: (ep.id, ep.start, ep.end) for ep in registry for r in range(ep.start, ep.end)}

    def ranked(self) -> list[int]:
        """Item slots best first: priority, then the newest (id, then row) first."""
        episodes = list(self.container.registry)
        if self.container.unit == "transition":
            slots = [row for ep in episodes for row in range(ep.start, ep.end)]
        else:
            slots = [ep.start for ep in episodes]
        seq = {slot: i for i, slot in enumerate(slots)}
        return sorted(slots, key=lambda s: (-self.sign * self.priority[s], -seq[s]))

    def rows(self, n: int) -> list[int] | None:
        if self.container.unit == "transition":
            out = self.ranked()
        else:
            ends = {ep.start: ep.end for ep in self.container.registry}
            out = [row for start in self.ranked() for row in range(start, ends[start])]
        return out[:n] if len(out) >= n else None

    def episodes(self, n: int) -> list[tuple[int, int, int]] | None:
        where, out = self.episode_of(), []
        for slot in self.ranked():
            if where[slot] not in out:
                out.append(where[slot])
        return out[:n] if len(out) >= n else None

    def slices(self, n: int, length: int, strict: bool) -> list[tuple[int, int]] | None:
        where, out, taken = self.episode_of(), [], set()
        for slot in self.ranked():
            _, start, end = where[slot]
            if self.container.unit == "episode":
                if end - start >= length or not strict:
                    out.append((start, min(length, end - start)))
                continue
            if slot + length <= end:
                piece = range(slot, slot + length)
            elif not strict and slot == start and end - start < length:
                piece = range(start, end)
            else:
                continue
            if not taken.intersection(piece):
                taken.update(piece)
                out.append((piece.start, len(piece)))
        return out[:n] if len(out) >= n else None


PRIORITIES = st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0])


@st.composite
def commits(draw: Any) -> tuple[str, list[int], Any]:
    lengths = draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))
    return ("write", lengths, draw(st.one_of(st.none(), st.lists(PRIORITIES, min_size=1))))


OPS = st.lists(
    st.one_of(
        commits(),
        st.tuples(st.just("abort"), st.integers(1, 10)),
        st.tuples(
            st.just("update"),
            st.lists(st.tuples(st.integers(0, 23), PRIORITIES), min_size=1, max_size=6),
        ),
        st.tuples(st.just("rows"), st.integers(1, 12)),
        st.tuples(st.just("episodes"), st.integers(1, 4)),
        st.tuples(st.just("slices"), st.integers(1, 4), st.integers(1, 5), st.booleans()),
        st.tuples(st.just("clear")),
    ),
    max_size=40,
)


@pytest.mark.parametrize("unit", ["transition", "episode"])
@pytest.mark.parametrize("name", ["max-heap", "min-heap"])
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_draws_are_the_best_distinct_items(name: str, unit: str, ops: list[Any]) -> None:
    container = Container(24, unit=unit, sampler=make_sampler(name))
    model = Model(container, name)
    for op in ops:
        if op[0] == "write":
            lengths, priority = op[1], op[2]
            items = sum(lengths) if unit == "transition" else len(lengths)
            if priority is not None:
                priority = (priority * items)[:items]  # one per item
            model.commit(lengths, priority)
        elif op[0] == "abort":  # what it evicted comes back with its priorities
            container.abort(container.reserve_rows(op[1]).id, 0)
        elif op[0] == "clear":
            container.clear()
        elif op[0] == "update":
            rows, values = [r for r, _ in op[1]], [p for _, p in op[1]]
            want_count = model.update(rows, values)
            assert container.update_priorities(np.array(rows), np.array(values)) == want_count
        elif op[0] == "rows":
            want = model.rows(op[1])
            if want is None:
                with pytest.raises(EmptyBufferError):
                    container.sample_rows(op[1])
                continue
            got = container.sample_rows(op[1])
            assert got.rows.tolist() == want
            assert got.probability.tolist() == got.weight.tolist() == [1.0] * op[1]
        elif op[0] == "episodes":
            want_eps = model.episodes(op[1])
            if want_eps is None:
                with pytest.raises(EmptyBufferError):
                    container.sample_episodes(op[1])
                continue
            eps = container.sample_episodes(op[1])
            got_eps = zip(eps.ids.tolist(), eps.starts.tolist(), eps.ends.tolist(), strict=True)
            assert list(got_eps) == want_eps
        else:
            n, length, strict = op[1:]
            want_slices = model.slices(n, length, strict)
            if want_slices is None:
                with pytest.raises(EmptyBufferError):
                    container.sample_slices(n, length, strict=strict)
                continue
            got = container.sample_slices(n, length, strict=strict)
            pairs = zip(got.starts.tolist(), got.lengths.tolist(), strict=True)
            assert list(pairs) == want_slices


@settings(max_examples=100, deadline=None)
@given(
    capacity=st.integers(1, 300),
    steps=st.lists(
        st.tuples(st.integers(0, 299), st.sampled_from([None, 0.0, 1.0, 2.5])), max_size=80
    ),
    n=st.integers(1, 40),
)
def test_the_tree_walk_finds_the_best_items_of_any_capacity(
    capacity: int, steps: list[tuple[int, float | None]], n: int
) -> None:
    """Sizes across the levels' boundaries (16, 256): the walk keeps what ranks highest."""
    tree, held, seq = RankTree(capacity), {}, 0
    for step, value in steps:
        slot = step % capacity
        if value is None:
            if slot in held:
                tree.remove(np.array([slot]))
                del held[slot]
        elif slot in held:
            tree.set(np.array([slot]), np.array([value]))
            held[slot] = (value, held[slot][1])
        else:
            tree.set(np.array([slot]), np.array([value]), np.array([seq]))
            held[slot], seq = (value, seq), seq + 1
    want = sorted(held, key=lambda s: (-held[s][0], -held[s][1]))[:n]
    assert tree.top(n).tolist() == want


# -- in process --------------------------------------------------------------------------------


def _ids(first: int, n: int) -> dict[str, torch.Tensor]:
    return {"id": torch.arange(first, first + n)}


@pytest.mark.parametrize("name", ["max-heap", "min-heap"])
def test_a_buffer_takes_priorities_as_prioritized_does(name: str) -> None:
    best = max if name == "max-heap" else min
    with Buffer(16, sampler=name) as buf:
        buf.extend(_ids(0, 4), priority=[3.0, 1.0, 2.0, 0.5])
        buf.extend(_ids(4, 2))  # None: the largest priority seen so far, 3
        batch, info = buf.sample(3, return_info=True)
        if name == "max-heap":  # ties (3 and 3 and 3): the newest first
            assert batch["id"].tolist() == [5, 4, 0]
        else:
            assert batch["id"].tolist() == [3, 1, 2]
        assert info["probability"].tolist() == [1.0] * 3 and info["weight"].tolist() == [1.0] * 3
        # an update moves an item; a repeated row takes its last value
        assert buf.update_priorities(torch.tensor([1, 1]), torch.tensor([9.0, 0.25])) == 2
        assert buf.sample(1)["id"].tolist() == [5 if name == "max-heap" else 1]
        assert buf.stats()["sampler"]["priority_best"] == best(3.0, 0.25)
        for bad in (-1.0, float("nan"), float("inf")):
            with pytest.raises(InvalidArgumentError, match="priorit"):
                buf.update_priorities(torch.tensor([0]), torch.tensor([bad]))
            with pytest.raises(InvalidArgumentError, match="priorit"):
                buf.extend(_ids(6, 1), priority=bad)
        assert len(buf) == 6
        with pytest.raises(EmptyBufferError, match="cannot hand out 7 distinct rows: 6 live"):
            buf.sample(7)


def test_an_abort_gives_restored_items_their_priorities_back() -> None:
    container = Container(10, sampler=make_sampler("max-heap"))
    reservation = container.reserve_rows(8)
    container.commit(reservation.id, np.arange(8, dtype=np.float64))
    container.update_priorities(np.array([0]), np.array([50.0]))
    reservation = container.reserve_rows(5)  # wraps: evicts rows 0..2
    assert container.sample_rows(2).rows.tolist() == [7, 6]
    container.abort(reservation.id, 0)
    assert container.sample_rows(3).rows.tolist() == [0, 7, 6]


@pytest.mark.parametrize("unit", ["transition", "episode"])
def test_priorities_survive_a_checkpoint_and_a_journal_replay(tmp_path: Path, unit: str) -> None:
    rng = np.random.default_rng(3)
    container = Container(
        30, unit=unit, sampler=make_sampler("min-heap", max_times_sampled=3), seed=1
    )
    journal = Journal(tmp_path)
    journal.track(container)
    journal.start(container_state(container))
    counters = {"rows_committed": 0, "episodes_committed": 0}
    for step in range(250):
        action = rng.random()
        if action < 0.35:
            n = int(rng.integers(1, 6))
            evict = container.plan(n).evict
            reservation = container.reserve_rows(n)
            journal.append_reserve(
                evict, container.pointer, container.rows_written, container.next_reservation
            )
            priority = float(rng.integers(0, 4)) if rng.random() < 0.5 else None
            given = container.commit_priorities(reservation.id, priority)
            ids = container.commit(reservation.id, priority)
            counters["rows_committed"] += n
            counters["episodes_committed"] += len(ids)
            bounds = zip(ids, reservation.episodes, strict=True)
            journal.append_commit([(i, s, e) for i, (s, e) in bounds], **counters)
            if given is not None:
                journal.append_priorities(given.rows, given.priority)
        elif action < 0.6:
            rows = rng.integers(0, 30, size=3)
            update = container.check_priorities(rows, rng.random(3) * 4)
            container.apply_priorities(update)
            journal.append_priorities(update.rows, update.priority)
        else:
            with contextlib.suppress(EmptyBufferError):
                container.sample_rows(int(rng.integers(1, 4)))
        if step == 150:
            journal.snapshot(container_state(container, counters))
    copy = Container.from_state(container.state())
    back = restore_container(Journal(tmp_path).load())
    live = container.sampler.state_dict()
    assert copy.sampler.state_dict() == back.sampler.state_dict() == live
    rows = container.sample_rows(2).rows.tolist()  # and they draw what the live one draws
    assert copy.sample_rows(2).rows.tolist() == back.sample_rows(2).rows.tolist() == rows
    journal.close()


def test_they_are_listed_with_their_declarations() -> None:
    for name in ("max-heap", "min-heap"):
        cls = SAMPLERS[name]
        assert cls.has_priorities and not cls.consumes and not cls.waits_for_data


# -- a daemon ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["max-heap", "min-heap"])
def test_a_daemon_serves_the_best_items_and_keeps_priorities_across_sigkill_and_checkpoint(
    daemon: Any,  # noqa: F811 (the fixture)
    tmp_path: Path,
    name: str,
) -> None:
    sign = SIGN[name]
    d = daemon(capacity=32, unit="transition", args=["--sampler", name])
    priority = np.array([5.0, 1.0, 7.0, 3.0, 6.0, 2.0, 4.0, 0.0])
    with Writer(d.name) as writer:
        writer.extend(_ids(0, 8), priority=priority)
        writer.flush()

    def best(count: int) -> list[int]:
        return sorted(range(8), key=lambda i: -sign * priority[i])[:count]

    with Reader(d.name) as reader:
        batch, info = reader.sample(3, return_info=True)
        assert batch["id"].tolist() == best(3)
        assert info["probability"].tolist() == [1.0] * 3 and info["weight"].tolist() == [1.0] * 3
        moved = info["index"].numpy()
        priority[moved] = [3.5, 3.25, 3.125]  # the three to the middle
        assert reader.update_priorities(info["index"], torch.from_numpy(priority[moved])) == 3
        assert reader.sample(3)["id"].tolist() == best(3)
    assert cli.main(["checkpoint", "--name", d.name, "--to", str(tmp_path)]) == 0
    checkpointed = best(8)
    top = 10.0 if name == "max-heap" else 0.0
    with Reader(d.name) as reader:
        priority[checkpointed[-1]] = top  # the worst becomes the best
        assert reader.update_priorities(torch.tensor([checkpointed[-1]]), top) == 1
    os.kill(d.pid, signal.SIGKILL)
    d.process.wait(10)
    resumed = daemon(name=d.name, capacity=32, unit="transition", args=["--resume"])
    with Reader(resumed.name) as reader:
        assert reader.sample(8)["id"].tolist() == best(8)  # the journal replayed the update
    resumed.stop()
    restored = daemon(
        name=d.name, capacity=32, unit="transition", args=["--restore", str(tmp_path)]
    )
    with Reader(restored.name) as reader:
        assert reader.sample(8)["id"].tolist() == checkpointed
