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

Since protocol 1.5 one such reserve asks for the next :data:`AHEAD_BATCH` writes at once
(``count``): the daemon grants them one after another, as separate ordinary reservations, and
the writer fills them one per write, sending the next batch's reserve when one of them is left
(its reply then has two copies' time to come back, not one); that send carries the commits of
the writes before it (``commits``). A stream of equal writes then costs one message and one
reply per batch instead of per write (a writer of image episodes spent a tenth of its time or more
sending and taking reserves, most where a round trip is slow: ``docs/architecture.md``). Commits
wait at most a batch and a write, or ``commit_delay`` (the writer's ticker).

Its cost: rows reserved ahead are evicted before their writes come, so while a writer streams,
readers (and a checkpoint's cut) see the ring less its copy in progress *and* the rows reserved
ahead. A writer therefore reserves ahead at most 1/16 of the ring at once (:data:`AHEAD_SHARE`;
a batch is as many writes as fit in that): its write in progress and those ahead then hide at
most the 1/8 of the ring that one full staged batch hides without reserving ahead. Larger writes
(a staged batch of small rows fills up to 1/8) reserve as before. And it reserves ahead only in
a run of equal writes (this one of the last one's rows and split): one that goes unused is
aborted, which in a full ring costs the daemon O(live episodes) to publish its evictions again
(the daemon, for the same reason, grants none that would evict from a registry of many
episodes: see ``daemon/writes.py``); after one such refusal the next :data:`AHEAD_BACKOFF`
writes reserve as before instead of paying a wasted message each.

Locking: :class:`ReserveAhead` holds no lock; its writer's lock serialises every call (the
commit ticker's too).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from shmbuffer.clients.connection import Connection

__all__ = ["AHEAD_BACKOFF", "AHEAD_BATCH", "AHEAD_SHARE", "ReserveAhead", "Shape", "Written"]

#: A write reserves its successor ahead only if it is at most 1/AHEAD_SHARE of the ring: the
#: rows evicted early by a reservation ahead are missing from what readers and checkpoints see
#: while the writer streams (two writes of 1/8 each would hide a quarter of a small ring).
AHEAD_SHARE = 16
#: Writes that reserve as before after the daemon refused one ahead (a full FIFO ring, the rate
#: limiter, a large registry): what held it back rarely ends within a write or two.
AHEAD_BACKOFF = 32
#: Most writes one reserve ahead asks for (protocol 1.5): 4 cut the messages of a one-writer
#: image stream by 4 while its commits wait at most 3 writes longer.
AHEAD_BATCH = 4

#: A reservation's shape, as a reserve ahead must match the write that uses it: rows, and the
#: number of equal episodes or the lengths of unequal ones.
Shape = tuple[int, int | None, list[int] | None]
#: What a commit publishes: ``(rows, episodes)``, as the writer counts them (the daemon's reply
#: lists registry entries, and an episode across the ring's end is two).
Written = tuple[int, int]


class ReserveAhead:
    """The reserve a writer may have sent ahead of its next writes, and when to send it.

    ``in_flight``: the writer's list of ``(seq, written)`` requests whose replies it collects;
    an abort of an unused reservation joins it as ``(seq, None)``, so a flush waits for it too.
    ``granted``: reservations of batches, in ring order, until writes take them.
    """

    def __init__(
        self,
        conn: Connection,
        capacity: int,
        mode: str,
        commit_delay: float,
        in_flight: list[tuple[int, Written | None]],
        metas: dict[int, dict[str, Any]] | None = None,
    ) -> None:
        self.conn = conn
        #: The writer's metadata of copied writes by reservation, taken by their commits.
        self._metas: dict[int, dict[str, Any]] = {} if metas is None else metas
        self.capacity = capacity
        self.mode = mode
        self.commit_delay = commit_delay
        self._in_flight = in_flight
        #: The reserve sent ahead: (seq, the shape it reserved, what the commits it carries
        #: publish), until a write (or the ticker, or flush) takes its reply.
        self.pending: tuple[int, Shape, Written] | None = None
        #: Reservations granted ahead that no write has taken yet, and their shape.
        self.granted: deque[dict[str, Any]] = deque()
        self._granted_shape: Shape | None = None
        self._version: tuple[int, int] | None = None  # the daemon's protocol (asked once)
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
        if self.pending is not None or len(self.granted) > self._lead(shape[0]):
            return False
        if shape[0] * AHEAD_SHARE > self.capacity:
            return False
        if not last_write or time.monotonic() - last_write >= self.commit_delay / 2:
            return False
        if self._skip:
            self._skip -= 1
            return False
        if self._version is None:  # one ping per writer, on its first stream
            version = str(self.conn.call("ping").get("protocol", "0.0"))
            major, _, minor = version.partition(".")
            self._version = (int(major), int(minor or 0))
        return self._version >= (1, 3)

    @property
    def holding(self) -> bool:
        """Whether a reserve ahead is in flight or reservations of its batch are in hand."""
        return self.pending is not None or bool(self.granted)

    def _fit(self, rows: int) -> int:
        """Writes of ``rows`` that 1/:data:`AHEAD_SHARE` of the ring holds; 1 from a daemon
        before 1.5 (it grants one at a time)."""
        if self._version is None or self._version < (1, 5):
            return 1
        return self.capacity // (AHEAD_SHARE * rows)

    def _lead(self, rows: int) -> int:
        """Reservations still in hand when the next batch is asked for: 1 where two writes
        fit in the share (its reply then has two copies' time to come, not one), else 0."""
        return 1 if self._fit(rows) >= 2 else 0

    def batch(self, rows: int) -> int:
        """Writes of ``rows`` one reserve ahead asks for: :data:`AHEAD_BATCH`, fewer where
        they and the one still in hand would pass 1/:data:`AHEAD_SHARE` of the ring."""
        return max(1, min(AHEAD_BATCH, self._fit(rows) - self._lead(rows)))

    def send(self, shape: Shape, commits: list[tuple[int, Written]]) -> None:
        """Send the reserve of the next writes (``shape``, a batch of them), carrying
        ``commits`` (earlier writes' reservations and what each publishes, in order), without
        waiting: the reply arrives while this write copies."""
        num_rows, episodes, lengths = shape
        fields: dict[str, Any] = {"rows": num_rows, "ahead": True}
        if lengths is not None:
            fields["lengths"] = lengths
        else:
            fields["episodes"] = episodes
        count = self.batch(num_rows)
        if count > 1:
            fields["count"] = count
        fields.update(commit_fields([r for r, _ in commits], self._metas))
        seq = self.conn.send("reserve", **fields)
        written = (sum(w[0] for _, w in commits), sum(w[1] for _, w in commits))
        self.pending = (seq, shape, written)

    def take(self, shape: Shape | None) -> tuple[dict[str, Any] | None, Written]:
        """``(reply, written)``: a reservation of ``shape`` reserved ahead, the next of
        the batch in hand or else the first of the reserve in flight (else None, and all
        that was granted aborted), and what the commits that reserve carried published. An
        error in the reply (a commit refused, say) is raised here, to the write that needed
        it."""
        if self.granted and shape == self._granted_shape:
            return self.granted.popleft(), (0, 0)
        written = (0, 0)
        if self.pending is not None:  # its batch comes after those in hand, in ring order
            (seq, reserved, written), self.pending = self.pending, None
            header, _ = self.conn.wait(seq)
            if header["reservation"] == 0:  # the daemon would have had it wait: reserve anew
                self._skip = AHEAD_BACKOFF
            else:
                self.granted.append(
                    {"reservation": header["reservation"], "ranges": header["ranges"]}
                )
                self.granted.extend(
                    {"reservation": r, "ranges": ranges} for r, ranges in header.get("more", ())
                )
                self._granted_shape = reserved
        if self.granted and shape == self._granted_shape:
            return self.granted.popleft(), written
        self._give_back_granted()
        return None, written

    def _give_back_granted(self) -> None:
        # written=0: what each evicted is published again and, if nothing was reserved after
        # it, the ring pointer goes back, as if it had never been asked for.
        while self.granted:
            reservation = self.granted.pop()["reservation"]  # the newest first
            abort = self.conn.send("abort", reservation=reservation, written=0)
            self._in_flight.append((abort, None))

    def due_back(self, idle_only: bool, last_write: float) -> bool:
        """Whether to give what is reserved ahead back now: at once (flush, close), or (the
        ticker) once the writer has been idle for ``commit_delay`` and a reply in flight has
        arrived."""
        if not self.holding:
            return False
        if not idle_only:
            return True
        idle = time.monotonic() - last_write >= self.commit_delay
        return idle and (self.pending is None or self.conn.ready(self.pending[0]))


def commit_fields(
    reservations: list[int], metas: dict[int, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """A reserve's fields committing ``reservations`` first: ``commit`` for one (any daemon),
    ``commits`` for several (1.5: only a batch reserved ahead leaves several pending), and
    the ``metas`` of those with metadata (1.9), taken out of ``metas``."""
    if not reservations:
        return {}
    fields: dict[str, Any] = (
        {"commit": reservations[0]} if len(reservations) == 1 else {"commits": reservations}
    )
    if metas:
        pairs = [[r, metas.pop(r)] for r in reservations if r in metas]
        if pairs:
            fields["metas"] = pairs
    return fields
