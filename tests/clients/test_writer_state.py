"""The Writer's state machine against a fake daemon (tests/clients/fakeconn.py): reserving
ahead in a run of equal writes (clients/ahead.py), and staging small writes into one
reservation (clients/pipeline.py, clients/staging.py). The end-to-end tests of the same
promises, against a real daemon, are tests/e2e/test_writer_ahead.py and test_writer_promises.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from shmbuffer.clients.ahead import AHEAD_BACKOFF, AHEAD_SHARE
from shmbuffer.clients.writer import Writer
from tests.clients.conftest import MakeDaemon
from tests.clients.fakeconn import FakeDaemon

#: A commit delay no test reaches: the commit ticker never fires unless a test asks it to.
SLOW = 30.0


class Rows:
    """Consecutive writes of a stream whose row ``i`` holds ``i`` in every column."""

    def __init__(self) -> None:
        self.next = 0

    def batch(self, n: int) -> dict[str, np.ndarray]:
        steps = np.arange(self.next, self.next + n)
        self.next += n
        return {"obs": np.repeat(steps[:, None], 3, axis=1).astype(np.float32), "step": steps}


def stored_in_order(daemon: FakeDaemon) -> np.ndarray:
    """The ``step`` column of the committed reservations, in commit order."""
    step = daemon.segment.arrays[("step",)]
    out = []
    for rid in daemon.committed:
        for start, end in daemon.reservations[rid].ranges:
            out.append(step[start:end])
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def ahead_in_hand(writer: Writer, daemon: FakeDaemon) -> int:
    """Reservations the writer holds ahead of its writes: granted and untaken, and those the
    reserve in flight asks for."""
    ahead = writer._pipe.ahead
    count = len(ahead.granted)
    if ahead.pending is not None:
        count += int(daemon.ops("reserve")[-1].get("count", 1))
    return count


@pytest.fixture
def streaming(fake: MakeDaemon) -> Iterator[tuple[Writer, FakeDaemon]]:
    daemon = fake(capacity=1024)
    writer = Writer("fake", batch_bytes=0, commit_delay=SLOW)
    yield writer, daemon
    writer.close()


def test_a_run_of_equal_writes_reserves_a_batch_ahead(
    streaming: tuple[Writer, FakeDaemon],
) -> None:
    writer, daemon = streaming
    rows, size = Rows(), 8
    for _ in range(12):
        writer.extend(rows.batch(size))
        # Never more reserved ahead than 1/AHEAD_SHARE of the ring.
        assert ahead_in_hand(writer, daemon) * size * AHEAD_SHARE <= daemon.capacity
    reserves = daemon.ops("reserve")
    ahead = [r for r in reserves if r.get("ahead")]
    assert ahead and reserves[0].get("ahead") is None  # the first write cannot have been guessed
    assert all(r["count"] == 4 for r in ahead)  # 1024 // (16 * 8) = 8 fit; one kept in hand
    assert len(reserves) < 12 // 2  # one message per batch, not per write
    # The commits of the writes before a batch ride on its reserve.
    assert any("commits" in r for r in ahead)
    writer.flush()
    assert daemon.committed_rows() == 12 * size
    np.testing.assert_array_equal(stored_in_order(daemon), np.arange(12 * size))
    # Flushed: what was reserved ahead and not used went back, with nothing written.
    assert not daemon.outstanding()
    assert {r.aborted for r in daemon.reservations.values() if r.aborted is not None} <= {0}
    assert not writer.conn.pending()


def test_a_write_that_differs_gives_the_reservations_ahead_back(
    streaming: tuple[Writer, FakeDaemon],
) -> None:
    writer, daemon = streaming
    rows = Rows()
    for _ in range(3):
        writer.extend(rows.batch(8))
    copied = {r for r, _, _ in writer._pipe._uncommitted}  # written, their commits waiting
    held = [r.id for r in daemon.outstanding() if r.ahead and r.id not in copied]
    assert held  # reserved ahead for the next 8-row writes
    writer.extend(rows.batch(5))  # not the shape guessed
    aborted = [r for r in daemon.reservations.values() if r.aborted is not None]
    assert sorted(r.id for r in aborted) == sorted(held)
    assert all(r.aborted == 0 for r in aborted)
    # Given back before the write's own reserve, which reserves as a first write does.
    five = next(i for i, r in enumerate(daemon.log) if r.op == "reserve" and r.fields["rows"] == 5)
    assert all(i < five for i, r in enumerate(daemon.log) if r.op == "abort")
    assert not daemon.log[five].fields.get("ahead")
    writer.flush()
    np.testing.assert_array_equal(stored_in_order(daemon), np.arange(29))


def test_a_write_too_large_for_the_share_never_reserves_ahead(
    streaming: tuple[Writer, FakeDaemon],
) -> None:
    writer, daemon = streaming
    rows, size = Rows(), 1024 // AHEAD_SHARE * 2
    for _ in range(5):
        writer.extend(rows.batch(size))
    assert not any(r.get("ahead") for r in daemon.ops("reserve"))
    writer.flush()
    assert daemon.committed_rows() == 5 * size


def test_a_write_of_the_whole_share_reserves_one_ahead(
    streaming: tuple[Writer, FakeDaemon],
) -> None:
    writer, daemon = streaming
    rows, size = Rows(), 1024 // AHEAD_SHARE
    for _ in range(6):
        writer.extend(rows.batch(size))
        assert ahead_in_hand(writer, daemon) <= 1
    ahead = [r for r in daemon.ops("reserve") if r.get("ahead")]
    assert ahead and all("count" not in r for r in ahead)
    writer.flush()
    np.testing.assert_array_equal(stored_in_order(daemon), np.arange(6 * size))


def test_a_refused_reserve_ahead_backs_off(streaming: tuple[Writer, FakeDaemon]) -> None:
    writer, daemon = streaming
    daemon.refuse_ahead = True
    rows = Rows()
    for _ in range(AHEAD_BACKOFF):
        writer.extend(rows.batch(2))
    # One asked ahead and was refused (reservation 0); the writes after it reserve as before.
    assert sum(1 for r in daemon.ops("reserve") if r.get("ahead")) == 1
    writer.flush()
    np.testing.assert_array_equal(stored_in_order(daemon), np.arange(2 * AHEAD_BACKOFF))


def test_an_idle_writer_gives_back_what_it_reserved_ahead(fake: MakeDaemon) -> None:
    daemon = fake(capacity=1024)
    delay = 0.1  # the ticker looks every delay / 2; writes come back to back, well within it
    with Writer("fake", batch_bytes=0, commit_delay=delay) as writer:
        rows = Rows()
        for _ in range(3):
            writer.extend(rows.batch(8))
        assert any(r.ahead for r in daemon.outstanding())
        deadline = time.monotonic() + 5.0
        while daemon.outstanding() and time.monotonic() < deadline:
            time.sleep(0.01)
        # The ticker, with no call of the writer: committed what was written, returned the rest.
        assert not daemon.outstanding()
        assert daemon.committed_rows() == 24
        assert all(r.aborted == 0 for r in daemon.reservations.values() if not r.committed)
    np.testing.assert_array_equal(stored_in_order(daemon), np.arange(24))


# -- staging ------------------------------------------------------------------------------------


def test_small_writes_are_gathered_into_one_reservation(fake: MakeDaemon) -> None:
    daemon = fake(capacity=1024)
    row_nbytes = 3 * 4 + 8
    with Writer("fake", batch_bytes=40 * row_nbytes, commit_delay=SLOW) as writer:
        rows = Rows()
        for _ in range(7):
            writer.extend(rows.batch(5))
        assert daemon.ops("reserve") == []  # 35 rows staged, under batch_bytes
        writer.extend(rows.batch(5))  # 40 rows: batch_bytes reached
        (reserve,) = daemon.ops("reserve")
        assert reserve["rows"] == 40 and reserve["episodes"] == 8
        writer.extend(rows.batch(5))
        writer.flush()  # stores what is staged
        assert [r["rows"] for r in daemon.ops("reserve")] == [40, 5]
    np.testing.assert_array_equal(stored_in_order(daemon), np.arange(45))


def test_a_large_write_stores_what_was_staged_first(fake: MakeDaemon) -> None:
    daemon = fake(capacity=1024)
    row_nbytes = 3 * 4 + 8
    with Writer("fake", batch_bytes=40 * row_nbytes, commit_delay=SLOW) as writer:
        rows = Rows()
        writer.extend(rows.batch(5))
        writer.extend(rows.batch(5))
        writer.extend(rows.batch(30))  # over half of batch_bytes: stored at once, after those
        assert [r["rows"] for r in daemon.ops("reserve")] == [10, 30]
    np.testing.assert_array_equal(stored_in_order(daemon), np.arange(40))


def test_a_fixed_buffer_reserves_every_write_before_it_returns(fake: MakeDaemon) -> None:
    daemon = fake(capacity=1024, mode="fixed")
    with Writer("fake", commit_delay=SLOW) as writer:
        rows = Rows()
        for i in range(4):
            writer.extend(rows.batch(5))
            assert len(daemon.ops("reserve")) == i + 1  # not staged: a refusal is this call's
        assert not any(r.get("ahead") for r in daemon.ops("reserve"))  # nor guessed ahead
    np.testing.assert_array_equal(stored_in_order(daemon), np.arange(20))
