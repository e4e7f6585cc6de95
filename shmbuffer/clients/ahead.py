"""Reserving a streaming writer's next write ahead (protocol 1.3).

A writer that streams (its writes come back to back, less than ``commit_delay / 2`` apart)
hides the reserve's round trip: before it copies a write it sends the reserve of the next one
``ahead`` (same rows, same split), carrying the previous write's commit, so the daemon answers
while the copy runs and the next write finds its rows waiting. That reservation is an ordinary
one (evictions, journal, TTL, reaping, rate limiter and FIFO back-pressure all as for any
other), except that the daemon never parks it: one that would have to wait comes back as
reservation 0 and the write reserves as before. One that is not used is aborted with
``written=0`` (what it evicted is published again): when the next write differs in rows or
split or carries a priority, once the writer has been idle for ``commit_delay`` (its ticker),
and on flush and close; a flushed writer leaves the ring exactly as a writer without it would.

Its cost: rows reserved ahead are evicted one write early, so while a writer streams, readers
(and a checkpoint's cut) see the ring less its copy in progress *and* the rows reserved ahead.
A writer therefore reserves ahead only writes of at most 1/16 of the ring (:data:`AHEAD_SHARE`):
its write in progress and the one ahead then hide at most the 1/8 of the ring that one full
staged batch hides without reserving ahead. Larger writes (a staged batch of small rows fills
up to 1/8) reserve as before. And it reserves ahead only in a run of equal writes (this one of
the last one's rows and split): one that goes unused is aborted, which in a full ring costs the
daemon O(live episodes) to publish its evictions again (the daemon, for the same reason, grants
none that would evict from a registry of many episodes: see ``daemon/writes.py``); after one
such refusal the next :data:`AHEAD_BACKOFF` writes reserve as before instead of paying a wasted
message each.

Locking: :class:`ReserveAhead` holds no lock; its writer's lock serialises every call (the
commit ticker's too).
"""

from __future__ import annotations

import time
from typing import Any

from shmbuffer.clients.connection import Connection

__all__ = ["AHEAD_BACKOFF", "AHEAD_SHARE", "ReserveAhead", "Shape"]

#: A write reserves its successor ahead only if it is at most 1/AHEAD_SHARE of the ring: the
#: rows evicted early by a reservation ahead are missing from what readers and checkpoints see
#: while the writer streams (two writes of 1/8 each would hide a quarter of a small ring).
AHEAD_SHARE = 16
#: Writes that reserve as before after the daemon refused one ahead (a full FIFO ring, the rate
#: limiter, a large registry): what held it back rarely ends within a write or two.
AHEAD_BACKOFF = 32

#: A reservation's shape, as a reserve ahead must match the write that uses it: rows, and the
#: number of equal episodes or the lengths of unequal ones.
Shape = tuple[int, int | None, list[int] | None]


class ReserveAhead:
    """The one reserve a writer may have sent ahead of its next write, and when to send it.

    ``in_flight``: the writer's list of ``(seq, rows)`` requests whose replies it collects; an
    abort of an unused reservation joins it as ``(seq, None)``, so a flush waits for it too.
    """

    def __init__(
        self,
        conn: Connection,
        capacity: int,
        mode: str,
        commit_delay: float,
        in_flight: list[tuple[int, int | None]],
    ) -> None:
        self.conn = conn
        self.capacity = capacity
        self.mode = mode
        self.commit_delay = commit_delay
        self._in_flight = in_flight
        #: The reserve sent ahead: (seq, the shape it reserved, the rows of the commit it
        #: carries), until a write (or the ticker, or flush) takes its reply.
        self.pending: tuple[int, Shape, int] | None = None
        self._supported: bool | None = None  # the daemon speaks 1.3 (asked once)
        self._last_shape: Shape | None = None  # the last local write's
        #: Streaming writes left that do not reserve ahead (see :data:`AHEAD_BACKOFF`).
        self._skip = 0

    def wanted(self, shape: Shape, last_write: float, with_priority: bool = False) -> bool:
        """Whether to reserve ahead the write after this one of ``shape``: never for a write
        ``with_priority`` (its reserve carries the priority its commit publishes); else when
        this one repeats the last one's shape (a guess that misses costs an abort), it
        followed the last within ``commit_delay / 2`` (``last_write``: when that one
        finished, 0 after a flush), and the rows it would evict early are at most
        1/:data:`AHEAD_SHARE` of the ring. A circular buffer only: a fixed one would be
        refused rows it may never be asked for."""
        same, self._last_shape = shape == self._last_shape, shape
        if with_priority or not same or self.commit_delay <= 0 or self.mode == "fixed":
            return False
        if self.pending is not None:
            return False
        if shape[0] * AHEAD_SHARE > self.capacity:
            return False
        if not last_write or time.monotonic() - last_write >= self.commit_delay / 2:
            return False
        if self._skip:
            self._skip -= 1
            return False
        if self._supported is None:  # one ping per writer, on its first stream
            version = str(self.conn.call("ping").get("protocol", "0.0"))
            major, _, minor = version.partition(".")
            self._supported = (int(major), int(minor or 0)) >= (1, 3)
        return self._supported

    def send(self, shape: Shape, commit: tuple[int, int] | None) -> None:
        """Send the reserve of the next write (``shape``), carrying ``commit`` (the previous
        write's reservation and rows) if any, without waiting: the reply arrives while this
        write copies."""
        num_rows, episodes, lengths = shape
        fields: dict[str, Any] = {"rows": num_rows, "ahead": True}
        if lengths is not None:
            fields["lengths"] = lengths
        else:
            fields["episodes"] = episodes
        if commit is not None:
            fields["commit"] = commit[0]
        seq = self.conn.send("reserve", **fields)
        self.pending = (seq, shape, 0 if commit is None else commit[1])

    def take(self, shape: Shape | None) -> tuple[dict[str, Any] | None, int, int]:
        """``(reply, episodes, rows)``: the reply of the reserve sent ahead if it reserved
        ``shape`` (else None, and a granted reservation aborted), and what the commit it
        carried published. An error in the reply (its commit refused, say) is raised here,
        to the write that needed it."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None, 0, 0
        seq, reserved, commit_rows = pending
        header, _ = self.conn.wait(seq)  # never parked by the daemon: answered at once
        episodes = len(header.get("committed", ())) if commit_rows else 0
        if header["reservation"] == 0:  # the daemon would have had it wait: reserve anew
            self._skip = AHEAD_BACKOFF
            return None, episodes, commit_rows
        if reserved != shape:
            # written=0: what it evicted is published again and, if nothing was reserved
            # after it, the ring pointer goes back, as if it had never been asked for.
            abort = self.conn.send("abort", reservation=header["reservation"], written=0)
            self._in_flight.append((abort, None))
            return None, episodes, commit_rows
        return header, episodes, commit_rows

    def due_back(self, idle_only: bool, last_write: float) -> bool:
        """Whether to give the reservation back now: at once (flush, close), or (the ticker)
        once the writer has been idle for ``commit_delay`` and its reply has arrived."""
        if self.pending is None:
            return False
        if not idle_only:
            return True
        idle = time.monotonic() - last_write >= self.commit_delay
        return idle and self.conn.ready(self.pending[0])
