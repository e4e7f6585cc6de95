"""Leases: episodes a reader is looking at in place, which no writer may overwrite meanwhile.

A lease pins a set of episode ids until it is released or its TTL runs out, so a learner that
dies cannot stall writers for longer than the TTL. A live reader keeps its lease by renewing it
(:meth:`LeaseTable.renew`: another TTL from now); an expired lease is gone for good, so a renewal
that comes too late fails and the reader learns that its views may have been overwritten. The
daemon asks :meth:`LeaseTable.pinned` before it lets a reservation evict episodes.

Across a daemon restart (``start --resume``): the table tells a :class:`LeaseLog` (the
journal) every grant and renewal, before the reply that hands the lease out or extends it, and
every release; expiry needs no record. Expiries are journaled as wall-clock time, so a resumed
daemon converts them to its own monotonic clock (:meth:`LeaseTable.restore`): a learner that
was reading views when the daemon died keeps its rows pinned until its TTL passes, whoever
reconnects meanwhile. A restored lease belongs to no connected client (owner
:data:`ORPHAN`); a client of the same process (pid and host) that renews or releases it by id
adopts it, and it is released with that client from then on. Today's Reader never does (its
old connection's renewal fails with ``unknown_client`` and it marks the lease lapsed), so
restored leases simply expire; adoption is there for a client that reconnects and keeps its
lease ids.

Not thread-safe: the daemon loop serialises calls.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from shmbuffer.errors import NotFoundError, OutOfSpaceError, PermissionDeniedError

log = logging.getLogger("shmbuffer.daemon")

#: The owner of a lease restored by ``--resume``: no client id is 0.
ORPHAN = 0
#: Who holds a lease across a restart: (pid, crc32 of the host name).
Holder = tuple[int, int]


def holder(pid: int, host: str) -> Holder:
    return int(pid), zlib.crc32(host.encode())


@dataclass
class Lease:
    id: int
    owner: int
    episode_ids: tuple[int, ...]
    expires: float
    #: The process that asked for it, when known (what a reconnected client is matched by).
    holder: Holder | None = None


class LeaseLog(Protocol):
    """Where the table tells its changes (the daemon's journal). Expiries are wall-clock
    microseconds."""

    def lease_granted(self, lease: Lease, expires_us: int) -> None: ...

    def lease_renewed(self, lease_id: int, expires_us: int) -> None: ...

    def lease_released(self, lease_id: int) -> None: ...


class LeaseTable:
    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._leases: dict[int, Lease] = {}
        self._pins: Counter[int] = Counter()  # episode id -> leases holding it
        self._next = 1
        #: Told every grant, renewal and release (None: nobody); see :class:`LeaseLog`.
        self.log: LeaseLog | None = None
        #: A client id's (pid, host) holder, for the log (None: unknown); cached per owner.
        self.holder_of: Callable[[int], Holder | None] | None = None
        self._holders: dict[int, Holder | None] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, owner: int, episode_ids: Iterable[int], now: float) -> Lease:
        lease = Lease(self._next, owner, tuple(episode_ids), now + self.ttl, self._holder(owner))
        if self.log is not None:  # first: a lease the journal cannot hold is never granted
            self.log.lease_granted(lease, _wall_us(lease.expires, now))
        self._next += 1
        self._leases[lease.id] = lease
        self._pins.update(set(lease.episode_ids))
        return lease

    def release(self, lease_id: int, owner: int | None = None) -> Lease:
        lease = self._drop(self._get(lease_id, owner))
        if self.log is not None:
            try:
                self.log.lease_released(lease_id)
            except (OSError, OutOfSpaceError) as exc:  # a resume keeps it until its TTL: safe
                log.warning("lease %d released but not journaled: %s", lease_id, exc)
        return lease

    def _drop(self, lease: Lease) -> Lease:
        del self._leases[lease.id]
        self._pins.subtract(set(lease.episode_ids))
        for episode_id in set(lease.episode_ids):
            if self._pins[episode_id] <= 0:
                del self._pins[episode_id]
        return lease

    def renew(self, lease_id: int, owner: int, now: float) -> Lease:
        """Extend a live lease to ``now + ttl``; O(1). An expired or released lease cannot come
        back: the rows it pinned may already have been overwritten. Journaled first: a
        renewal the journal cannot hold is refused (the reader's deadline must never outlast
        what a resumed daemon keeps)."""
        lease = self._get(lease_id, owner)
        expires = max(lease.expires, now + self.ttl)
        if self.log is not None and expires > lease.expires:
            self.log.lease_renewed(lease_id, _wall_us(expires, now))
        lease.expires = expires
        return lease

    def _get(self, lease_id: int, owner: int | None) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise NotFoundError(f"no lease {lease_id} (released, or expired after {self.ttl}s)")
        if owner is not None and lease.owner != owner and not self._adopts(lease, owner):
            raise PermissionDeniedError(f"lease {lease_id} belongs to another client")
        return lease

    def _adopts(self, lease: Lease, owner: int) -> bool:
        """A restored lease goes to a client of the process that held it."""
        if lease.owner != ORPHAN or lease.holder is None or self._holder(owner) != lease.holder:
            return False
        lease.owner = owner
        log.info("lease %d (restored) adopted by client %d", lease.id, owner)
        return True

    def _holder(self, owner: int) -> Holder | None:
        if self.holder_of is None or owner == ORPHAN:
            return None
        if owner not in self._holders:
            self._holders[owner] = self.holder_of(owner)
        return self._holders[owner]

    def pinned(self, episode_ids: Iterable[int]) -> list[int]:
        """The given episodes that some live lease holds."""
        return [i for i in episode_ids if i in self._pins]

    def expire(self, now: float) -> list[Lease]:
        """Drop leases whose TTL ran out; return them (no record: a resumed daemon drops
        them by their wall-clock expiry)."""
        dead = [lease for lease in self._leases.values() if lease.expires <= now]
        for lease in dead:
            self._drop(lease)
        return dead

    def release_owner(self, owner: int) -> list[Lease]:
        mine = [lease for lease in self._leases.values() if lease.owner == owner]
        for lease in mine:
            self.release(lease.id)
        self._holders.pop(owner, None)
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

    # -- across a restart ---------------------------------------------------------------------

    def to_state(self, now: float) -> dict[str, Any]:
        """The live leases for a snapshot, expiries as wall-clock microseconds (JSON-able)."""
        held = []
        for lease in self._leases.values():
            pid, host_crc = lease.holder or (0, 0)
            expires_us = _wall_us(lease.expires, now)
            held.append([lease.id, pid, host_crc, expires_us, list(lease.episode_ids)])
        return {"next": self._next, "held": held}

    def restore(self, state: dict[str, Any], now: float) -> list[Lease]:
        """Take over the leases a dead daemon held (:meth:`to_state`'s form, replayed by the
        journal) that have not expired by the wall clock, as :data:`ORPHAN`'s, each journaled
        again; ids go on after the saved ones. Returns them."""
        wall = time.time()
        restored = []
        for lease_id, pid, host_crc, expires_us, episode_ids in state.get("held", []):
            left = expires_us / 1e6 - wall
            if left <= 0 or lease_id in self._leases:
                continue
            who = (int(pid), int(host_crc)) if pid else None
            ids = tuple(int(i) for i in episode_ids)
            lease = Lease(int(lease_id), ORPHAN, ids, now + left, who)
            if self.log is not None:
                self.log.lease_granted(lease, int(expires_us))
            self._leases[lease.id] = lease
            self._pins.update(set(lease.episode_ids))
            restored.append(lease)
        held = [int(entry[0]) for entry in state.get("held", [])]
        self._next = max(self._next, int(state.get("next", 1)), max(held, default=0) + 1)
        return restored


def _wall_us(expires: float, now: float) -> int:
    """A monotonic expiry (``now`` is the same clock) as wall-clock microseconds."""
    return int((time.time() + expires - now) * 1e6)
