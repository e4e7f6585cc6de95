"""Writers and readers in separate processes against one daemon: whole episodes, zero-copy
leased views, and leases that outlive a killed reader only by their TTL."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from shmbuffer import Reader, Writer
from shmbuffer.cli.demo_loops import check_episode, make_episode
from shmbuffer.storage.segment import Segment
from tests.e2e.conftest import wait_for

LENGTH = 50
OBS = (4, 16, 16)


def _writers_and_learner(
    daemon, children, capacity: int, episodes: int, seconds: float, learn: str = "learn"
):
    d = daemon(capacity=capacity, unit="episode")
    learner = children.spawn("learner", learn, d.name, seconds)
    writers = [
        children.spawn(f"w{w}", "write_episodes", d.name, w, episodes, LENGTH, OBS)
        for w in range(2)
    ]
    out = children.collect({"learner", "w0", "w1"}, timeout=90)
    for proc in [learner, *writers]:
        assert children.join(proc, 10) == 0
    assert out["w0"] == out["w1"] == episodes
    stats = d.stats()
    assert stats["episodes_committed"] == 2 * episodes
    assert stats["rows_committed"] == 2 * episodes * LENGTH
    assert stats["reservations"] == 0
    assert stats["leases"] == 0
    assert out["learner"]["episodes_checked"] > 0
    assert out["learner"]["rows_checked"] > 0
    return stats


@pytest.mark.slow
def test_two_writers_one_learner(daemon, children):
    episodes = 120
    stats = _writers_and_learner(daemon, children, 2 * episodes * LENGTH, episodes, 3.0)
    assert stats["episodes"] == 2 * episodes  # nothing was evicted
    with Reader(stats["name"]) as reader, reader.sample_episodes(16) as eps:
        for ep in eps:
            check_episode(ep)


def test_small_ring_wraps_under_sampling(daemon, children):
    episodes = 100  # 200 episodes through a ring of 10: wraps ~20 times
    # a lapping writer waits for one still copying (regression: it got CapacityError); the
    # learner's row samples are lapped under it and redrawn, leased, so never given up on
    # (regression: TornReadError after 8 unleased redraws on a fast machine)
    stats = _writers_and_learner(daemon, children, 10 * LENGTH, episodes, 3.0)
    assert stats["episodes"] <= 10
    assert stats["rows"] <= 10 * LENGTH


def test_lapping_writer_waits_for_a_slow_one(daemon):
    # regression: Container.reserve raised CapacityError instead of deferring
    from shmbuffer.clients.connection import Connection

    d = daemon(capacity=4 * LENGTH, unit="episode")
    fast = Writer(d.name, timeout=5, reserve_timeout=10)
    slow = Connection(d.name, "writer", timeout=5)
    try:
        fast.add_episode(make_episode(0, 0, LENGTH, OBS))  # defines the schema
        fast.flush()
        held = slow.call("reserve", rows=LENGTH)  # rows 50..100: a writer still copying
        assert held["ranges"] == [[LENGTH, 2 * LENGTH]]
        fast.add_episode(make_episode(0, 1, LENGTH, OBS))
        fast.add_episode(make_episode(0, 2, LENGTH, OBS))
        fast.add_episode(make_episode(0, 3, LENGTH, OBS))  # rows 0..50: the ring wraps
        fast.flush()

        def commit_later() -> None:  # the slow writer finishes its copy a moment later
            time.sleep(0.5)
            slow.call("commit", reservation=held["reservation"])

        thread = threading.Thread(target=commit_later)
        thread.start()
        try:
            # the next episode needs rows 50..100: it should wait for the commit, not fail
            fast.add_episode(make_episode(0, 4, LENGTH, OBS))
            fast.flush()
        finally:
            thread.join(10)
        assert d.stats()["episodes_committed"] == 6
    finally:
        fast.close()
        slow.close()


def _phys_row(reader: Reader, view: torch.Tensor, key: tuple[str, ...] = ("obs",)) -> int:
    """The physical row a view starts at, asserting it points into the reader's mapping."""
    assert reader.segment is not None
    column = reader.segment.columns[key]
    base, row_bytes = column.data_ptr(), column.stride(0) * column.element_size()
    offset = view.data_ptr() - base
    assert 0 <= offset < reader.segment.capacity * row_bytes, "view is not in the segment"
    assert offset % row_bytes == 0
    return offset // row_bytes


def test_zero_copy_view_and_lease_hold_writers(daemon, children):
    d = daemon(capacity=4 * LENGTH, unit="episode")
    with Writer(d.name) as w:
        for e in range(4):
            w.add_episode(make_episode(0, e, LENGTH, OBS))
    reader = Reader(d.name)
    try:
        # lease one episode in the back half of the ring, so a writer (which wraps to row 0)
        # can commit two episodes before it reaches the leased rows
        for _ in range(100):
            cm = reader.sample_episodes(1)
            (ep,) = cm.__enter__()
            row = _phys_row(reader, ep["obs"])
            if row >= 2 * LENGTH:
                break
            cm.__exit__(None, None, None)
        else:
            pytest.fail("never sampled an episode in the back half of the ring")
        try:
            assert _phys_row(reader, ep["step"], ("step",)) == row
            check_episode(ep)
            # the view is the shared memory: a write through another mapping shows in it
            seg = Segment.attach(d.name, storage_dir=d.storage_dir)
            try:
                original = int(seg.columns[("obs",)][row, 0, 0, 0])
                seg.columns[("obs",)][row, 0, 0, 0] = (original + 1) % 256
                assert int(ep["obs"][0, 0, 0, 0]) == (original + 1) % 256
                seg.columns[("obs",)][row, 0, 0, 0] = original
            finally:
                seg.close()
            snapshot = ep.clone()
            before = d.stats()["episodes_committed"]
            assert before == 4

            proc = children.spawn("writer", "write_episodes", d.name, 9, 12, LENGTH, OBS)
            # the writer fills the two slots ahead of the lease, then waits for it
            wait_for(
                lambda: d.stats()["episodes_committed"] >= before + row // LENGTH,
                60,
                what="the writer to commit into unleased rows",
            )
            time.sleep(1.5)
            held = d.stats()["episodes_committed"]
            assert held == before + row // LENGTH, "a writer went past a leased episode"
            assert proc.is_alive()
            assert (ep == snapshot).all(), "a leased episode changed under its reader"
            check_episode(ep)
        finally:
            cm.__exit__(None, None, None)
        out = children.collect({"writer"}, timeout=60)
        assert out["writer"] == 12
        assert children.join(proc, 10) == 0
        stats = d.stats()
        assert stats["episodes_committed"] == before + 12
        assert stats["leases"] == 0
    finally:
        reader.close()


def test_killed_reader_lease_expires_after_ttl(daemon, children):
    ttl = 1.0
    d = daemon(capacity=4 * LENGTH, unit="episode", args=["--lease-ttl", str(ttl)])
    with Writer(d.name) as w:
        for e in range(4):
            w.add_episode(make_episode(0, e, LENGTH, OBS))
    # the child leases 64 draws out of 4 episodes: the one at row 0 among them for sure
    proc = children.spawn("reader", "lease_and_hang", d.name, 64)
    tag, msg, starts = children.get(timeout=60)
    if msg == "error":
        pytest.fail(f"reader failed:\n{starts}")
    assert (tag, msg) == ("reader", "leased")
    assert 0 in starts
    os.kill(proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    assert children.join(proc, 10) == -signal.SIGKILL

    with Writer(d.name, timeout=5, reserve_timeout=ttl + 10) as w:
        w.add_episode(make_episode(1, 0, LENGTH, OBS))  # needs rows 0..49: leased
        w.flush()
    waited = time.monotonic() - killed
    assert waited < ttl + 4.0, f"the writer waited {waited:.1f}s for a dead reader's lease"
    stats = d.stats()
    # released by its TTL, or earlier by the daemon noticing the dead pid (clients_reaped)
    released = stats["leases_expired"] + stats.get("clients_reaped", 0)
    assert released >= 1, "the lease was never released: it never blocked anything"
    assert stats["leases"] == 0
    assert stats["episodes_committed"] == 5
