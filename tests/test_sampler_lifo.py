"""``--sampler lifo``: the newest distinct rows, episodes and slices, newest first, against a
brute-force model read off the registry; in process (``Buffer``, ``Container``) and in a real
daemon, across an abort's restore, a checkpoint and a SIGKILL + ``--resume``."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmbuffer import Buffer, Reader, Writer, cli
from shmbuffer.daemon.journal import Journal, container_state, restore_container
from shmbuffer.errors import EmptyBufferError, InvalidArgumentError, WaitTimeoutError
from shmbuffer.ring.container import Container
from shmbuffer.samplers import SAMPLERS, make_sampler
from tests.e2e.conftest import daemon, e2e_env  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(60)

# -- the model: the registry's episodes in id order are the commit order --------------------


def chunks(container: Container) -> list[tuple[int, int, int]]:
    """Live episodes (chunks in transition unit), newest first: ``(id, start, end)``."""
    return [(ep.id, ep.start, ep.end) for ep in reversed(list(container.registry))]


def newest_rows(container: Container, counts: dict[int, int] | None = None, k: int = 0) -> list:
    """Live rows newest first (with ``counts``: the items handed out fewer than ``k`` times)."""
    rows = []
    for _, start, end in chunks(container):
        if counts is not None and container.unit == "episode" and counts.get(start, 0) >= k:
            continue
        for row in range(end - 1, start - 1, -1):
            if counts is None or container.unit == "episode" or counts.get(row, 0) < k:
                rows.append(row)
    return rows


def expected_slices(container: Container, n: int, length: int, strict: bool) -> list | None:
    """``(start, length)`` of the ``n`` slices, or None if they do not exist."""
    out = []
    for _, start, end in chunks(container):
        size = end - start
        if size < length:
            if not strict:
                out.append((start, size))
        elif container.unit == "episode":
            out.append((end - length, length))
        else:  # cut back from the chunk's end; a shorter remainder is passed over
            out += [(stop - length, length) for stop in range(end, start + length - 1, -length)]
    return out[:n] if len(out) >= n else None


def write(container: Container, lengths: list[int]) -> None:
    reservation = container.reserve_rows(sum(lengths), lengths)
    container.commit(reservation.id)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.lists(st.integers(1, 7), min_size=1, max_size=3)),
        st.tuples(st.just("abort"), st.integers(1, 12)),
        st.tuples(st.just("rows"), st.integers(1, 30)),
        st.tuples(st.just("episodes"), st.integers(1, 6)),
        st.tuples(st.just("slices"), st.integers(1, 5), st.integers(1, 6), st.booleans()),
        st.tuples(st.just("clear")),
    ),
    max_size=40,
)


@pytest.mark.parametrize("unit", ["transition", "episode"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_draws_are_the_newest_distinct_items(unit: str, ops: list[tuple[Any, ...]]) -> None:
    container = Container(24, unit=unit, sampler=make_sampler("lifo"))
    for op in ops:
        kind = op[0]
        if kind == "write":
            write(container, op[1])
        elif kind == "abort":  # evicts, then gives back what it evicted: in its old place
            container.abort(container.reserve_rows(op[1]).id, 0)
        elif kind == "clear":
            container.clear()
        elif kind == "rows":
            want = newest_rows(container)[: op[1]]
            if len(want) < op[1]:
                with pytest.raises(EmptyBufferError, match=f"{len(want)} live"):
                    container.sample_rows(op[1])
                continue
            got = container.sample_rows(op[1])
            assert got.rows.tolist() == want
            assert got.probability.tolist() == got.weight.tolist() == [1.0] * op[1]
        elif kind == "episodes":
            want_eps = chunks(container)[: op[1]]
            if len(want_eps) < op[1]:
                with pytest.raises(EmptyBufferError):
                    container.sample_episodes(op[1])
                continue
            eps = container.sample_episodes(op[1])
            got_eps = zip(eps.ids.tolist(), eps.starts.tolist(), eps.ends.tolist(), strict=True)
            assert list(got_eps) == want_eps
        else:
            n, length, strict = op[1:]
            want_slices = expected_slices(container, n, length, strict)
            if want_slices is None:
                with pytest.raises(EmptyBufferError):
                    container.sample_slices(n, length, strict=strict)
                continue
            got_slices = container.sample_slices(n, length, strict=strict)
            pairs = zip(got_slices.starts.tolist(), got_slices.lengths.tolist(), strict=True)
            assert list(pairs) == want_slices


@pytest.mark.parametrize("unit", ["transition", "episode"])
@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("write"), st.lists(st.integers(1, 6), min_size=1, max_size=3)),
            st.tuples(st.just("abort"), st.integers(1, 10)),
            st.tuples(st.just("rows"), st.integers(1, 12)),
            st.tuples(st.just("episodes"), st.integers(1, 4)),
        ),
        max_size=40,
    ),
    limit=st.integers(1, 2),
)
def test_max_times_sampled_retires_items_as_a_stack(
    unit: str, ops: list[tuple[Any, ...]], limit: int
) -> None:
    """With ``max_times_sampled=K`` an item handed out K times is never handed out again
    (until its rows are overwritten); an abort's restore keeps the counts."""
    container = Container(20, unit=unit, sampler=make_sampler("lifo", max_times_sampled=limit))
    counts: dict[int, int] = {}  # by slot: row, or the episode's first row
    for op in ops:
        if op[0] == "write":
            reservation = container.reserve_rows(sum(op[1]), op[1])
            for start, end in reservation.episodes:
                for slot in range(start, end) if unit == "transition" else [start]:
                    counts.pop(slot, None)
            container.commit(reservation.id)
        elif op[0] == "abort":
            container.abort(container.reserve_rows(op[1]).id, 0)
        elif op[0] == "rows":
            want = newest_rows(container, counts, limit)[: op[1]]
            if len(want) < op[1]:
                with pytest.raises(EmptyBufferError, match="live and unretired"):
                    container.sample_rows(op[1])
                continue
            assert container.sample_rows(op[1]).rows.tolist() == want
            starts = {row: s for _, s, e in chunks(container) for row in range(s, e)}
            for slot in {row if unit == "transition" else starts[row] for row in want}:
                counts[slot] = counts.get(slot, 0) + 1
        elif unit == "transition":
            with pytest.raises(InvalidArgumentError, match="max_times_sampled counts rows"):
                container.sample_episodes(op[1])
        else:
            live = [c for c in chunks(container) if counts.get(c[1], 0) < limit]
            if len(live) < op[1]:
                with pytest.raises(EmptyBufferError):
                    container.sample_episodes(op[1])
                continue
            assert container.sample_episodes(op[1]).ids.tolist() == [c[0] for c in live[: op[1]]]
            for _, start, _ in live[: op[1]]:
                counts[start] = counts.get(start, 0) + 1


# -- in process --------------------------------------------------------------------------------


def _ids(first: int, n: int) -> dict[str, torch.Tensor]:
    return {"id": torch.arange(first, first + n)}


def test_a_buffer_hands_out_the_newest_data_with_probability_and_weight_one() -> None:
    with Buffer(16, sampler="lifo") as buf:
        for first in range(0, 30, 5):  # wraps: rows 0..13 overwritten
            buf.extend(_ids(first, 5))
        batch, info = buf.sample(7, return_info=True)
        assert batch["id"].tolist() == [29, 28, 27, 26, 25, 24, 23]
        assert info["probability"].tolist() == [1.0] * 7 and info["weight"].tolist() == [1.0] * 7
        episodes = buf.sample_episodes(2)
        assert [ep["id"].tolist() for ep in episodes] == [
            [25, 26, 27, 28, 29],
            [20, 21, 22, 23, 24],
        ]
        assert buf.sample_slices(3, 2)["id"].tolist() == [[28, 29], [26, 27], [23, 24]]
        with pytest.raises(InvalidArgumentError, match="priority given"):
            buf.extend(_ids(30, 2), priority=1.0)
        with pytest.raises(InvalidArgumentError, match="update_priorities"):
            buf.update_priorities(info["index"], 1.0)
        with pytest.raises(EmptyBufferError, match="cannot hand out 17 distinct rows"):
            buf.sample(17)
        stats = buf.stats()["sampler"]
        assert stats["sampler"] == "lifo" and stats["items"] == 16


def test_an_abort_puts_the_restored_rows_back_in_their_place_not_on_top() -> None:
    container = Container(12, sampler=make_sampler("lifo"))
    write(container, [5])
    write(container, [5])
    newest = container.sample_rows(10).rows.tolist()
    reservation = container.reserve_rows(6)  # wraps: evicts the first chunk and trims the second
    assert container.sample_rows(4).rows.tolist() == newest[:4]
    assert container.abort(reservation.id, 0)  # nothing written: everything comes back
    assert container.sample_rows(10).rows.tolist() == newest


@pytest.mark.parametrize("unit", ["transition", "episode"])
def test_state_survives_a_checkpoint_and_a_journal_replay(tmp_path: Path, unit: str) -> None:
    """What draws changed (max_times_sampled counts) comes back from the saved state and from
    a journal replayed after a crash, so the resumed sampler hands out what the live one would."""
    rng = np.random.default_rng(5)
    container = Container(40, unit=unit, sampler=make_sampler("lifo", max_times_sampled=2))
    journal = Journal(tmp_path)
    journal.track(container)
    journal.start(container_state(container))
    counters = {"rows_committed": 0, "episodes_committed": 0}
    for step in range(200):
        if rng.random() < 0.4:
            n = int(rng.integers(1, 6))
            evict = container.plan(n).evict
            reservation = container.reserve_rows(n)
            journal.append_reserve(
                evict, container.pointer, container.rows_written, container.next_reservation
            )
            ids = container.commit(reservation.id)
            counters["rows_committed"] += n
            counters["episodes_committed"] += len(ids)
            bounds = zip(ids, reservation.episodes, strict=True)
            journal.append_commit([(i, s, e) for i, (s, e) in bounds], **counters)
        else:
            try:
                if rng.random() < 0.5:
                    container.sample_rows(int(rng.integers(1, 4)))
                else:
                    container.sample_slices(1, 2, strict=False)
            except EmptyBufferError:
                pass
        if step == 120:
            journal.snapshot(container_state(container, counters))
    state = container.state()
    saved = msgpack.unpackb(msgpack.packb(state["sampler"]["state"]))
    copy = Container.from_state(state)
    assert copy.sampler.state_dict() == container.sampler.state_dict()
    assert saved is not None
    back = restore_container(Journal(tmp_path).load())
    assert back.sampler.state_dict() == container.sampler.state_dict()
    rows = container.sample_rows(3).rows.tolist()  # and they draw what the live one draws
    assert copy.sample_rows(3).rows.tolist() == back.sample_rows(3).rows.tolist() == rows
    journal.close()


def test_it_is_listed_with_its_declaration() -> None:
    cls = SAMPLERS["lifo"]
    assert not cls.consumes and not cls.waits_for_data and not cls.has_priorities
    assert make_sampler("lifo", max_times_sampled=1).consuming
    assert list(SAMPLERS)[:4] == ["uniform", "without-replacement", "prioritized", "fifo"]


# -- a daemon ----------------------------------------------------------------------------------


def test_a_daemon_serves_the_newest_data_and_keeps_consumption_across_sigkill_and_checkpoint(
    daemon: Any,  # noqa: F811 (the fixture)
    tmp_path: Path,
) -> None:
    args = ["--sampler", "lifo", "--max-times-sampled", "1"]
    d = daemon(capacity=32, unit="episode", args=args)
    with Writer(d.name) as writer:
        for first in range(0, 20, 4):  # five episodes of four rows: ids 0..19
            writer.extend(_ids(first, 4))
        writer.flush()
    with Reader(d.name, sample_timeout=0.3) as reader:
        batch, info = reader.sample(3, return_info=True)  # the newest episode's last rows
        assert batch["id"].tolist() == [19, 18, 17]
        assert info["probability"].tolist() == [1.0] * 3 and info["weight"].tolist() == [1.0] * 3
        # consume-once: the newest episode was handed out, the next one's last two rows come
        assert reader.sample_slices(1, 2)["id"].tolist() == [[14, 15]]
    stats = d.stats()["sampler"]
    assert stats["kind"] == "lifo" and stats["figures"]["retired"] == 2
    assert cli.main(["checkpoint", "--name", d.name, "--to", str(tmp_path)]) == 0
    with Reader(d.name, sample_timeout=0.3) as reader:
        assert reader.sample(2)["id"].tolist() == [11, 10]  # after the checkpoint
    os.kill(d.pid, signal.SIGKILL)
    d.process.wait(10)
    resumed = daemon(name=d.name, capacity=32, unit="episode", args=["--resume"])
    with Reader(resumed.name, sample_timeout=0.3) as reader:
        assert reader.sample(2)["id"].tolist() == [7, 6]  # the journal replayed the draws
    resumed.stop()
    restored = daemon(name=d.name, capacity=32, unit="episode", args=["--restore", str(tmp_path)])
    with Reader(restored.name, sample_timeout=0.3) as reader:
        assert reader.sample(4)["id"].tolist() == [11, 10, 9, 8]
        with pytest.raises(WaitTimeoutError):
            reader.sample(12)  # 8 rows left unconsumed: a consume-once sample waits
