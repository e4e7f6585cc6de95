"""The ring of rows: where the next rows go, two-phase reservations, eviction and restore.

The ring is metadata only (it never touches row data) and knows nothing of samplers or rate
limiters: it tells its listeners what happened (:class:`~shmbuffer.ring.listeners.RingListener`:
rows committed, evicted, restored, cleared, a saved state loaded) and asks them, while it plans
a reservation, whether it must wait. The tables over it (:mod:`shmbuffer.ring.table`) are such
listeners.

Writing is two-phase, which is what keeps readers from ever seeing a torn episode:

1. ``plan(n)`` decides the rows, what they evict and whether flow control holds them back,
   changing nothing; ``reserve(plan)`` evicts every committed episode the rows overlap
   (listeners hear it at once, so samplers stop returning them) and hands out the physical
   row ranges;
2. the caller copies the data into those rows;
3. ``commit(reservation)`` publishes the episodes in the registry; only then can they be read.

A reservation whose copy fails is aborted: what it evicted is published again wherever the
copy left the rows untouched and no later reservation has reached them (:meth:`Ring.abort`), so
a failed write loses nothing that was stored (in-process it leaves the ring exactly as before
``reserve``).

Units: in ``"transition"`` unit ``len()`` counts rows and a chunk may wrap around the end of
the ring (split in two ranges); in ``"episode"`` unit ``len()`` counts episodes and an episode
never wraps: when it does not fit before the end, the writer wraps early to row 0 and the rows
it skipped are evicted too, so eviction stays FIFO over whole episodes.

Listeners are told from :meth:`Ring._evict_ranges`, :meth:`Ring.commit`,
:meth:`Ring.restore`, :meth:`Ring.clear` and :meth:`Ring.load` only (and
:meth:`Ring.replay_commit`, which publishes episodes under the ids the journal names); the
journal's other ``replay_*`` methods go through the same ones, so a resumed daemon's tables
hear what the live ones heard.

Not thread-safe: the owner (buffer or daemon loop) serialises calls.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from shmbuffer.errors import CapacityError, NotFoundError, WaitTimeoutError
from shmbuffer.names import MODES, UNITS, check_choice
from shmbuffer.registry.intervals import Episode, EpisodeRegistry
from shmbuffer.ring.listeners import F64, Range, RingListener
from shmbuffer.ring.members import Members, Membership

__all__ = ["Plan", "Range", "Reservation", "Ring", "episode_lengths"]


@dataclass(slots=True)
class Reservation:
    """Rows handed to one writer: physical ``ranges`` filled in order, episodes to publish."""

    id: int
    ranges: list[Range]
    #: ``(start, end)`` physical bounds of each (sub-)episode, registered at commit.
    episodes: list[Range]
    owner: object = None
    evicted: list[Episode] = field(default_factory=list)
    #: When an owner that never commits loses the rows (monotonic seconds; daemon only).
    deadline: float = math.inf
    #: Chunks whose front this reservation trimmed (transition unit), with their old bounds.
    trimmed: list[Episode] = field(default_factory=list)
    #: ``(pointer, rows_written, travelled)`` before it, and ``travelled`` after it: what an
    #: abort needs to tell whether later reservations reached the rows it evicted.
    before: tuple[int, int, int] = (0, 0, 0)
    travelled: int = 0
    #: The (sub-)episodes it publishes: what ``episodes_committed`` counts. ``episodes`` can
    #: hold one more entry, for the one the ring's end splits in two.
    num_episodes: int = 1
    #: The tables its episodes go into, by key (None: every one): ``ring/members.py``. Its
    #: owner may change it until the commit (a writer that reserved ahead says it then).
    members: Members = None

    @property
    def num_rows(self) -> int:
        return sum(stop - start for start, stop in self.ranges)


class Plan(NamedTuple):
    """What a reservation of ``num_rows`` would do, decided once against the ring as it
    stands (:meth:`Ring.plan`) and consumed by :meth:`Ring.reserve`: its rows, what it
    evicts, and why it must wait if it must. Valid only while the ring has not moved. A
    NamedTuple, immutable and built on every write: a frozen dataclass's constructor cost
    a microsecond of a Buffer's write."""

    num_rows: int
    #: Each episode's length, validated (a count of equal ones, or the lengths given).
    lengths: list[int]
    ranges: list[Range]
    evict: list[Range]
    #: Open reservations holding rows it would evict: writers still copying there.
    busy: list[Reservation]
    #: Why a listener's flow control holds it back (a rate limiter, rows a consuming reader
    #: has not read yet), or None.
    blocked: str | None
    #: ``(pointer, rows_written)`` it was made at.
    at: tuple[int, int]
    #: The tables the rows go into (None: every one); only theirs hold it back by their
    #: rate limiters.
    members: Members = None

    @property
    def episodes(self) -> int:
        return len(self.lengths)


_new_tuple = tuple.__new__


class Ring:
    """``capacity`` rows written in order; see the module docstring.

    ``mode``: ``"circular"`` (overwrite the oldest) or ``"fixed"`` (refuse once full);
    ``unit``: ``"transition"`` or ``"episode"``.
    """

    def __init__(
        self, capacity: int, *, mode: str = "circular", unit: str = "transition", tail: int = 0
    ) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self.capacity = capacity
        #: Rows each episode (each entry of ``lengths``) is reserved with after its last step
        #: and registered without: a next_of column's last next frame (``api/frames.py``).
        #: Set from the schema before the first reservation.
        self.tail = tail
        self.mode = check_choice("mode", mode, MODES)
        self.unit = check_choice("unit", unit, UNITS)
        self.registry = EpisodeRegistry(capacity)
        self.pointer = 0  # next physical row to write
        self.rows_written = 0  # rows ever reserved, for stats and the fixed-mode limit
        #: Rows the pointer has moved, early-wrap skips included (not journaled: after a
        #: restart no reservation is open to compare it with).
        self.travelled = 0
        #: Open reservations by id; this dict is never replaced (its owner may keep it).
        self.reservations: dict[int, Reservation] = {}
        #: The id the next :meth:`reserve` hands out (journaled with every reservation).
        self.next_reservation = 1
        # A tuple: every change walks it, and it changes only when a listener registers.
        self._listeners: tuple[RingListener, ...] = ()
        #: Which tables hold the episodes written into only some (``ring/members.py``).
        self.membership = Membership()
        #: Id of the registry entry ending at the ring's last row whose episode goes on in
        #: entry ``id + 1`` from row 0: a transition chunk written across the end is two
        #: entries, and a read that follows an episode (n-step returns) must know they are
        #: one. -1: none known (:meth:`load` forgets it; a saved state carries it:
        #: ``persistence.py``).
        self.wrap_split = -1

    def listen(self, listener: RingListener) -> None:
        """Tell ``listener`` every change from now on, after those registered before it (see
        :class:`~shmbuffer.ring.listeners.RingListener` for what it is told and its calling rule).
        ValueError if it listens already."""
        if any(other is listener for other in self._listeners):
            raise ValueError(f"{listener!r} already listens to this ring")
        self._listeners = (*self._listeners, listener)

    @property
    def listeners(self) -> tuple[RingListener, ...]:
        return self._listeners

    # -- sizes ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.registry.num_rows if self.unit == "transition" else len(self.registry)

    @property
    def num_rows(self) -> int:
        return self.registry.num_rows

    @property
    def num_episodes(self) -> int:
        return len(self.registry)

    @property
    def reserved_rows(self) -> int:
        return sum(r.num_rows for r in self.reservations.values())

    # -- reserving ----------------------------------------------------------------------------

    def plan(
        self,
        num_rows: int,
        episodes: int | Sequence[int] = 1,
        members: Members = None,
        evict_too: Sequence[Range] | None = None,
    ) -> Plan:
        """Decide a reservation of ``num_rows`` for ``episodes`` (a count of equal
        sub-episodes, or their lengths: a writer that batches several small episodes into one
        round trip) going into the tables ``members`` (None: every one) without changing
        anything: its rows, its evictions, the writers it would lap and whether a listener
        holds it back. An owner checks its own rules against it (the daemon: leases on the
        evicted rows) and then hands it to :meth:`reserve`. CapacityError/ValueError for a
        request that can never fit. ``evict_too``: rows of episodes that must go as well (the
        oldest, whose compressed chunks the write's bytes need: ``ring/packing.py``)."""
        lengths = episode_lengths(num_rows, episodes)
        if self.tail and min(lengths) <= self.tail:
            raise ValueError(
                f"each episode needs more than its {self.tail} tail row(s) (the last next "
                f"observation a next_of column keeps), got lengths {lengths[:8]}"
            )
        ranges, evict = self._plan(num_rows)
        if evict_too:
            evict = [*evict_too, *evict]
        busy = self.conflicts(evict) if self.reservations else []
        blocked = None
        for listener in self._listeners:
            blocked = listener.insert_blocker(num_rows, evict, members)
            if blocked is not None:
                break
        # tuple.__new__, not Plan(...): its generated constructor is a Python-level call
        at = (self.pointer, self.rows_written)
        return _new_tuple(Plan, (num_rows, lengths, ranges, evict, busy, blocked, at, members))

    def _plan(self, num_rows: int) -> tuple[list[Range], list[Range]]:
        if num_rows > self.capacity:
            raise CapacityError(f"{num_rows} rows do not fit a buffer of capacity {self.capacity}")
        start, end = self.pointer, self.pointer + num_rows
        if end <= self.capacity:
            return [(start, end)], [(start, end)]
        if self.mode == "fixed":
            raise CapacityError(
                f"fixed-mode buffer is full: {num_rows} rows do not fit in the "
                f"{self.capacity - self.pointer} left of capacity {self.capacity}"
            )
        if self.unit == "episode":  # early wrap: skip the tail, evict it with the new rows
            return [(0, num_rows)], [(start, self.capacity), (0, num_rows)]
        wrapped = [(start, self.capacity), (0, end - self.capacity)]
        return wrapped, wrapped

    def reserve(self, plan: Plan, owner: object = None) -> Reservation:
        """Carry out ``plan`` (made by :meth:`plan` since the ring last moved): evict, move the
        ring, open the reservation. CapacityError if it would lap a writer still copying,
        WaitTimeoutError if a listener holds it back (an owner that waits asked the plan
        first), ValueError for a plan the ring has moved past."""
        if plan.at != (self.pointer, self.rows_written):
            raise ValueError(f"a plan made at {plan.at}: the ring has moved since")
        if plan.busy:
            raise CapacityError(
                f"rows {plan.evict} are still reserved by an uncommitted writer (reservation "
                f"{plan.busy[0].id}); the ring is smaller than the data in flight"
            )
        if plan.blocked is not None:
            raise WaitTimeoutError(f"cannot reserve {plan.num_rows} rows now: {plan.blocked}")
        before = (self.pointer, self.rows_written, self.travelled)
        trimmed: list[Episode] = []
        evicted = self._evict_ranges(plan.evict, trimmed)
        ranges = plan.ranges
        # A full fixed-mode ring keeps pointer == capacity, so nothing fits any more.
        end = ranges[-1][1]
        self.pointer = end if self.mode == "fixed" else end % self.capacity
        self.rows_written += plan.num_rows
        for start, stop in plan.evict:  # the evicted span is where the pointer moved
            self.travelled += stop - start
        reservation = Reservation(
            self.next_reservation,
            ranges,
            _episode_bounds(ranges, plan.lengths, self.tail),
            owner,
            evicted,
            trimmed=trimmed,
            before=before,
            travelled=self.travelled,
            num_episodes=len(plan.lengths),
            members=plan.members,
        )
        self.next_reservation += 1
        self.reservations[reservation.id] = reservation
        return reservation

    def reserve_rows(
        self,
        num_rows: int,
        episodes: int | Sequence[int] = 1,
        owner: object = None,
        members: Members = None,
    ) -> Reservation:
        """:meth:`plan` and :meth:`reserve` in one, for an owner with nothing to check in
        between (the in-process Buffer)."""
        return self.reserve(self.plan(num_rows, episodes, members), owner)

    def hold(
        self,
        reservation_id: int,
        ranges: Sequence[Range],
        episodes: int | Sequence[int],
        members: Members = None,
    ) -> Reservation:
        """Open again reservation ``reservation_id`` of ``ranges`` split into ``episodes`` (as
        :meth:`reserve` takes them) that a dead owner had, its rows already evicted by the
        replay of its reserve: no new reservation is granted over its rows until it is
        committed or aborted (a writer that outlived its daemon may still copy there).
        ValueError if its id is taken or still to come, or the split does not fit."""
        if reservation_id in self.reservations or reservation_id >= self.next_reservation:
            raise ValueError(f"reservation {reservation_id} cannot be held again")
        held = [(int(s), int(e)) for s, e in ranges]
        lengths = episode_lengths(sum(e - s for s, e in held), episodes)
        reservation = Reservation(
            reservation_id,
            held,
            _episode_bounds(held, lengths, self.tail),
            before=(self.pointer, self.rows_written, self.travelled),
            travelled=self.travelled,
            members=members,
        )
        self.reservations[reservation_id] = reservation
        return reservation

    def conflicts(self, ranges: list[Range]) -> list[Reservation]:
        """Open reservations holding any row of ``ranges`` (a writer still copying there)."""
        # Plain loops, not any() over a generator: the daemon asks this for every reserve,
        # with every open reservation of every writer (a batch ahead each) to look at.
        found = []
        for other in self.reservations.values():
            for s, e in other.ranges:
                if _overlaps(s, e, ranges):
                    found.append(other)
                    break
        return found

    # -- eviction -----------------------------------------------------------------------------

    def _evict_ranges(self, evict: Sequence[Range], trimmed: list[Episode]) -> list[Episode]:
        """Evict each range, telling the listeners after each (the registry already changed)
        where anything was live; returns the episodes dropped whole."""
        registry = self.registry
        evicted: list[Episode] = []
        for start, stop in evict:
            rows_before, trims = registry.num_rows, len(trimmed)
            gone = self._evict(start, stop, trimmed)
            if gone or len(trimmed) > trims:  # nothing was live there: nothing to tell
                rows = rows_before - registry.num_rows
                for listener in self._listeners:
                    listener.on_evict(start, stop, gone, rows)
                evicted += gone
        return evicted

    def _evict(self, start: int, stop: int, trimmed: list[Episode]) -> list[Episode]:
        """Unpublish rows ``start:stop``. Episode unit drops every episode they touch; transition
        unit keeps the surviving tail of a chunk the ring only partly overwrites (its old
        bounds are appended to ``trimmed``)."""
        if self.unit == "episode":
            return self.registry.evict(start, stop)
        return self.registry.evict(start, stop, trimmed)

    # -- committing, aborting, restoring, clearing --------------------------------------------

    def commit(self, reservation_id: int, priority: F64 | None = None) -> list[int]:
        """Publish a reservation's episodes into the tables its ``members`` name; return
        their ids in order. ``priority``: one checked value per item for the listeners that
        keep priorities (None: none given); the committer checks it first
        (``Container.commit`` asks its tables)."""
        reservation = self.reservations.pop(reservation_id, None)
        if reservation is None:
            raise NotFoundError(f"no open reservation {reservation_id}")
        first = self.registry.add_run(reservation.episodes)
        episodes = [Episode(first + i, s, e) for i, (s, e) in enumerate(reservation.episodes)]
        if len(episodes) > reservation.num_episodes:  # one straddles the end (_episode_bounds)
            ends = (ep.id for ep in episodes if ep.end == self.capacity)
            self.wrap_split = next(ends, self.wrap_split)
        members = reservation.members
        if members is not None:
            self._remember(first, first + len(episodes), members)
        for listener in self._listeners:
            listener.on_commit(episodes, reservation.ranges, priority, members)
        return [ep.id for ep in episodes]

    def _remember(self, first: int, end: int, members: Members) -> None:
        """Record ids ``[first, end)`` as written into ``members``, forgetting the runs no
        abort can bring back (``ring/members.py``)."""
        floor = self.registry.oldest_id
        for reservation in self.reservations.values():
            for ep in (*reservation.evicted, *reservation.trimmed):
                floor = min(floor, ep.id)
        self.membership.forget_below(floor)
        self.membership.add(first, end, members)

    def members_of(self, episode_id: int) -> Members:
        """The tables episode ``episode_id`` was written into (None: every one)."""
        return self.membership.of(episode_id)

    def abort(self, reservation_id: int, written: int | None = None) -> list[Episode]:
        """Give rows back unpublished (a writer that died or failed mid-copy).

        ``written``: how many of the reservation's rows (in fill order) the copy may have
        touched, when the caller knows (None: nothing comes back, as for a writer that died).
        Every episode the reservation evicted (or trimmed) is published again under its old id
        when none of its rows were touched or reached by a later reservation; if nothing was
        touched and no reservation came after it, the ring pointer goes back too, as if
        ``reserve`` had never run. Returns the episodes published again (restored bounds).
        """
        try:
            reservation = self.reservations.pop(reservation_id)
        except KeyError:
            raise NotFoundError(f"no open reservation {reservation_id}") from None
        if written is None:
            return []
        later = self.travelled - reservation.travelled
        touched = max(0, written)
        if later == 0 and touched == 0:
            self.pointer, self.rows_written, self.travelled = reservation.before
        if later >= self.capacity:
            return []
        blocked = _split(reservation.ranges, touched) + _ring(
            reservation.ranges[-1][1] % self.capacity, later, self.capacity
        )
        back = [
            ep
            for ep in (*reservation.evicted, *reservation.trimmed)
            if not _overlaps(ep.start, ep.end, blocked)
        ]
        self.restore(back)
        return back

    def restore(self, episodes: Sequence[Episode]) -> None:
        """Publish ``episodes`` again under their old ids; a live id (a trimmed chunk) gets the
        given bounds back (aborts and their journal replay). O(live episodes) vectorised, plus
        what the listeners do with the rows restored (a sampler: O(rows restored))."""
        if not episodes:
            return
        rows_before = self.registry.num_rows
        self.registry.restore(episodes)  # ValueError before it changes anything
        back = self.registry.num_rows - rows_before
        for listener in self._listeners:
            listener.on_restore(episodes, back)

    def clear(self) -> None:
        """Forget every committed row; open reservations stay valid (but an abort no longer
        brings back what they evicted: it was cleared)."""
        for reservation in self.reservations.values():
            reservation.evicted, reservation.trimmed = [], []
        rows = self.registry.num_rows
        self.registry.clear()
        if not self.reservations:
            self.pointer = 0
        self.membership.clear()
        for listener in self._listeners:
            listener.on_clear(rows)

    # -- saved states and the journal's replay ------------------------------------------------

    def load(
        self,
        registry: EpisodeRegistry,
        pointer: int,
        rows_written: int,
        next_reservation: int,
        members: Sequence[Sequence[Any]] | None = None,
    ) -> None:
        """Take over a saved ``registry``, position and table ``members`` (a checkpoint, a
        journal snapshot; :meth:`Membership.state <shmbuffer.ring.members.Membership.state>`,
        None: every episode in every table): open reservations are dropped (their rows were
        never published) and every listener starts over from the new registry."""
        if registry.capacity != self.capacity:
            raise ValueError(
                f"a registry of {registry.capacity} rows for a ring of {self.capacity}"
            )
        self.membership.load(members)
        self.registry = registry
        self.reservations.clear()
        self.pointer, self.rows_written = pointer, rows_written
        self.next_reservation = next_reservation
        self.travelled = 0
        self.wrap_split = -1
        for listener in self._listeners:
            listener.on_load()

    def replay_reserve(
        self, evicted: Sequence[Range], pointer: int, rows_written: int, next_reservation: int
    ) -> None:
        """Redo a reservation: evict ``evicted`` (telling the listeners) and move the ring to
        where it stood after it. No reservation is opened: its rows were never committed, so
        they are never published."""
        self._evict_ranges(evicted, [])
        self.pointer, self.rows_written = pointer, rows_written
        self.next_reservation = next_reservation

    def replay_commit(
        self, episodes: Sequence[tuple[int, int, int]], members: Members = None
    ) -> None:
        """Redo a commit of ``(id, start, end)`` episodes (one reservation's) into the tables
        ``members`` (None: every one); ValueError if the registry hands out other ids (the
        journal does not fit this state). Priorities a writer gave are journaled apart and
        replayed as a priority update."""
        published: list[Episode] = []
        for episode_id, start, end in episodes:
            got = self.registry.add(start, end)
            if got != episode_id:
                raise ValueError(f"replayed episode got id {got}, journal says {episode_id}")
            published.append(Episode(got, start, end))
        bounds = [(ep.start, ep.end) for ep in published]
        if members is not None and published:
            self._remember(published[0].id, published[-1].id + 1, members)
        for listener in self._listeners:
            listener.on_commit(published, bounds, None, members)

    def replay_restore(self, episodes: Sequence[Episode], pointer: int, rows_written: int) -> None:
        """Redo an abort that published ``episodes`` again (see :meth:`abort`)."""
        self.restore(episodes)
        self.pointer, self.rows_written = pointer, rows_written

    def replay_clear(self, pointer: int) -> None:
        self.clear()
        self.pointer = pointer


def _overlaps(s: int, e: int, ranges: Sequence[Range]) -> bool:
    """Whether rows ``[s, e)`` overlap any of ``ranges``."""
    for start, stop in ranges:  # noqa: SIM110 (a loop: any() over a generator costs more)
        if s < stop and start < e:
            return True
    return False


def episode_lengths(num_rows: int, episodes: int | Sequence[int]) -> list[int]:
    """The length of each episode of a reservation; ValueError unless they add up."""
    if num_rows < 1:
        raise ValueError(f"a reservation needs at least one row, got {num_rows}")
    if isinstance(episodes, int):
        if episodes < 1 or num_rows % episodes:
            raise ValueError(f"{num_rows} rows cannot be split into {episodes} equal episodes")
        return [num_rows // episodes] * episodes
    lengths = [int(n) for n in episodes]
    if not lengths or min(lengths) < 1 or sum(lengths) != num_rows:
        raise ValueError(f"episode lengths must be positive and add up to {num_rows} rows")
    return lengths


def _split(ranges: Sequence[Range], n: int) -> list[Range]:
    """The parts of ``ranges`` (filled in order) holding their first ``n`` rows."""
    out: list[Range] = []
    for start, stop in ranges:
        if n <= 0:
            break
        out.append((start, min(stop, start + n)))
        n -= stop - start
    return out


def _ring(start: int, length: int, capacity: int) -> list[Range]:
    """Physical ranges of ``length`` ring rows from ``start`` on (``length < capacity``)."""
    if length <= 0:
        return []
    if start + length <= capacity:
        return [(start, start + length)]
    return [(start, capacity), (0, start + length - capacity)]


def _episode_bounds(ranges: list[Range], lengths: list[int], tail: int = 0) -> list[Range]:
    """Physical bounds of episodes of ``lengths`` rows laid over ``ranges`` in order; an
    episode that straddles the wrap of a transition chunk becomes two entries. The last
    ``tail`` rows of each are left out (rows written after an episode that no entry covers:
    its last next observation, ``api/frames.py``). O(E + R)."""
    if not tail:
        if len(lengths) == 1:  # one episode (a chunk of transitions): one entry per range
            return list(ranges)
        if len(ranges) == 1:  # no wrap (the usual case): the running ends, shifted
            return list(itertools.pairwise(itertools.accumulate(lengths, initial=ranges[0][0])))
    bounds: list[Range] = []
    parts = iter(ranges)
    row, stop = next(parts)
    for length in lengths:
        left, keep = length, length - tail
        while left:
            if row == stop:
                row, stop = next(parts)
            take = min(left, stop - row)
            kept = min(take, keep)
            if kept > 0:
                bounds.append((row, row + kept))
            keep -= take
            row += take
            left -= take
    return bounds
