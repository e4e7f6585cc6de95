"""Where the next rows go and which rows a read gets: one ring and the tables over it.

The container is metadata only. It never touches row data, so the same object serves the
in-process :class:`~shmbuffer.Buffer` (which copies right after reserving) and the daemon
(whose writers copy in their own processes between ``reserve`` and ``commit``).

:class:`Container` is a composition, each part an object of its own:

- :class:`~shmbuffer.ring.ring.Ring` (``container.ring``): capacity, modes, units, the pointer,
  the episode registry, two-phase reservations, eviction, restore and clear; it tells its
  listeners (:class:`~shmbuffer.ring.listeners.RingListener`) what happened and asks them before a
  reservation whether it must wait;
- :class:`~shmbuffer.ring.table.Table` (``container.tables``, the first one ``container.table``,
  named ``"default"``): a sampler, a rate limiter, a generator, use counts and priority
  counters over the ring, listening to it; ``sample_rows`` / ``sample_episodes`` /
  ``sample_slices``, priority updates, the limiter's ``sample_blocker``, ``rank_rows``, stats;
- :mod:`shmbuffer.ring.persistence`: ``state()`` / ``from_state()`` of the ring and every
  table, and the replayed draws of the journal (each on the table that drew it).

Its methods and attributes are the ring's and the default table's, handed on (one call each),
so the daemon, the Buffer and the journal address one object; a second table is
:meth:`Container.add_table`, and is read through the :class:`Table` it returns.

Not thread-safe: the owner (buffer or daemon loop) serialises calls.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Self

import numpy as np
import numpy.typing as npt

from shmbuffer.api.reads import as_invalid_argument
from shmbuffer.api.tables import checked_tables, table_bounds
from shmbuffer.errors import InvalidArgumentError, NotFoundError
from shmbuffer.registry.intervals import Episode, EpisodeRegistry
from shmbuffer.ring import persistence
from shmbuffer.ring.bounds import TableBounds
from shmbuffer.ring.listeners import F64, Range, SampleLog, SampleRecord
from shmbuffer.ring.members import Members, holds
from shmbuffer.ring.meta import EpisodeMeta
from shmbuffer.ring.persistence import decode_state
from shmbuffer.ring.ring import Plan, Reservation, Ring
from shmbuffer.ring.rowepisodes import RowEpisodes
from shmbuffer.ring.table import (
    I64,
    EpisodeSample,
    PriorityUpdate,
    RowSample,
    SliceSample,
    Table,
)
from shmbuffer.samplers import RateLimiter, Sampler, make_rate_limiter, make_sampler
from shmbuffer.samplers.base import Priority

__all__ = [
    "Container",
    "EpisodeSample",
    "Plan",
    "Range",
    "Reservation",
    "RowSample",
    "SampleRecord",
    "SliceSample",
    "as_invalid_argument",
    "decode_state",
]


class Container:
    """A ring of ``capacity`` rows and its tables; see the module docstring.

    ``mode``: ``"circular"`` or ``"fixed"``; ``unit``: ``"transition"`` or ``"episode"``.
    ``sampler``, ``rate_limiter`` and ``seed`` make the default table (see
    :class:`~shmbuffer.ring.table.Table`): a sampler (None: uniform) and a limiter (None: no limit)
    that belong to this container from now on, and the seed of the generator its draws use.
    """

    def __init__(
        self,
        capacity: int,
        *,
        mode: str = "circular",
        unit: str = "transition",
        sampler: Sampler | None = None,
        rate_limiter: RateLimiter | None = None,
        seed: int | None = None,
        table_name: str = "default",
    ) -> None:
        self.ring = Ring(capacity, mode=mode, unit=unit)
        #: The table the container's own sampling methods and attributes address.
        self.table = Table(
            self.ring, sampler=sampler, rate_limiter=rate_limiter, seed=seed, key=table_name
        )
        #: Every table over the ring, by name; each hears the ring in this order.
        self.tables: dict[str, Table] = {table_name: self.table}
        #: The ring's open reservations (its dict, which it never replaces).
        self.reservations: dict[int, Reservation] = self.ring.reservations
        #: The episodes' metadata, where the owner keeps it (:meth:`keep_meta`): saved and
        #: loaded with the rest, and the journal's META records replayed into it.
        self.meta: EpisodeMeta | None = None
        #: Each row's episode, kept from the first read that asks where its rows lie in
        #: their episodes (:meth:`extent`); its listener costs every write.
        self.row_episodes: RowEpisodes | None = None

    def extent(self, rows: I64) -> tuple[I64, I64]:
        """For each live row of ``rows``, the rows of its episode before it and from it on
        (itself included), following a chunk the ring's end split (``ring/rowepisodes.py``)."""
        where = self.rows_index()
        return where.rows_before(rows), where.rows_left(rows)

    def rows_index(self) -> RowEpisodes:
        """Each row's registry entry (``ring/rowepisodes.py``), kept from the first call on."""
        if self.row_episodes is None:
            self.row_episodes = RowEpisodes(self.ring)
        return self.row_episodes

    def keep_meta(self, declared: Mapping[str, str] | None = None) -> EpisodeMeta:
        """Keep every episode's metadata from now on (``ring/meta.py``), with the names and
        kinds ``declared`` (None: taken as given); the one already kept, if any."""
        if self.meta is None:
            self.meta = EpisodeMeta(self.ring, declared)
        return self.meta

    def bound_tables(
        self, tables: Mapping[str, Mapping[str, Any]] | None, declared: Mapping[str, str] | None
    ) -> EpisodeMeta | None:
        """Bound the draws of the tables whose options (``tables``, by name, as
        ``Buffer(tables=...)`` takes them) say so (``max_episodes``, ``max_staleness``,
        ``staleness_weights``: ``ring/bounds.py``), and keep the metadata they read; kept too
        if ``declared``. None when neither: an owner that keeps it only once used (a Buffer:
        its listener costs every write) makes it then. InvalidArgumentError naming the table
        for bounds on a table a selection cannot stand in for (``Table.check_filtered``), or
        a ``policy_version`` declared of another kind."""
        found: list[TableBounds] = []
        for name, options in (tables or {}).items():
            spec = table_bounds(name, options)
            if spec is not None:
                table = self.table_named(name)
                table.bounds = TableBounds(spec, name if len(self.tables) > 1 else None)
                table.check_filtered(table.bounds.what)
                found.append(table.bounds)
        if declared is None and not found:
            return None
        meta = self.keep_meta(declared)
        for bounds in found:
            bounds.bind(meta)
        return meta

    @classmethod
    def of_tables(
        cls,
        capacity: int,
        tables: Mapping[str, tuple[Sampler, RateLimiter]],
        *,
        mode: str = "circular",
        unit: str = "transition",
        seed: int | None = None,
    ) -> Container:
        """A ring with ``tables`` over it, by name (a sampler and a limiter each), the first
        the default one. Each table draws with a generator of its own: the first seeded with
        ``seed``, the others with ``seed`` and their place, so two containers built alike draw
        alike and no two tables share a stream."""
        (first, (sampler, limiter)), *others = tables.items()
        container = cls(
            capacity,
            mode=mode,
            unit=unit,
            sampler=sampler,
            rate_limiter=limiter,
            seed=seed,
            table_name=first,
        )
        for i, (name, (sampler, limiter)) in enumerate(others, 1):
            table_seed = None
            if seed is not None:
                table_seed = int(np.random.SeedSequence([seed, i]).generate_state(1)[0])
            container.add_table(name, sampler=sampler, rate_limiter=limiter, seed=table_seed)
        return container

    def add_table(
        self,
        name: str,
        *,
        sampler: Sampler | None = None,
        rate_limiter: RateLimiter | None = None,
        seed: int | None = None,
    ) -> Table:
        """Another table over the ring (as :class:`~shmbuffer.ring.table.Table` takes its
        arguments), from now on told everything the ring does, its writes held back by its
        flow control as by the default table's; :meth:`state` keeps its parts under its name.
        ValueError for a name taken."""
        if name in self.tables:
            raise ValueError(f"a table named {name!r} exists already")
        table = Table(self.ring, sampler=sampler, rate_limiter=rate_limiter, seed=seed, key=name)
        self.tables[name] = table
        for named, each in self.tables.items():  # with two or more, messages name them
            each.name = named
        return table

    def table_at(self, index: int) -> Table:
        """The table at ``index`` in the container's order (0: the default one), as the
        journal names a table; ValueError for an index out of range."""
        tables = list(self.tables.values())
        if not 0 <= index < len(tables):
            raise ValueError(f"no table number {index}: the container has {len(tables)}")
        return tables[index]

    def table_named(self, name: str | None) -> Table:
        """The table ``name`` (None: the default one); InvalidArgumentError naming the
        tables there are for any other name."""
        if name is None:
            return self.table
        table = self.tables.get(name) if isinstance(name, str) else None
        if table is None:
            raise InvalidArgumentError(
                f"no table named {name!r}; the tables are {', '.join(self.tables)}"
            )
        return table

    def members(self, tables: Iterable[str] | None) -> Members:
        """The tables a write goes into, as the ring records them (``ring/members.py``):
        None for None or every table. InvalidArgumentError naming the tables there are for a
        name that is none of them, a str given for a list, or no table at all."""
        checked = checked_tables(tables, self.tables)
        return None if checked is None else frozenset(checked)

    def members_mask(self, members: Members) -> int:
        """``members`` as one bit per table, in the tables' order (0: every table): how the
        journal records them."""
        if members is None:
            return 0
        return sum(1 << i for i, name in enumerate(self.tables) if name in members)

    def mask_members(self, mask: int) -> list[str] | None:
        """The table names a :meth:`members_mask` holds (None for 0: every table)."""
        return [name for i, name in enumerate(self.tables) if mask >> i & 1] if mask else None

    def priority_table(self, members: Members) -> Table:
        """The table a write into ``members`` checks its priority against: the first one it
        goes into that keeps priorities, else the first one it goes into (whose refusal
        names its sampler)."""
        into = [t for t in self.tables.values() if holds(members, t.key)]
        return next((t for t in into if t.sampler.has_priorities), into[0])

    # -- the ring's -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.ring)

    @property
    def capacity(self) -> int:
        return self.ring.capacity

    @property
    def mode(self) -> str:
        return self.ring.mode

    @property
    def unit(self) -> str:
        return self.ring.unit

    @property
    def registry(self) -> EpisodeRegistry:
        return self.ring.registry

    @property
    def pointer(self) -> int:
        return self.ring.pointer

    @property
    def rows_written(self) -> int:
        return self.ring.rows_written

    @property
    def next_reservation(self) -> int:
        return self.ring.next_reservation

    @property
    def reserved_rows(self) -> int:
        return self.ring.reserved_rows

    @property
    def num_rows(self) -> int:
        return self.ring.registry.num_rows

    @property
    def num_episodes(self) -> int:
        return len(self.ring.registry)

    def plan(
        self,
        num_rows: int,
        episodes: int | Sequence[int] = 1,
        tables: Iterable[str] | None = None,
        evict_too: Sequence[tuple[int, int]] | None = None,
    ) -> Plan:
        """:meth:`Ring.plan <shmbuffer.ring.ring.Ring.plan>` of rows going into ``tables``
        (None: every table; :meth:`members` checks them first), evicting ``evict_too``."""
        return self.ring.plan(num_rows, episodes, self.members(tables), evict_too)

    def reserve(self, plan: Plan, owner: object = None) -> Reservation:
        """:meth:`Ring.reserve <shmbuffer.ring.ring.Ring.reserve>`."""
        return self.ring.reserve(plan, owner)

    def reserve_rows(
        self,
        num_rows: int,
        episodes: int | Sequence[int] = 1,
        owner: object = None,
        tables: Iterable[str] | None = None,
    ) -> Reservation:
        """:meth:`Ring.reserve_rows <shmbuffer.ring.ring.Ring.reserve_rows>` into ``tables``."""
        return self.ring.reserve(self.plan(num_rows, episodes, tables), owner)

    def hold(
        self,
        reservation_id: int,
        ranges: Sequence[Range],
        episodes: int | Sequence[int],
        tables: Iterable[str] | None = None,
    ) -> Reservation:
        """:meth:`Ring.hold <shmbuffer.ring.ring.Ring.hold>`, its episodes going into
        ``tables``."""
        return self.ring.hold(reservation_id, ranges, episodes, self.members(tables))

    def commit(
        self, reservation_id: int, priority: Priority = None, tables: Iterable[str] | None = None
    ) -> list[int]:
        """Publish a reservation's episodes; return their ids in order.

        ``tables``: the tables they go into, where the reservation did not say it already
        (a writer that reserved ahead); None: as reserved (every table unless the plan
        named some). ``priority``: None (the sampler's default: the largest seen so far), a
        scalar, or one value per row (transition unit) or per episode (episode unit),
        checked by every table they go into that keeps priorities (by the first they go into
        when none does: refused) before anything is published. InvalidArgumentError (an
        unknown table, a bad priority) and NotFoundError leave the reservation open and
        unchanged; tables that keep no priorities ignore it."""
        reservation = self.ring.reservations.get(reservation_id)
        if reservation is None:
            raise NotFoundError(f"no open reservation {reservation_id}")
        members = reservation.members if tables is None else self.members(tables)
        given = None
        if priority is not None:
            keeping = [
                t
                for t in self.tables.values()
                if holds(members, t.key) and t.sampler.has_priorities
            ]
            first = keeping[0] if keeping else self.priority_table(members)
            given = first.commit_priority(reservation_id, priority)
            for table in keeping[1:]:
                table.commit_priority(reservation_id, given)
        reservation.members = members
        return self.ring.commit(reservation_id, given)

    def abort(self, reservation_id: int, written: int | None = None) -> list[Episode]:
        """:meth:`Ring.abort <shmbuffer.ring.ring.Ring.abort>`."""
        return self.ring.abort(reservation_id, written)

    def restore(self, episodes: Sequence[Episode]) -> None:
        self.ring.restore(episodes)

    def clear(self) -> None:
        """:meth:`Ring.clear <shmbuffer.ring.ring.Ring.clear>`."""
        self.ring.clear()

    # -- the default table's ----------------------------------------------------------------

    @property
    def sampler(self) -> Sampler:
        return self.table.sampler

    @property
    def rate_limiter(self) -> RateLimiter:
        return self.table.rate_limiter

    @property
    def rng(self) -> np.random.Generator:
        return self.table.rng

    @property
    def use_counts(self) -> npt.NDArray[np.int32]:
        return self.table.use_counts

    @property
    def sample_log(self) -> SampleLog | None:
        return self.table.sample_log

    @property
    def rng_unlogged(self) -> bool:
        return self.table.rng_unlogged

    @property
    def priority_updates(self) -> int:
        return self.table.priority_updates

    @property
    def priority_updates_stale(self) -> int:
        return self.table.priority_updates_stale

    def sample_rows(self, n: int, *, beta: float | None = None) -> RowSample:
        """:meth:`Table.sample_rows <shmbuffer.ring.table.Table.sample_rows>`."""
        return self.table.sample_rows(n, beta=beta)

    def sample_episodes(self, n: int, *, beta: float | None = None) -> EpisodeSample:
        """:meth:`Table.sample_episodes <shmbuffer.ring.table.Table.sample_episodes>`."""
        return self.table.sample_episodes(n, beta=beta)

    def sample_slices(
        self, n: int, length: int, *, strict: bool = True, beta: float | None = None
    ) -> SliceSample:
        """:meth:`Table.sample_slices <shmbuffer.ring.table.Table.sample_slices>`."""
        return self.table.sample_slices(n, length, strict=strict, beta=beta)

    def count_use(self, rows: np.ndarray) -> None:
        self.table.count_use(rows)

    def sample_blocker(self, rows: int) -> str | None:
        return self.table.sample_blocker(rows)

    def rank_rows(
        self,
        rank: int = 0,
        world_size: int = 1,
        *,
        shuffle: bool = True,
        drop_last: bool = False,
        seed: int | Sequence[int] = 0,
    ) -> I64:
        """:meth:`Table.rank_rows <shmbuffer.ring.table.Table.rank_rows>`."""
        return self.table.rank_rows(
            rank, world_size, shuffle=shuffle, drop_last=drop_last, seed=seed
        )

    def check_priority(
        self, num_rows: int, episodes: int | Sequence[int], priority: Priority
    ) -> F64 | None:
        """:meth:`Table.check_priority <shmbuffer.ring.table.Table.check_priority>`."""
        return self.priority_table(None).check_priority(num_rows, episodes, priority)

    def commit_priorities(self, reservation_id: int, priority: Priority) -> PriorityUpdate | None:
        """:meth:`Table.commit_priorities <shmbuffer.ring.table.Table.commit_priorities>` of the
        table the reservation's priorities are checked by (:meth:`priority_table`)."""
        reservation = self.ring.reservations.get(reservation_id)
        if priority is None and reservation is not None:  # asked at every commit: no more
            return None
        members = None if reservation is None else reservation.members
        return self.priority_table(members).commit_priorities(reservation_id, priority)

    def check_priorities(
        self,
        rows: npt.ArrayLike,
        priority: npt.ArrayLike,
        generation: npt.ArrayLike | None = None,
        stamps: I64 | None = None,
    ) -> PriorityUpdate:
        """:meth:`Table.check_priorities <shmbuffer.ring.table.Table.check_priorities>`."""
        return self.table.check_priorities(rows, priority, generation, stamps)

    def apply_priorities(self, update: PriorityUpdate) -> int:
        return self.table.apply_priorities(update)

    def update_priorities(
        self,
        rows: npt.ArrayLike,
        priority: npt.ArrayLike,
        generation: npt.ArrayLike | None = None,
        stamps: I64 | None = None,
    ) -> int:
        """:meth:`Table.update_priorities <shmbuffer.ring.table.Table.update_priorities>`."""
        return self.table.update_priorities(rows, priority, generation, stamps)

    def stats(self) -> dict[str, Any]:
        """The default table's stats; with several tables, each one's under ``"tables"``."""
        if len(self.tables) == 1:
            return self.table.stats()
        return {**self.table.stats(), "tables": {k: t.stats() for k, t in self.tables.items()}}

    # -- saved states and the journal's replay (shmbuffer.ring.persistence) ------------------------

    def state(self) -> dict[str, Any]:
        """:func:`persistence.state_of <shmbuffer.ring.persistence.state_of>` the ring and
        every table, and the episodes' metadata where it is kept."""
        state = persistence.state_of(self.ring, self.tables)
        if self.meta is not None:
            state["meta"] = persistence.encode_state(self.meta.state_dict())
        return state

    @classmethod
    def from_state(
        cls,
        state: Mapping[str, Any],
        *,
        sampler: Sampler | None = None,
        rate_limiter: RateLimiter | None = None,
    ) -> Self:
        """A container in ``state``, with every table it saved. ``sampler``/``rate_limiter``
        (the default table's) None: the saved kinds with their saved settings (uniform / no
        limit for a state saved before samplers existed); the other tables' are always the
        saved ones. ValueError (KeyError, TypeError) when the state is inconsistent."""
        tables = persistence.saved_tables(state)
        (first, saved), *others = tables.items()
        default = _saved_parts(saved)
        container = cls(
            operator.index(state["capacity"]),
            mode=state["mode"],
            unit=state["unit"],
            sampler=default[0] if sampler is None else sampler,
            rate_limiter=default[1] if rate_limiter is None else rate_limiter,
            table_name=first,
        )
        for name, entry in others:
            parts = _saved_parts(entry)
            container.add_table(name, sampler=parts[0], rate_limiter=parts[1])
        container.load_state(state)
        return container

    def load_state(self, state: Mapping[str, Any]) -> None:
        """:func:`persistence.load_state <shmbuffer.ring.persistence.load_state>` into the ring and
        every table (the state's tables must be this container's, by name and kind). Saved
        metadata is kept from then on (:meth:`keep_meta`)."""
        persistence.load_state(self.ring, self.tables, state)
        if state.get("meta") is not None:
            self.keep_meta().load_state_dict(decode_state(state["meta"]))

    def replay_reserve(
        self, evicted: Sequence[Range], pointer: int, rows_written: int, next_reservation: int
    ) -> None:
        """:meth:`Ring.replay_reserve <shmbuffer.ring.ring.Ring.replay_reserve>`."""
        self.ring.replay_reserve(evicted, pointer, rows_written, next_reservation)

    def replay_commit(
        self, episodes: Sequence[tuple[int, int, int]], tables: Iterable[str] | None = None
    ) -> list[int]:
        """:meth:`Ring.replay_commit <shmbuffer.ring.ring.Ring.replay_commit>` into
        ``tables`` (None: every table), as :meth:`commit` took them; the ids."""
        self.ring.replay_commit(episodes, self.members(tables))
        return [ep[0] for ep in episodes]

    def replay_restore(self, episodes: Sequence[Episode], pointer: int, rows_written: int) -> None:
        self.ring.replay_restore(episodes, pointer, rows_written)

    def replay_clear(self, pointer: int) -> None:
        self.ring.replay_clear(pointer)

    def replay_priorities(
        self, rows: npt.ArrayLike, priority: npt.ArrayLike, table: int = 0
    ) -> int:
        """Redo a priority update on the table at ``table`` (:meth:`table_at`; stale rows were
        already left out when it was journaled)."""
        return self.table_at(table).update_priorities(rows, priority)

    def replay_meta(
        self,
        ids: Sequence[int],
        values: Mapping[str, Any],
        writer: str | None,
        commit_time: float | None,
    ) -> None:
        """Redo a journaled attach: ``values`` and the ``writer`` of the episodes ``ids`` the
        commit before it published, and the live commit's ``commit_time`` (not the replay's).
        InvalidArgumentError where ``values`` no longer fit the kinds kept."""
        meta = self.keep_meta()
        meta.attach(ids, meta.check(values), writer, commit_time)

    def replay_sample(self, draw: SampleRecord, table: int = 0) -> bool:
        """:func:`persistence.replay_sample <shmbuffer.ring.persistence.replay_sample>` on the
        table at ``table`` (:meth:`table_at`)."""
        return persistence.replay_sample(self.table_at(table), draw)


def _saved_parts(saved: Mapping[str, Any]) -> tuple[Sampler | None, RateLimiter | None]:
    """A saved table's sampler and limiter, of the saved kinds and settings (None: none saved,
    a state from before samplers existed)."""
    sampler = saved.get("sampler") or {}
    limiter = saved.get("rate_limiter") or {}
    return (
        make_sampler(sampler["name"], **dict(sampler.get("settings") or {}))
        if "name" in sampler
        else None,
        make_rate_limiter(limiter["name"], **dict(limiter.get("settings") or {}))
        if "name" in limiter
        else None,
    )
