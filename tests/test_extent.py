"""Where each live row lies in its episode (``Container.extent``: the rows before it and from
it on), what a read reaching past a drawn row (frame stacks, n-step returns, later goals)
relies on; and the stamp rule that lets such a read check those rows: every row of one
reservation carries one stamp, above each row's old one (``storage/stamps.py``)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shmbuffer.buffer import Buffer


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=14),
    unit=st.sampled_from(["transition", "episode"]),
    capacity=st.integers(8, 20),
)
def test_extent_counts_the_live_rows_of_the_same_write(
    lengths: list[int], unit: str, capacity: int
) -> None:
    step = 0
    with Buffer(capacity, unit=unit, seed=1) as buffer:
        for length in lengths:
            if length > capacity:
                continue
            ids = np.arange(step, step + length, dtype=np.int64)
            step += length
            buffer.add_episode({"step": ids, "write": np.full(length, step, np.int64)})
            registry = buffer.container.ring.registry
            live = np.array(sorted(r for ep in registry for r in range(ep.start, ep.end)))
            if live.size == 0:
                continue
            before, left = buffer.container.extent(live)
            columns = buffer.segment.columns
            step_of, write_of = columns[("step",)].numpy(), columns[("write",)].numpy()
            live_steps = {int(step_of[r]): int(write_of[r]) for r in live}
            for r, b, f in zip(live, before, left, strict=True):
                s, w = int(step_of[r]), int(write_of[r])
                # the live rows of the same write before it and from it on (a write is one
                # episode here): step ids count up along it, through the ring's end
                want_before = sum(1 for k in live_steps if k < s and live_steps[k] == w)
                want_left = sum(1 for k in live_steps if k >= s and live_steps[k] == w)
                assert (int(b), int(f)) == (want_before, want_left), (r, s)


def test_one_reservation_carries_one_stamp_above_the_old_ones() -> None:
    with Buffer(10, unit="transition") as buffer:
        buffer.extend({"x": np.arange(4)})
        buffer.extend({"x": np.arange(3)})
        stamps = buffer.segment.generations
        assert len(set(stamps[:4].tolist())) == 1 and len(set(stamps[4:7].tolist())) == 1
        before = stamps.copy()
        buffer.extend({"x": np.arange(6)})  # rows 7..9 and 0..2, across the ring's end
        rows = [7, 8, 9, 0, 1, 2]
        assert len(set(stamps[rows].tolist())) == 1
        assert all(stamps[r] > before[r] for r in rows)
        assert (stamps[3:7] == before[3:7]).all()


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=14),
    unit=st.sampled_from(["transition", "episode"]),
    capacity=st.integers(8, 20),
    pick=st.integers(0, 10**6),
)
def test_episode_spans_cover_exactly_the_live_rows_of_the_same_write(
    lengths: list[int], unit: str, capacity: int, pick: int
) -> None:
    """What a rewrite re-stamps (``RowEpisodes.episode_spans``): the whole episode a row lies
    in, both parts of one the ring's end split, nothing else."""
    step = 0
    with Buffer(capacity, unit=unit, seed=1) as buffer:
        for length in lengths:
            if length <= capacity:
                buffer.add_episode({"write": np.full(length, step, np.int64)})
                step += 1
        registry = buffer.container.ring.registry
        live = np.array(sorted(r for ep in registry for r in range(ep.start, ep.end)))
        if live.size == 0:
            return
        row = int(live[pick % live.size])
        spans = buffer.container.rows_index().episode_spans(np.array([row]))
        covered = sorted(r for s, e in spans for r in range(s, e))
        write = buffer.segment.columns[("write",)].numpy()
        assert covered == [int(r) for r in live if write[r] == write[row]]
