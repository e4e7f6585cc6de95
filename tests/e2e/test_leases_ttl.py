"""Leased views and the lease TTL: a reader inside ``sample_episodes`` keeps
its lease past the TTL (renewed by its thread, or by its own heartbeat); a lease that lapses is
detected (``valid()``, an error building a view and at the block's exit) instead of the views
silently changing; one call of the largest documented size hands its views over at once.

Each test runs a real daemon with ``--lease-ttl 1`` and a ring the leased episodes fill, so a
writer can only proceed by overwriting them.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from shmbuffer import Reader, Writer
from shmbuffer.cli.demo_loops import check_episode, make_episode
from shmbuffer.errors import LeaseExpiredError, LimitExceededError, NotFoundError
from shmbuffer.wire.protocol import REQUESTS
from tests.e2e._watchdog import run_with_watchdog
from tests.e2e.conftest import wait_for

LENGTH = 10
OBS = (2, 3)
RING = 4  # episodes
TTL = 1.0


@pytest.fixture
def ring(daemon):
    """A daemon whose ring holds RING episodes, all written."""
    d = daemon(capacity=RING * LENGTH, unit="episode", args=["--lease-ttl", str(TTL)])
    with Writer(d.name, timeout=5) as w:
        for e in range(RING):
            w.add_episode(make_episode(0, e, LENGTH, OBS))
    return d


def lease_whole_ring(reader: Reader) -> Any:
    """Enter a ``sample_episodes`` block whose lease pins every episode of the ring."""
    for _ in range(20):
        block = reader.sample_episodes(32)
        episodes = block.__enter__()
        if len({int(ep["episode"][0]) for ep in episodes}) == RING:
            return block, episodes
        block.__exit__(None, None, None)
    pytest.fail("never leased the whole ring")


class BlockedWriter:
    """A writer thread whose episode can only be stored by evicting leased episodes."""

    def __init__(self, name: str) -> None:
        self.writer = Writer(name, timeout=5, reserve_timeout=20, batch_bytes=0)
        self.result: tuple[BaseException | None, float] | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        episode = make_episode(1, 0, LENGTH, OBS)
        self.result = run_with_watchdog(lambda: self.writer.add_episode(episode), 30)

    def done(self) -> bool:
        return self.result is not None

    def finish(self) -> None:
        self.thread.join(30)
        assert self.result is not None and self.result[0] is None, self.result
        self.writer.close()


def snapshot(episodes: Any) -> list[torch.Tensor]:
    return [ep["obs"].clone() for ep in episodes]


def test_open_block_keeps_its_lease_past_the_ttl(ring):
    """Before: with ``--lease-ttl 2`` a reader still in the block saw every row change."""
    reader = Reader(ring.name, timeout=5)  # auto_renew: every TTL/3
    block, episodes = lease_whole_ring(reader)
    before = snapshot(episodes)
    writer = BlockedWriter(ring.name)
    try:
        deadline = time.monotonic() + 3.5 * TTL
        while time.monotonic() < deadline:
            assert not writer.done(), "a writer overwrote leased rows while the block was open"
            time.sleep(0.1)
        for ep, obs in zip(episodes, before, strict=True):
            check_episode(ep)
            assert torch.equal(ep["obs"], obs)
        assert episodes.valid()
    finally:
        block.__exit__(None, None, None)  # no error: the lease held throughout
    writer.finish()  # and the writer goes on once the block exits
    assert not episodes.valid()
    reader.close()


def test_heartbeat_keeps_the_lease(ring):
    reader = Reader(ring.name, timeout=5, auto_renew=False)
    block, episodes = lease_whole_ring(reader)
    writer = BlockedWriter(ring.name)
    try:
        for _ in range(8):  # 3.2 TTLs
            time.sleep(TTL * 0.4)
            episodes.renew()
            assert episodes.valid() and not writer.done()
        for ep in episodes:
            check_episode(ep)
    finally:
        block.__exit__(None, None, None)
        writer.finish()
        reader.close()


def test_lapsed_lease_is_detected(ring):
    """Before: the views silently changed; the only signal was a NotFoundError at exit."""
    reader = Reader(ring.name, timeout=5, auto_renew=False)
    writer = None
    try:
        with (
            pytest.raises(LeaseExpiredError, match="may have changed") as info,
            reader.sample_episodes(32) as episodes,
        ):
            assert episodes.valid() and episodes.lease is not None
            first = episodes[0]
            check_episode(first)
            time.sleep(TTL * 1.2)
            assert not episodes.valid()  # stale, known without asking the daemon
            with pytest.raises(LeaseExpiredError, match="lapsed"):
                episodes[0]  # no new view of rows that may be overwritten
            writer = BlockedWriter(ring.name)
            wait_for(writer.done, 10, what="the writer, once the lease expired")
            with pytest.raises(LeaseExpiredError):
                episodes.renew()  # an expired lease never comes back
        assert isinstance(info.value, NotFoundError)  # what callers caught before
        assert ring.stats()["leases"] == 0
    finally:
        if writer is not None:
            writer.finish()
        reader.close()


def test_automatic_renewal_stops_at_max_lease_hold(ring):
    reader = Reader(ring.name, timeout=5, max_lease_hold=1.5 * TTL)
    try:
        with pytest.raises(LeaseExpiredError), reader.sample_episodes(8) as episodes:
            time.sleep(1.3 * TTL)
            assert episodes.valid()  # renewed every TTL/3 while within max_lease_hold
            wait_for(lambda: not episodes.valid(), 3 * TTL, what="the lease to lapse")
            wait_for(lambda: ring.stats()["leases"] == 0, 3 * TTL, what="the daemon to expire it")
    finally:
        reader.close()


def test_largest_call_hands_over_at_once(daemon):
    """Before: ``sample_episodes(2**20)`` spent 33 s building views, past the default TTL,
    and the lease had expired before the block began."""
    n = REQUESTS["sample"]["n"].hi
    assert n == 2**20  # the documented bound on one call
    d = daemon(capacity=100, unit="episode")
    with Writer(d.name, timeout=5) as w:
        for e in range(20):
            w.add_episode(make_episode(0, e, 2, OBS))
    reader = Reader(d.name, timeout=30)
    try:
        start = time.monotonic()
        with reader.sample_episodes(n) as episodes:
            took = time.monotonic() - start
            assert len(episodes) == n and episodes.valid()
            assert took < 10.0, f"sample_episodes({n}) took {took:.1f}s to hand over"
            check_episode(episodes[0])
            check_episode(episodes[-1])
            assert len(episodes[1000:1010]) == 10
        with pytest.raises(LimitExceededError, match="n=1,048,577"), reader.sample_episodes(n + 1):
            pass
        assert d.stats()["leases"] == 0
    finally:
        reader.close()
