"""Which tables hold which episodes: the ring's record of a commit's tables, by episode id.

A write names the tables its episodes go into (``add_episode(ep, tables=["replay"])``; None:
every table). All the episodes of one commit go into the same tables, and a commit's ids are
consecutive, so the record is a list of runs ``[first, end)`` of ids with the keys of the
tables that hold them, one run per commit that left a table out; an id in no run is held by
every table. A table (:class:`~shmbuffer.ring.table.Table`) asks it when an episode it never
heard of, or forgot, comes back (an abort's restore, a load), and its writes' flow control asks
the reservation's.

The record outlives an eviction, because an aborted reservation can publish what it evicted
again: a run goes only once it lies wholly below both the oldest live id and every id an open
reservation evicted, and then only in bulk, once such dead runs outnumber the others (a
journal replay opens no reservation while it redoes a reserve, so a run a replayed abort
brings back must still be there: the bulk rule keeps the recent dead runs as ``ring/meta.py``
keeps the recent dead metadata). O(log runs) a lookup, O(1) amortised a commit.

Not thread-safe: the ring's owner serialises calls.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from typing import Any

#: The tables a write goes into, by key; None: every table.
Members = frozenset[str] | None

__all__ = ["Members", "Membership", "holds"]

#: Dead runs kept beyond the live ones before they are dropped together.
_SLACK = 64


def holds(members: Members, key: str) -> bool:
    """Whether the table ``key`` holds episodes written into ``members``."""
    return members is None or key in members


class Membership:
    """The runs of episode ids written into only some tables; see the module docstring."""

    def __init__(self) -> None:
        self._firsts: list[int] = []
        self._ends: list[int] = []
        self._members: list[frozenset[str]] = []

    def __len__(self) -> int:
        return len(self._firsts)

    def add(self, first: int, end: int, members: Members) -> None:
        """Ids ``[first, end)`` (above every id recorded) went into ``members`` only."""
        if members is None or end <= first:
            return
        if self._ends and first < self._ends[-1]:
            raise ValueError(f"episode ids from {first} are below those recorded")
        self._firsts.append(first)
        self._ends.append(end)
        self._members.append(members)

    def of(self, episode_id: int) -> Members:
        """The tables episode ``episode_id`` went into (None: every one)."""
        i = bisect.bisect_right(self._firsts, episode_id) - 1
        if i >= 0 and episode_id < self._ends[i]:
            return self._members[i]
        return None

    def any_leaves_out(self, key: str, ids: Iterable[int]) -> bool:
        """Whether the table ``key`` does not hold one of ``ids`` (ids in increasing order)."""
        if not self._firsts:
            return False
        return any(not holds(self.of(i), key) for i in ids)

    def forget_below(self, floor: int) -> None:
        """Drop the runs wholly below id ``floor`` (none of them can come back), once they
        outnumber the others by :data:`_SLACK`."""
        dead = bisect.bisect_right(self._ends, floor)
        if dead > len(self._firsts) - dead + _SLACK:
            del self._firsts[:dead], self._ends[:dead], self._members[:dead]

    def clear(self) -> None:
        self._firsts, self._ends, self._members = [], [], []

    def state(self, live: Sequence[int] | None = None) -> list[list[Any]]:
        """The runs as ``[first, end, [keys...]]`` (plain values), only those holding one of
        the ``live`` ids (increasing) when given."""
        out = []
        for first, end, members in zip(self._firsts, self._ends, self._members, strict=True):
            if live is not None:
                i = bisect.bisect_left(live, first)
                if i == len(live) or live[i] >= end:
                    continue
            out.append([first, end, sorted(members)])
        return out

    def load(self, state: Iterable[Sequence[Any]] | None) -> None:
        """Take the runs :meth:`state` saved (None: none); ValueError for runs out of order."""
        self.clear()
        for first, end, keys in state or ():
            if not isinstance(keys, list | tuple) or not all(isinstance(k, str) for k in keys):
                raise ValueError(f"saved table membership {keys!r} is not a list of names")
            self.add(int(first), int(end), frozenset(keys))
