"""Leases: episodes a reader is looking at in place, which no writer may overwrite meanwhile.

A lease pins a set of episode ids until it is released or its TTL runs out, so a learner that
dies cannot stall writers for longer than the TTL. A live reader keeps its lease by renewing it
(:meth:`LeaseTable.renew`: another TTL from now); an expired lease is gone for good, so a renewal
that comes too late fails and the reader learns that its views may have been overwritten. The
daemon asks :meth:`LeaseTable.pinned` before it lets a reservation evict episodes.

Not thread-safe: the daemon loop serialises calls.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from shmbuffer.errors import NotFoundError, PermissionDeniedError


@dataclass
class Lease:
    id: int
    owner: int
    episode_ids: tuple[int, ...]
    expires: float


class LeaseTable:
    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._leases: dict[int, Lease] = {}
        self._pins: Counter[int] = Counter()  # episode id -> leases holding it
        self._next = 1

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, owner: int, episode_ids: Iterable[int], now: float) -> Lease:
        lease = Lease(self._next, owner, tuple(episode_ids), now + self.ttl)
        self._next += 1
        self._leases[lease.id] = lease
        self._pins.update(set(lease.episode_ids))
        return lease

    def release(self, lease_id: int, owner: int | None = None) -> Lease:
        lease = self._get(lease_id, owner)
        del self._leases[lease_id]
        self._pins.subtract(set(lease.episode_ids))
        for episode_id in set(lease.episode_ids):
            if self._pins[episode_id] <= 0:
                del self._pins[episode_id]
        return lease

    def renew(self, lease_id: int, owner: int, now: float) -> Lease:
        """Extend a live lease to ``now + ttl``; O(1). An expired or released lease cannot come
        back: the rows it pinned may already have been overwritten."""
        lease = self._get(lease_id, owner)
        lease.expires = max(lease.expires, now + self.ttl)
        return lease

    def _get(self, lease_id: int, owner: int | None) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise NotFoundError(f"no lease {lease_id} (released, or expired after {self.ttl}s)")
        if owner is not None and lease.owner != owner:
            raise PermissionDeniedError(f"lease {lease_id} belongs to another client")
        return lease

    def pinned(self, episode_ids: Iterable[int]) -> list[int]:
        """The given episodes that some live lease holds."""
        return [i for i in episode_ids if i in self._pins]

    def expire(self, now: float) -> list[Lease]:
        """Drop leases whose TTL ran out; return them."""
        dead = [lease for lease in self._leases.values() if lease.expires <= now]
        for lease in dead:
            self.release(lease.id)
        return dead

    def release_owner(self, owner: int) -> list[Lease]:
        mine = [lease for lease in self._leases.values() if lease.owner == owner]
        for lease in mine:
            self.release(lease.id)
        return mine

    def owners(self) -> set[int]:
        """The clients that hold at least one lease."""
        return {lease.owner for lease in self._leases.values()}

    def count_owner(self, owner: int) -> int:
        return sum(1 for lease in self._leases.values() if lease.owner == owner)

    def count_by_owner(self) -> Counter[int]:
        """Leases held per client id, in one pass (for ``stats.clients``)."""
        return Counter(lease.owner for lease in self._leases.values())

    def next_expiry(self) -> float | None:
        return min((lease.expires for lease in self._leases.values()), default=None)
