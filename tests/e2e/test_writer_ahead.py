"""A streaming writer reserves its next write ahead (protocol 1.3): the reservation is ordinary
while held, never parked by the daemon, given back (``written=0``) when unused, and reaped with
a writer that dies holding it; only for writes of at most 1/16 of the ring in a run of equal
ones, and never where giving it back would rebuild a large registry."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest

from shmbuffer import Reader, Writer
from shmbuffer.cli.demo_loops import check_episode, make_episode
from shmbuffer.clients.ahead import AHEAD_BATCH
from shmbuffer.clients.connection import Connection
from shmbuffer.daemon.writes import AHEAD_MAX_LIVE
from tests.e2e.conftest import wait_for

LENGTH = 20  # rows of an episode (written alone: batch_bytes=0, except where staged)
OBS = (4, 8, 8)
RING = 16  # episodes: the smallest ring an episode of LENGTH rows is reserved ahead in


def _stream(writer: Writer, first: int, count: int, length: int = LENGTH) -> None:
    for e in range(first, first + count):
        writer.add_episode(make_episode(0, e, length, OBS))


def test_streaming_writer_holds_one_reservation_ahead_and_flush_gives_it_back(daemon):
    d = daemon(capacity=RING * LENGTH, unit="episode")
    # A long commit_delay: nothing is committed or given back by the ticker meanwhile.
    with Writer(d.name, commit_delay=30.0, batch_bytes=0) as w:
        _stream(w, 0, RING)  # back to back: every write after the second reserves one ahead
        # (the reserve ahead is not waited for: its reply may come after stats' own)
        stats = wait_for(lambda: (s := d.stats())["reservations"] == 2 and s, 10)
        # the last episode (copied, its commit waiting) and the next one's rows, reserved ahead
        assert stats["reservations"] == 2
        assert stats["reserved_rows"] == 2 * LENGTH
        # the ahead reservation evicted episode 0 (a full ring)
        assert stats["episodes"] == RING - 2
        w.flush()
        stats = d.stats()
        assert stats["reservations"] == 0
        # given back with written=0: episode 0 is published again, the pointer went back
        assert stats["episodes"] == RING and stats["rows"] == RING * LENGTH
        assert stats["pointer"] == 0
        assert w.episodes_committed == RING and w.rows_committed == RING * LENGTH
    with Reader(d.name) as reader, reader.sample_episodes(50) as eps:
        for ep in eps:  # episode 0 too, whose rows the reservation ahead had evicted
            check_episode(ep)


def test_the_write_after_a_flush_does_not_reserve_ahead(daemon):
    d = daemon(capacity=50 * LENGTH, unit="episode")
    with Writer(d.name, commit_delay=30.0, batch_bytes=0) as w:
        for e in range(5):  # a loop of write + flush never reserves ahead only to give it back
            _stream(w, e, 1)
            w.flush()
            assert d.stats()["reservations"] == 0
        _stream(w, 5, 1)
        assert d.stats()["reservations"] == 1  # its own rows only
        _stream(w, 6, 1)  # now a stream: the next writes' rows too, a batch of them (1.5)
        # 1/16 of the ring (1000 rows) holds 3 writes: a batch of 2 and the 1 left in hand
        # when the next batch is asked for
        assert w._pipe.ahead.batch(LENGTH) == 2
        wait_for(lambda: d.stats()["reservations"] == 1 + 2, 10, what="reservations ahead")


def test_a_write_of_more_than_a_sixteenth_of_the_ring_is_not_reserved_ahead(daemon):
    """Rows reserved ahead are evicted a write early: with writes of 1/8 of the ring, a
    reservation ahead would hide a quarter of it from readers and checkpoints (regression: a
    checkpoint under a lapping writer saved 150 of 200 episodes)."""
    d = daemon(capacity=8 * LENGTH, unit="episode")
    with Writer(d.name, commit_delay=30.0, batch_bytes=0) as w:
        _stream(w, 0, 16)  # twice round the ring, back to back
        time.sleep(0.3)  # a reserve ahead, had one been sent, is answered meanwhile
        stats = d.stats()
        assert stats["reservations"] == 1  # the last write's own, its commit waiting
        assert stats["episodes"] == 7  # the ring less that one write
        w.flush()
        assert d.stats()["episodes"] == 8


def test_writes_of_changing_sizes_are_not_reserved_ahead(daemon):
    """A guess that misses costs an abort (O(live episodes) in the daemon): a writer reserves
    ahead only in a run of equal writes."""
    d = daemon(capacity=200 * LENGTH, unit="episode")
    with Writer(d.name, commit_delay=30.0, batch_bytes=0) as w:
        for e in range(10):
            _stream(w, e, 1, length=LENGTH if e % 2 else LENGTH // 2)
            assert w._pipe.ahead.pending is None  # nothing sent ahead
        _stream(w, 10, 2)  # two equal writes in a row: the next one is reserved ahead
        assert w._pipe.ahead.holding
        w.flush()
        stats = d.stats()
        assert stats["episodes"] == 12 and stats["reservations"] == 0
        assert stats["pointer"] == stats["rows"]  # the unused one given back: no hole


def test_no_reservation_ahead_that_would_rebuild_a_large_registry(daemon):
    """Giving back an unused reservation ahead that evicted episodes may rebuild the registry
    (O(live episodes)): above AHEAD_MAX_LIVE live ones, the daemon answers such a reserve
    with reservation 0; a reserve without ``ahead`` is granted as before, and so is one ahead
    that evicts nothing."""
    length, live = 2, AHEAD_MAX_LIVE + 1
    d = daemon(capacity=2 * length * live, unit="episode")
    conn = Connection(d.name, "writer", timeout=10)

    def fill() -> None:  # ``live`` episodes in one reservation (their bytes do not matter)
        reply = conn.call("reserve", rows=length * live, episodes=live)
        conn.call("commit", reservation=reply["reservation"])

    try:
        conn.call("define_schema", schema={"obs": {"dtype": "float32", "shape": [2]}})
        fill()
        reply = conn.call("reserve", rows=length, ahead=True)  # evicts nothing: granted
        assert reply["reservation"] > 0
        conn.call("abort", reservation=reply["reservation"], written=0)
        fill()
        assert d.stats()["episodes"] == 2 * live  # a full ring
        reply = conn.call("reserve", rows=length, ahead=True)
        assert (reply["reservation"], reply["ranges"]) == (0, [])
        reply = conn.call("reserve", rows=length)
        assert reply["reservation"] > 0
        conn.call("abort", reservation=reply["reservation"], written=0)
        stats = d.stats()
        assert stats["episodes"] == 2 * live and stats["reservations"] == 0
        assert stats["errors"] == 0
    finally:
        conn.close()


def test_idle_writer_returns_its_reservation_ahead(daemon):
    d = daemon(capacity=RING * LENGTH, unit="episode")
    with Writer(d.name, commit_delay=0.05, batch_bytes=0) as w:
        _stream(w, 0, 4)
        # the ticker commits the last episode and gives back the unused reservation
        wait_for(lambda: d.stats()["reservations"] == 0, 10, what="the reservation back")
        stats = d.stats()
        assert stats["episodes"] == 4 and stats["episodes_committed"] == 4
        assert stats["pointer"] == 4 * LENGTH  # as if it had never been asked for
        _stream(w, 4, 3)  # streams again after the pause
        w.flush()
        assert d.stats()["episodes"] == 7


def test_a_stream_that_pauses_and_resumes_commits_everything(daemon):
    """Gaps around commit_delay / 2: some writes take rows reserved ahead without sending the
    next reserve ahead; the previous write's commit must still go (regression: it was lost,
    its reservation left open)."""
    d = daemon(capacity=100 * LENGTH, unit="episode")
    with Writer(d.name, commit_delay=0.02, batch_bytes=0) as w:
        for e in range(30):
            _stream(w, e, 1)
            time.sleep(0.015 if e % 3 == 2 else 0.0)  # >= commit_delay / 2: the stream breaks
        w.flush()
        assert w.episodes_committed == 30
    stats = d.stats()
    assert stats["reservations"] == 0
    assert stats["episodes"] == 30 and stats["episodes_committed"] == 30


def test_a_write_of_another_shape_aborts_the_reservation_ahead(daemon):
    d = daemon(capacity=40 * LENGTH, unit="episode")
    with Writer(d.name, commit_delay=30.0, batch_bytes=0) as w:
        _stream(w, 0, 3)
        _stream(w, 3, 1, length=LENGTH // 2)  # not the shape reserved ahead
        _stream(w, 4, 2, length=LENGTH // 2)
        w.flush()
        stats = d.stats()
        assert stats["reservations"] == 0
        assert stats["episodes"] == 6 and stats["rows"] == 3 * LENGTH + 3 * (LENGTH // 2)
        # the aborted one was given back before the next reserve: no hole in the ring
        assert stats["pointer"] == stats["rows"]
    with Reader(d.name) as reader, reader.sample_episodes(30) as eps:
        for ep in eps:
            check_episode(ep)


def _count_ops(writer: Writer) -> dict[str, int]:
    """Count the requests ``writer`` sends, by op (its real connection, wrapped)."""
    sent: dict[str, int] = {}
    send = writer.conn.send

    def counting(op: str, *args: Any, **fields: Any) -> int:
        sent[op] = sent.get(op, 0) + 1
        return send(op, *args, **fields)

    writer.conn.send = counting  # type: ignore[method-assign]
    return sent


def test_a_stream_reserves_ahead_in_batches_and_commits_on_the_next_batch(daemon):
    """Protocol 1.5: one reserve ahead asks for AHEAD_BATCH writes and carries the commits of
    the writes before it, so a stream of equal writes sends one message per batch."""
    d = daemon(capacity=80 * LENGTH, unit="episode")  # 1/16 of it: a batch of 4 and 1 in hand
    with Writer(d.name, commit_delay=30.0, batch_bytes=0) as w:
        sent = _count_ops(w)
        _stream(w, 0, 34)
        assert w._pipe.ahead.batch(LENGTH) == AHEAD_BATCH == 4
        # the first two reserve as before, the second also sending the first batch ahead
        # (writes 2-5); then one reserve per batch of 4 (6-9, ..., 34-37), each sent as the
        # batch before it has one left (writes 4, 8, ..., 32), carrying the commits before
        assert (sent["reserve"], sent.get("commit", 0)) == (2 + 9, 0)
        # open: the last two writes' own (their commits waiting) and the batch ahead
        stats = wait_for(lambda: (s := d.stats())["reservations"] == 2 + 4 and s, 10)
        assert stats["episodes_committed"] == 32
        w.flush()
        stats = d.stats()
        assert stats["reservations"] == 0 and stats["episodes_committed"] == 34
        # the unused batch given back, the newest first: the pointer went back over all of it
        assert stats["pointer"] == 34 * LENGTH == stats["rows"]
        assert w.episodes_committed == 34 and w.rows_committed == 34 * LENGTH
    with Reader(d.name) as reader, reader.sample_episodes(100) as eps:
        for ep in eps:
            check_episode(ep)


def test_a_daemon_before_1_5_gets_one_reservation_ahead_at_a_time(daemon):
    d = daemon(capacity=64 * LENGTH, unit="episode")
    with Writer(d.name, commit_delay=30.0, batch_bytes=0) as w:
        w._pipe.ahead._version = (1, 4)  # as if its ping had answered 1.4: no count, no commits
        sent = _count_ops(w)
        _stream(w, 0, 10)
        # one per write (and the first write's own), each carrying one commit
        assert (sent["reserve"], sent.get("commit", 0)) == (10 + 1, 0)
        w.flush()
        assert d.stats()["episodes_committed"] == 10 and d.stats()["reservations"] == 0


def test_an_idle_writer_gives_back_the_rest_of_its_batch(daemon):
    d = daemon(capacity=64 * LENGTH, unit="episode")
    with Writer(d.name, commit_delay=0.1, batch_bytes=0) as w:
        _stream(w, 0, 4)  # writes 3 and 4 took rows of a batch of 3; a second one asked for
        wait_for(lambda: d.stats()["reservations"] == 0, 10, what="the batch back")
        stats = d.stats()
        assert stats["episodes_committed"] == 4 and stats["pointer"] == 4 * LENGTH
        assert not w._pipe.ahead.holding


def test_ahead_reserve_is_never_parked(daemon):
    """A reserve that would wait (rows leased by a reader) is answered at once with
    reservation 0 when sent ahead; without ``ahead`` it is parked as before."""
    d = daemon(capacity=2 * LENGTH, unit="episode")
    with Writer(d.name) as w:
        _stream(w, 0, 2)
    reader = Reader(d.name)
    conn = Connection(d.name, "writer", timeout=5)
    try:
        with reader.sample_episodes(50):  # both episodes leased: any reserve must wait
            t0 = time.monotonic()
            reply = conn.call("reserve", rows=LENGTH, ahead=True)
            assert (reply["reservation"], reply["ranges"]) == (0, [])
            assert time.monotonic() - t0 < 2.0
            seq = conn.send("reserve", rows=LENGTH, timeout_ms=60_000)
            wait_for(lambda: d.stats()["rate_limiter"]["inserts_waiting"] == 1, 10)
            assert not conn.ready(seq)
        header, _ = conn.wait(seq, timeout=10)  # the lease ended: granted
        assert header["reservation"] > 0
        conn.call("abort", reservation=header["reservation"], written=0)
        assert d.stats()["errors"] == 0
    finally:
        conn.close()
        reader.close()


def test_fifo_back_pressure_holds_the_reservation_ahead_like_any_other(daemon):
    d = daemon(
        capacity=RING * LENGTH,
        unit="episode",
        args=["--sampler", "fifo", "--max-times-sampled", "1"],
    )
    with Writer(d.name, commit_delay=30.0, reserve_timeout=20, batch_bytes=0) as w:
        _stream(w, 0, RING)  # the ring is full of unconsumed rows: the next may not be reserved
        time.sleep(0.3)  # the reserve ahead is answered (not granted) meanwhile
        stats = d.stats()
        assert stats["reservations"] == 1  # the last one's own; the ahead one was refused
        assert stats["rate_limiter"]["inserts_waiting"] == 0  # and not parked
        w.flush()  # does not wait for readers: nothing of the flushed data needs them
        stats = d.stats()
        assert stats["episodes"] == RING and stats["reservations"] == 0 and stats["errors"] == 0
        with Reader(d.name) as reader, reader.sample_episodes(2) as eps:
            assert len(eps) == 2  # consumed: room for two more
        _stream(w, RING, 2)
        assert w._pipe.ahead.pending is None  # refused once: the next writes do not ask (backoff)
        w.flush()
        assert d.stats()["episodes_committed"] == RING + 2


_HOLDER = textwrap.dedent(
    """
    import sys, time
    from shmbuffer import Writer
    from shmbuffer.cli.demo_loops import make_episode
    w = Writer(sys.argv[1], commit_delay=3600.0, batch_bytes=0)
    for e in range(3):
        w.add_episode(make_episode(1, e, int(sys.argv[2]), (4, 8, 8)))
    print("ready", flush=True)
    time.sleep(3600)
    """
)


def test_writer_killed_holding_a_reservation_ahead_is_reaped(daemon, e2e_env):
    d = daemon(capacity=RING * LENGTH, unit="episode")
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, d.name, str(LENGTH)],
        env=e2e_env.environ,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        # its third episode and the fourth's, ahead
        wait_for(lambda: d.stats()["reservations"] == 2, 10, what="a reservation ahead")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        # the daemon finds the dead pid and aborts both, like any reservation of a dead writer
        wait_for(lambda: d.stats()["reservations"] == 0, 30, what="the dead writer reaped")
        assert d.stats()["clients_reaped"] == 1
        with Writer(d.name, reserve_timeout=10) as w:
            _stream(w, 0, 2 * RING)  # twice round the ring: nothing of the dead writer's holds it
        stats = d.stats()
        assert stats["episodes"] == RING and stats["reservations"] == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.parametrize("unit", ["transition", "episode"])
def test_small_rows_stream_through_reservations_ahead(daemon, unit: str) -> None:
    """Staged small writes: every batch of the same size is reserved ahead; what is read back
    is every row written, in order."""
    capacity = 4000
    d = daemon(capacity=capacity, unit=unit)
    import numpy as np

    with Writer(d.name, batch_bytes=4096, commit_delay=30.0) as w:
        for e in range(100):
            steps = np.arange(e * 10, e * 10 + 10, dtype=np.int64)
            w.extend({"step": steps, "x": np.ones((10, 3), np.float32) * e})
        w.flush()
        assert w.rows_committed == 1000
    stats: dict[str, Any] = d.stats()
    assert stats["rows"] == 1000 and stats["reservations"] == 0
    with Reader(d.name) as reader:
        batch = reader.sample(256)
        steps = np.asarray(batch["step"])
        xs = np.asarray(batch["x"])
        assert np.array_equal(xs[:, 0], steps // 10)  # each row is the one written there
