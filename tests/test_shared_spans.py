"""The live runs a daemon publishes for readers' own draws (``registry/shared_spans.py``) and the
listener that keeps them current (``ring/publisher.py``): what a view draws is what the registry
would draw, a publication in progress is never drawn from, a closed one sends the reader to the
daemon, and the ring publishes each change inside its own call, before its owner goes on."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from shmbuffer.registry import shared_spans
from shmbuffer.registry.intervals import Episode, EpisodeRegistry
from shmbuffer.registry.shared_spans import MAX_RUNS, SpansFile, SpansView
from shmbuffer.ring.container import Container
from shmbuffer.ring.listeners import RingListener
from shmbuffer.ring.publisher import SpansPublisher
from shmbuffer.samplers import MinSize, SampleToInsertRatio, make_sampler
from tests._stats import P_MIN, chi2_p

STAMPS = np.arange(1000, 1100, dtype=np.int64)  # stamp of row r: 1000 + r


def pair(tmp_path: Path) -> tuple[SpansFile, SpansView]:
    out = SpansFile(tmp_path / shared_spans.SPANS_FILE)
    view = SpansView.open(out.path)
    assert view is not None
    return out, view


def test_a_view_draws_what_the_registry_draws_from_the_same_words(tmp_path: Path) -> None:
    reg = EpisodeRegistry(100)
    for start, end in [(0, 3), (3, 7), (10, 30), (31, 32), (40, 70), (70, 100)]:
        reg.add(start, end)
    out, view = pair(tmp_path)
    starts, ends = reg.spans.runs()
    assert (starts, ends) == ([0, 10, 31, 40], [7, 30, 32, 100])
    out.publish(starts, ends, reg.num_rows, True)
    got = view.draw(np.random.default_rng(5), 4000, STAMPS)
    assert got is not None
    rows, gens, live = got
    assert live == reg.num_rows == 88
    assert np.array_equal(rows, reg.sample_rows(4000, np.random.default_rng(5)))
    assert np.array_equal(gens, STAMPS[rows])
    counts = np.bincount(rows, minlength=100)
    alive = np.zeros(100, dtype=bool)
    for s, e in zip(starts, ends, strict=True):
        alive[s:e] = True
    assert counts[~alive].sum() == 0
    assert chi2_p(counts[alive], np.full(88, 4000 / 88)) > P_MIN


def test_one_run_and_a_wrapped_ring(tmp_path: Path) -> None:
    out, view = pair(tmp_path)
    out.publish([20], [60], 40, True)
    got = view.draw(np.random.default_rng(0), 500, STAMPS)
    assert got is not None and got[0].min() >= 20 and got[0].max() < 60
    out.publish([0, 90], [5, 100], 15, True)  # the same view sees the next publication
    got = view.draw(np.random.default_rng(0), 500, STAMPS)
    assert got is not None and got[2] == 15
    assert set(np.unique(got[0])) <= set(range(5)) | set(range(90, 100))


@pytest.mark.parametrize(
    "runs, live, open_",
    [
        (([0], [10]), 10, False),  # the daemon says: ask me
        (([], []), 0, True),  # nothing live: the daemon says what an empty buffer does
        ((list(range(0, 2 * MAX_RUNS + 2, 2)), list(range(1, 2 * MAX_RUNS + 3, 2))), 65, True),
    ],
    ids=["closed", "empty", "too-many-runs"],
)
def test_a_closed_publication_sends_the_reader_to_the_daemon(
    tmp_path: Path, runs: tuple[list[int], list[int]], live: int, open_: bool
) -> None:
    out, view = pair(tmp_path)
    out.publish(runs[0], runs[1], live, open_)
    assert view.draw(np.random.default_rng(0), 8, STAMPS) is None
    out.publish([0], [10], 10, True)
    assert view.draw(np.random.default_rng(0), 8, STAMPS) is not None


def test_a_publication_in_progress_is_never_drawn_from(tmp_path: Path) -> None:
    """An odd sequence number (the daemon is writing, or died writing) or one that moves
    during the draw sends the reader to the daemon; a publication after it is drawn from."""
    out, view = pair(tmp_path)
    out.publish([0], [10], 10, True)
    words = out._words
    words[0] += 1  # odd: as if the daemon stopped in the middle of a publication
    assert view.draw(np.random.default_rng(0), 8, STAMPS) is None
    out.publish([50], [60], 10, True)  # the next daemon's publication (odd -> odd -> even)
    assert int(words[0]) % 2 == 0
    got = view.draw(np.random.default_rng(0), 8, STAMPS)
    assert got is not None and got[0].min() >= 50

    class Moving:
        """Stamps whose read coincides with a publication: the draw must not be used."""

        def take(self, rows: np.ndarray) -> np.ndarray:
            out.publish([50], [60], 10, True)
            return STAMPS[rows]

    assert view.draw(np.random.default_rng(0), 8, Moving()) is None  # type: ignore[arg-type]


def test_the_file_is_written_in_place(tmp_path: Path) -> None:
    """A daemon taking over a segment opens its file again: a reader's mapping sees it."""
    out, view = pair(tmp_path)
    out.publish([0], [10], 10, True)
    inode = out.path.stat().st_ino
    again = SpansFile(out.path)
    again.publish([30], [40], 10, True)
    assert out.path.stat().st_ino == inode
    got = view.draw(np.random.default_rng(0), 64, STAMPS)
    assert got is not None and got[0].min() >= 30 and got[0].max() < 40


class Probe(RingListener):
    """Registered after the publisher: what a reader could see of an eviction the moment the
    ring tells its listeners, before the ring's owner goes on (stamps, the reply)."""

    def __init__(self, view: SpansView) -> None:
        self.view = view
        self.seen: list[np.ndarray] = []

    def on_evict(self, start: int, stop: int, evicted: Sequence[Episode], rows: int) -> None:
        got = self.view.draw(np.random.default_rng(0), 2000, STAMPS)
        assert got is not None
        self.seen.append(got[0])


def test_an_eviction_is_published_inside_the_reservation(tmp_path: Path) -> None:
    out, view = pair(tmp_path)
    c = Container(100)
    publisher = SpansPublisher(c.table, out)
    assert publisher.open()
    probe = Probe(view)
    c.ring.listen(probe)
    for _ in range(10):
        c.commit(c.reserve_rows(10).id)
    c.reserve_rows(15)  # evicts rows 0..14 (the chunk of 10..19 keeps its tail)
    assert probe.seen, "the reservation evicted nothing"
    assert all(rows.min() >= 15 for rows in probe.seen), "an evicted row was still drawn"


def test_a_commit_is_published_at_the_owners_flush_or_the_next_eviction(tmp_path: Path) -> None:
    """Rows that become live may wait (readers then draw over fewer rows, all live); rows
    that stop being live never do."""
    out, view = pair(tmp_path)
    c = Container(40)
    publisher = SpansPublisher(c.table, out)
    rng = np.random.default_rng(0)
    c.commit(c.reserve_rows(20).id)
    assert publisher.stale and view.draw(rng, 4, STAMPS) is None  # still the empty ring
    publisher.flush()
    got = view.draw(rng, 400, STAMPS)
    assert got is not None and got[2] == 20
    c.commit(c.reserve_rows(20).id)  # rows 20..39, not published yet
    got = view.draw(rng, 400, STAMPS)
    assert got is not None and got[0].max() < 20
    c.reserve_rows(10)  # evicts rows 0..9: published at once, with the commit before it
    assert not publisher.stale
    got = view.draw(rng, 400, STAMPS)
    assert got is not None and got[2] == 30 and got[0].min() >= 10


def test_who_may_draw_is_the_tables_say(tmp_path: Path) -> None:
    out, view = pair(tmp_path)
    rng = np.random.default_rng(0)
    cases = [
        (Container(50), True),
        (Container(50, sampler=make_sampler("prioritized")), False),
        (Container(50, sampler=make_sampler("uniform", max_times_sampled=2)), False),
        (Container(50, sampler=make_sampler("fifo")), False),
        (Container(50, rate_limiter=SampleToInsertRatio(1.0, 1, 10.0)), False),
    ]
    for c, open_ in cases:
        publisher = SpansPublisher(c.table, out)
        c.commit(c.reserve_rows(20).id)
        publisher.flush()
        assert (view.draw(rng, 4, STAMPS) is not None) is open_, c.sampler.name
    c = Container(50, rate_limiter=MinSize(30))
    publisher = SpansPublisher(c.table, out)
    c.commit(c.reserve_rows(20).id)
    publisher.flush()
    assert view.draw(rng, 4, STAMPS) is None  # 20 of the 30 rows a sample waits for
    c.commit(c.reserve_rows(10).id)
    publisher.flush()
    assert view.draw(rng, 4, STAMPS) is not None
    c.rate_limiter.configure(min_size=40)
    publisher.publish()  # the owner's call after a change of settings
    assert view.draw(rng, 4, STAMPS) is None
    c.clear()
    assert view.draw(rng, 4, STAMPS) is None
