"""LeaseTable: grant, release, pins, TTL expiry, per-owner release, ownership errors."""

from __future__ import annotations

import pytest

from shmbuffer.daemon.leases import LeaseTable
from shmbuffer.errors import NotFoundError, PermissionDeniedError


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
