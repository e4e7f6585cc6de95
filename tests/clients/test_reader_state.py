"""The Reader's state machine against a fake daemon (tests/clients/fakeconn.py): sampling
ahead (clients/readerstate.py) and renewing the lease of an open ``sample_episodes`` block
(clients/episode_reads.py, clients/leased.py). The end-to-end tests of the same promises,
against a real daemon, are tests/e2e/test_reader_prefetch.py and test_leases_ttl.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from shmbuffer.clients.reader import Reader
from shmbuffer.errors import LeaseExpiredError
from tests.clients.conftest import MakeDaemon
from tests.clients.fakeconn import FakeDaemon


def steps(batch: Any) -> list[int]:
    return [int(v) for v in batch["step"]]


def until(predicate: Callable[[], bool], seconds: float = 5.0) -> bool:
    """Poll ``predicate`` every 5 ms for at most ``seconds``: how a test waits for a thread."""
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def samples(daemon: FakeDaemon) -> list[int]:
    return [int(f["n"]) for f in daemon.ops("sample")]


# -- prefetch -----------------------------------------------------------------------------------


def test_the_next_sample_is_requested_while_the_caller_works(fake: MakeDaemon) -> None:
    daemon = fake()
    daemon.fill(100)
    with Reader("fake", prefetch=True) as reader:
        assert steps(reader.sample(4)) == [0, 1, 2, 3]
        assert samples(daemon) == [4, 4]  # this one, and the next one sent before returning
        assert steps(reader.sample(4)) == [4, 5, 6, 7]  # the one sent ahead
        assert samples(daemon) == [4, 4, 4]
        # A call that asks something else drops what was fetched and asks anew.
        assert steps(reader.sample(2)) == [12, 13]
        assert samples(daemon) == [4, 4, 4, 2, 2]


def test_k_batches_are_drawn_by_one_request(fake: MakeDaemon) -> None:
    daemon = fake()
    daemon.fill(100)
    with Reader("fake", prefetch=3) as reader:
        got = [steps(reader.sample(2)) for _ in range(3)]
        assert got == [[0, 1], [2, 3], [4, 5]]
        assert samples(daemon) == [6, 6]  # the first three, and the next three ahead
        assert steps(reader.sample(2)) == [6, 7]
        assert samples(daemon) == [6, 6, 6]


def test_a_group_over_a_single_batch_limit_is_not_requested(fake: MakeDaemon) -> None:
    # The reply of one request holds at most max_payload_bytes / 16 rows (an index and a
    # stamp each): 100 here.
    daemon = fake(extra={"max_payload_bytes": 16 * 100})
    daemon.fill(200)
    with Reader("fake", prefetch=3) as reader:
        reader.sample(30)  # 3 x 30 rows fit one reply
        reader.sample(40)  # 3 x 40 would not: one batch a request
        reader.sample(40)
        assert samples(daemon) == [90, 90, 40, 40, 40]
        assert max(samples(daemon)) <= 100


def test_a_consuming_sampler_is_never_prefetched(fake: MakeDaemon) -> None:
    daemon = fake(sampler="fifo", consumes=True)
    daemon.fill(100)
    with Reader("fake", prefetch=4) as reader:
        assert reader.prefetch == 0
        for _ in range(3):
            reader.sample(4)
        assert samples(daemon) == [4, 4, 4]  # one request a call, none ahead
        # Leased until the copy is checked, then released without waiting.
        assert all(f.get("lease") for f in daemon.ops("sample"))
        assert len(daemon.ops("release")) == 3


# -- lease renewal ------------------------------------------------------------------------------


def renewals(daemon: FakeDaemon) -> int:
    return len(daemon.ops("renew"))


def test_an_open_block_renews_its_lease_until_it_exits(fake: MakeDaemon) -> None:
    daemon = fake(unit="episode", lease_ttl=0.06)  # a renewal every 20 ms
    daemon.fill(40, length=4)
    with Reader("fake", prefetch=False) as reader:
        with reader.sample_episodes(3) as episodes:
            assert until(lambda: renewals(daemon) >= 3)
            assert episodes.valid()
            assert {f["lease"] for f in daemon.ops("renew")} == {episodes.lease}
            assert np.array_equal(episodes[1]["step"].numpy(), np.arange(4, 8))
        assert daemon.ops("release") == [{"lease": episodes.lease}]
        assert not episodes.valid()  # released: its views are no longer protected
        seen = renewals(daemon)
        time.sleep(0.08)  # four renewer ticks
        assert renewals(daemon) == seen


def test_renewal_stops_after_max_lease_hold(fake: MakeDaemon) -> None:
    daemon = fake(unit="episode", lease_ttl=0.3)  # a renewal every 100 ms
    daemon.fill(40, length=4)
    with (
        Reader("fake", prefetch=False, max_lease_hold=0.25) as reader,
        reader.sample_episodes(2) as episodes,
    ):
        # Renewed while it may be held; then left to lapse one TTL after its last renewal.
        assert until(lambda: not episodes.valid())
        seen = renewals(daemon)
        time.sleep(0.15)
        assert renewals(daemon) == seen
        assert 1 <= seen <= 2  # the ticks within the 250 ms it may be held
        with pytest.raises(LeaseExpiredError):
            episodes[0]


def test_a_renewal_that_finds_the_lease_gone_makes_it_invalid(fake: MakeDaemon) -> None:
    # Renewed every 20 ms, each renewal good for a minute: only the daemon's word ends it.
    daemon = fake(unit="episode", lease_ttl=0.06, renew_ttl=60.0)
    daemon.fill(40, length=4)
    with Reader("fake", prefetch=False) as reader:
        # The block's exit says its views may be torn.
        with pytest.raises(LeaseExpiredError), reader.sample_episodes(2) as episodes:
            assert until(lambda: renewals(daemon) >= 1)
            tried = renewals(daemon)
            with daemon.lock:  # the daemon expired it
                daemon.leases.pop(episodes.lease or 0)
            assert episodes.valid()
            assert until(lambda: renewals(daemon) > tried)  # the renewal that found it gone
            assert until(lambda: not episodes.valid(), seconds=1.0)
            with pytest.raises(LeaseExpiredError):
                episodes[0]
        seen = renewals(daemon)
        time.sleep(0.08)
        assert renewals(daemon) == seen  # a lapsed lease is not renewed again


def test_no_renewer_without_auto_renew(fake: MakeDaemon) -> None:
    daemon = fake(unit="episode", lease_ttl=0.06)
    daemon.fill(40, length=4)
    with (
        Reader("fake", prefetch=False, auto_renew=False) as reader,
        reader.sample_episodes(2) as episodes,
    ):
        assert until(lambda: not episodes.valid())  # one TTL, and nothing renewed it
        assert renewals(daemon) == 0
        episodes.renew()  # the explicit heartbeat still works
        assert renewals(daemon) == 1 and episodes.valid()
