"""LeaseTable: grant, release, pins, TTL expiry, per-owner release, ownership errors, and what
it keeps across a daemon restart (its log, restored leases, adoption)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from shmbuffer.daemon.leases import ORPHAN, Lease, LeaseTable, holder
from shmbuffer.errors import NotFoundError, OutOfSpaceError, PermissionDeniedError


def test_grant_and_pinned() -> None:
    table = LeaseTable(ttl=10.0)
    a = table.grant(owner=1, episode_ids=[3, 4, 4], now=5.0)
    b = table.grant(owner=2, episode_ids=[4, 7], now=6.0)
    assert (a.id, b.id) == (1, 2)
    assert a.episode_ids == (3, 4, 4) and a.expires == 15.0 and a.owner == 1
    assert len(table) == 2
    assert table.pinned([1, 3, 4, 7, 8]) == [3, 4, 7]
    assert table.pinned(iter([9])) == []
    assert table.count_owner(1) == 1 and table.count_owner(3) == 0
    assert table.next_expiry() == 15.0


def test_release_unpins_only_when_no_other_lease_holds() -> None:
    table = LeaseTable(ttl=10.0)
    a = table.grant(1, [3, 4, 4], 0.0)  # a duplicate id pins once
    b = table.grant(2, [4], 0.0)
    assert table.release(a.id, owner=1) is a
    assert table.pinned([3, 4]) == [4]
    table.release(b.id)
    assert table.pinned([3, 4]) == []
    assert len(table) == 0 and table.next_expiry() is None


def test_release_errors() -> None:
    table = LeaseTable(ttl=1.0)
    lease = table.grant(1, [0], 0.0)
    with pytest.raises(PermissionDeniedError):
        table.release(lease.id, owner=2)
    assert table.pinned([0]) == [0]  # unchanged
    with pytest.raises(NotFoundError):
        table.release(99)
    table.release(lease.id, owner=1)
    with pytest.raises(NotFoundError):
        table.release(lease.id, owner=1)


def test_expire() -> None:
    table = LeaseTable(ttl=5.0)
    a = table.grant(1, [0], 0.0)
    b = table.grant(1, [1], 2.0)
    assert table.expire(4.999) == []
    assert table.expire(5.0) == [a]  # expiry is inclusive
    assert table.pinned([0, 1]) == [1]
    assert table.expire(100.0) == [b]
    assert len(table) == 0
    with pytest.raises(NotFoundError):
        table.release(a.id)


def test_release_owner() -> None:
    table = LeaseTable(ttl=5.0)
    mine = [table.grant(1, [i], 0.0) for i in range(3)]
    other = table.grant(2, [1], 0.0)
    assert table.release_owner(1) == mine
    assert table.release_owner(1) == []
    assert len(table) == 1
    assert table.pinned([0, 1, 2]) == [1]
    assert table.release(other.id, owner=2) is other


def test_ids_never_reused() -> None:
    table = LeaseTable(ttl=5.0)
    first = table.grant(1, [0], 0.0)
    table.release(first.id)
    assert table.grant(1, [0], 0.0).id == first.id + 1


def test_renew_extends_from_now_and_never_shortens() -> None:
    table = LeaseTable(ttl=5.0)
    lease = table.grant(1, [0], now=0.0)
    assert table.renew(lease.id, owner=1, now=4.0) is lease
    assert lease.expires == 9.0 and table.next_expiry() == 9.0
    assert table.expire(8.9) == []  # the renewal kept it past its first TTL
    table.renew(lease.id, owner=1, now=1.0)  # a late-arriving older heartbeat
    assert lease.expires == 9.0
    assert table.expire(9.0) == [lease]


def test_renew_errors_and_no_resurrection() -> None:
    table = LeaseTable(ttl=1.0)
    lease = table.grant(1, [0], 0.0)
    with pytest.raises(PermissionDeniedError):
        table.renew(lease.id, owner=2, now=0.5)
    assert lease.expires == 1.0  # unchanged by the refused renewal
    table.expire(1.0)
    # an expired lease stays gone: its rows may already have been handed to a writer
    with pytest.raises(NotFoundError, match="expired"):
        table.renew(lease.id, owner=1, now=1.1)
    assert table.pinned([0]) == []
    with pytest.raises(NotFoundError):
        table.renew(42, owner=1, now=0.0)


# -- across a daemon restart: the journal hears every change but expiry ------------------------


class RecordingLog:
    """A LeaseLog that keeps what it was told, or refuses (a full journal)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.full = False

    def _take(self, *call: Any) -> None:
        if self.full:
            raise OutOfSpaceError("journal full")
        self.calls.append(call)

    def lease_granted(self, lease: Lease, expires_us: int) -> None:
        self._take("grant", lease.id, lease.holder, expires_us)

    def lease_renewed(self, lease_id: int, expires_us: int) -> None:
        self._take("renew", lease_id, expires_us)

    def lease_released(self, lease_id: int) -> None:
        self._take("release", lease_id)


def test_the_log_hears_grants_renewals_releases_not_expiries() -> None:
    table = LeaseTable(ttl=10.0)
    table.log = log = RecordingLog()
    table.holder_of = {1: holder(100, "h"), 2: holder(200, "h")}.get
    now = time.monotonic()
    a = table.grant(1, [3], now)
    b = table.grant(2, [4], now)
    table.renew(a.id, 1, now + 5)
    table.renew(a.id, 1, now)  # extends nothing: no record
    table.release(b.id, 2)
    table.grant(1, [5], now)
    table.expire(now + 100)
    kinds = [(call[0], call[1]) for call in log.calls]
    assert kinds == [("grant", 1), ("grant", 2), ("renew", 1), ("release", 2), ("grant", 3)]
    assert log.calls[0][2] == holder(100, "h")
    wall = time.time()
    assert abs(log.calls[0][3] / 1e6 - (wall + 10)) < 2  # wall-clock microseconds
    assert abs(log.calls[2][2] / 1e6 - (wall + 10)) < 2  # "now + 5" is the present


def test_what_the_log_refuses_is_not_done() -> None:
    table = LeaseTable(ttl=10.0)
    table.log = log = RecordingLog()
    lease = table.grant(1, [3], 0.0)
    log.full = True
    with pytest.raises(OutOfSpaceError):
        table.renew(lease.id, 1, 5.0)  # a reader's deadline must not outlast the journal's
    assert lease.expires == 10.0
    with pytest.raises(OutOfSpaceError):
        table.grant(1, [4], 0.0)
    assert table.pinned([4]) == [] and len(table) == 1
    table.release(lease.id, 1)  # a release not journaled only pins longer after a resume
    assert len(table) == 0
    log.full = False
    assert table.grant(1, [4], 0.0).id == lease.id + 1


def test_restored_leases_are_orphans_their_process_may_adopt() -> None:
    old = LeaseTable(ttl=30.0)
    old.holder_of = {7: holder(100, "h"), 8: holder(200, "h")}.get
    now = time.monotonic()
    mine = old.grant(7, [1, 2], now)
    other = old.grant(8, [3], now)
    state = old.to_state(now)

    table = LeaseTable(ttl=30.0)  # the resumed daemon: new client ids from 1 again
    table.holder_of = {1: holder(100, "h"), 2: holder(300, "h"), 3: holder(100, "g")}.get
    restored = table.restore(state, now=5.0)
    assert [lease.owner for lease in restored] == [ORPHAN, ORPHAN]
    assert table.pinned([1, 2, 3]) == [1, 2, 3]
    assert table.release_owner(1) == []  # a new client 1 does not own what old client 1 did
    assert table.count_owner(1) == 0 and len(table) == 2
    with pytest.raises(PermissionDeniedError):
        table.renew(mine.id, owner=2, now=6.0)  # another process
    with pytest.raises(PermissionDeniedError):
        table.renew(mine.id, owner=3, now=6.0)  # the same pid on another host
    assert table.renew(mine.id, owner=1, now=6.0).owner == 1  # its process: adopted
    assert table.release_owner(1) == [restored[0]]  # and gone with that client
    assert table.pinned([1, 2, 3]) == [3]
    assert table.grant(2, [9], 6.0).id == other.id + 1


def test_restore_converts_wall_clock_expiries_and_drops_expired_ones() -> None:
    table = LeaseTable(ttl=1.0)
    wall_us = int(time.time() * 1e6)
    state = {
        "next": 9,
        "held": [
            [3, 100, 1, wall_us + 20_000_000, [1]],  # 20 s left
            [4, 100, 1, wall_us - 1_000_000, [2]],  # expired a second ago
        ],
    }
    restored = table.restore(state, now=500.0)
    assert [lease.id for lease in restored] == [3]
    assert 519.0 < restored[0].expires <= 520.5
    assert table.expire(519.0) == [] and table.pinned([1, 2]) == [1]
    assert table.grant(1, [5], 500.0).id == 9
