"""Per-episode metadata beside the registry: scalars a writer attaches, kept by episode id.

A writer attaches a few scalars to an episode (its return, policy version, env id, ...); the
buffer records its length, commit time and writer. :class:`EpisodeMeta` keeps them columnar,
one numpy array per name indexed by ``id - base``: episode ids only grow, and a ring evicts the
oldest first, so the live ids fill one short span and a filter over every live episode is a
few vectorised passes over it (:mod:`shmbuffer.registry.query`), never a Python loop.

It is a :class:`~shmbuffer.ring.listeners.RingListener`: an episode's entry goes live when the
ring commits it and dead when the ring evicts it; an aborted reservation that publishes what it
evicted again brings those entries back with their values (they are kept until the dead front
of the span is dropped). Values come from the owner (:meth:`attach`, right after the commit
that published the ids), checked before anything was reserved (:meth:`check`), so a refused
value leaves the buffer as it was.

Names are identifiers (a filter names them). Each has one kind, ``int``, ``float``, ``bool`` or
``str``: declared up front (then no other name is taken) or taken from the first value given,
as a lazy schema takes its columns; an int is taken where a float is kept, nothing else mixes.
``id``, ``length``, ``commit_time`` and ``writer`` are the buffer's own.

Not thread-safe: the ring's owner serialises calls, as the listener contract says.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from shmbuffer.api.metadata import (
    BUILTIN,
    KINDS,
    EpisodeRecords,
    check_kinds,
    check_name,
    check_values,
)
from shmbuffer.errors import InvalidArgumentError
from shmbuffer.registry.intervals import Episode
from shmbuffer.registry.query import Column, Where, parse_order, parse_where
from shmbuffer.ring.listeners import F64, Range, RingListener
from shmbuffer.ring.members import Members
from shmbuffer.ring.ring import Ring
from shmbuffer.ring.subset import Subset
from shmbuffer.ring.table import Table

__all__ = ["BUILTIN", "KINDS", "EpisodeMeta", "EpisodeRecords"]

I64 = npt.NDArray[np.int64]
#: A str is kept as a code: an index into its name's strings, each kept once (a filter then
#: compares the few strings, not one per episode: ``registry/query.py``'s coded columns).
_DTYPES = {"int": np.int64, "float": np.float64, "bool": np.bool_, "str": np.int32}
_MIN_SLOTS = 64


class _Columns(Mapping[str, Column]):
    """The columns a filter reads, over positions ``[lo, hi)``; ``id`` built only if read."""

    def __init__(self, meta: EpisodeMeta, lo: int, hi: int) -> None:
        self._meta, self._lo, self._hi = meta, lo, hi

    def __getitem__(self, name: str) -> Column:
        meta, lo, hi = self._meta, self._lo, self._hi
        if name == "id":
            ids = np.arange(meta.base + lo, meta.base + hi, dtype=np.int64)
            return Column(ids, np.ones(hi - lo, dtype=bool))
        values, present = meta._values[name][lo:hi], meta._present[name][lo:hi]
        return Column(values, present, meta._strings.get(name))

    def __iter__(self) -> Iterator[str]:
        return iter(["id", *self._meta._values])

    def __len__(self) -> int:
        return 1 + len(self._meta._values)


class EpisodeMeta(RingListener):
    """The metadata of ``ring``'s episodes; see the module docstring. ``declared``: name ->
    kind of every name a writer may attach (None: taken as they come)."""

    def __init__(self, ring: Ring, declared: Mapping[str, str] | None = None) -> None:
        self.ring = ring
        self.declared = declared is not None
        self._kinds: dict[str, str] = check_kinds(declared or {})
        self.last_commit_time = 0.0
        #: The writer the next commit records for its episodes (the owner sets it just before
        #: the commit; the commit takes it): cheaper than an attach after it.
        self.next_writer: str | None = None
        self._where: Where | None = None  # the last filter parsed, reused while it is asked
        #: Counts the changes that make a kept selection stale (a restore, a clear, a load):
        #: one kept across draws (``ring/bounds.py``) starts over when it moved.
        self.epoch = 0
        self._standing: dict[str, _Standing] = {}  # the filters draws were made with, by text
        self.on_load()  # the episodes live already: their lengths (nothing else was kept)
        ring.listen(self)

    # -- storage ----------------------------------------------------------------------------

    @property
    def base(self) -> int:
        """The episode id at position 0."""
        return self._base

    @property
    def kinds(self) -> dict[str, str]:
        """Every name and its kind, the buffer's own included."""
        return {**BUILTIN, **self._kinds}

    def _reset(self, base: int) -> None:
        self._base, self._size = base, 0
        self._alive = np.zeros(_MIN_SLOTS, dtype=bool)
        self._starts = np.zeros(_MIN_SLOTS, dtype=np.int64)
        self._values: dict[str, np.ndarray] = {}
        self._present: dict[str, np.ndarray] = {}
        self._strings: dict[str, np.ndarray] = {}  # a str name's strings, by code
        self._codes: dict[str, dict[str, int]] = {}  # and their codes
        for name, kind in {**BUILTIN, **self._kinds}.items():
            if name != "id":
                self._add_column(name, kind)

    def _add_column(self, name: str, kind: str) -> None:
        slots = len(self._alive)
        self._values[name] = np.zeros(slots, dtype=_DTYPES[kind])
        self._present[name] = np.zeros(slots, dtype=bool)
        if kind == "str":
            self._strings[name] = np.empty(0, dtype=object)
            self._codes[name] = {}

    def _cover(self, last_id: int) -> None:
        """Positions up to ``last_id``'s: drop a dead front half first, then grow."""
        need = last_id - self._base + 1
        if need <= self._size:
            return
        if need > len(self._alive):
            self._drop_dead_front()
            need = last_id - self._base + 1
        if need > len(self._alive):
            slots = max(need, 2 * len(self._alive))
            self._alive = _grown(self._alive, slots)
            self._starts = _grown(self._starts, slots)
            for name in self._values:
                self._values[name] = _grown(self._values[name], slots)
                self._present[name] = _grown(self._present[name], slots)
        self._size = max(self._size, need)

    def _drop_dead_front(self) -> None:
        """Forget the entries before the oldest live one, once they are half the span, but
        none an open reservation evicted: its abort may publish them again."""
        live = self._alive[: self._size]
        first = int(live.argmax()) if live.any() else self._size
        for reservation in self.ring.reservations.values():
            for ep in (*reservation.evicted, *reservation.trimmed):
                first = min(first, max(ep.id - self._base, 0))
        if first * 2 < self._size or first == 0:
            return
        keep = self._size - first
        for array in (self._alive, self._starts, *self._values.values(), *self._present.values()):
            array[:keep] = array[first : self._size]
            array[keep : self._size] = 0
        self._base += first
        self._size = keep

    # -- values ------------------------------------------------------------------------------

    def check(self, meta: Mapping[str, Any] | None) -> dict[str, Any]:
        """``meta`` as :meth:`attach` stores it: plain scalars, each of its name's kind.
        InvalidArgumentError naming the name for a value that is not a scalar, or not of
        the kind declared or first given, or a name not declared
        (:func:`~shmbuffer.api.metadata.check_values`); nothing stored changes (a new name's
        kind is fixed here, by its first value, so that :meth:`attach`, after a commit,
        cannot fail)."""
        out, new = check_values(meta, self._kinds, self.declared)
        for name, kind in new.items():
            self._kinds[name] = kind
            self._add_column(name, kind)
        return out

    def attach(
        self,
        ids: Sequence[int],
        meta: Mapping[str, Any],
        writer: str | None = None,
        commit_time: float | None = None,
    ) -> None:
        """Store ``meta`` (as :meth:`check` returned it) for the episodes ``ids`` the last
        commit published, the ``writer`` that wrote them and, replaying a journal, the
        ``commit_time`` of their live commit."""
        if not ids or not (meta or writer is not None or commit_time is not None):
            return
        # One episode (a commit's usual case): a plain index, no array built per name.
        positions: Any = ids[0] - self._base if len(ids) == 1 else np.asarray(ids) - self._base
        values = {**meta}
        if writer is not None:
            values["writer"] = writer
        if commit_time is not None:
            values["commit_time"] = commit_time
        for name, value in values.items():  # every name has its column: check() made it
            self._values[name][positions] = (
                self._code(name, value) if name in self._codes else value
            )
            self._present[name][positions] = True

    def _code(self, name: str, value: str) -> int:
        codes = self._codes[name]
        code = codes.get(value)
        if code is None:
            code = codes[value] = len(codes)
            self._strings[name] = np.append(self._strings[name], np.array([value], dtype=object))
        return code

    def _decoded(self, name: str, codes: np.ndarray) -> np.ndarray:
        strings = self._strings.get(name)
        if strings is None:
            return codes
        if not len(strings):  # no value yet: every entry is masked
            return np.full(len(codes), "", dtype=object)
        decoded: np.ndarray = strings[codes]
        return decoded

    # -- the ring's news -----------------------------------------------------------------------

    def on_commit(
        self,
        episodes: Sequence[Episode],
        ranges: Sequence[Range],
        priority: F64 | None,
        members: Members = None,
    ) -> None:
        self._cover(episodes[-1].id)
        self.last_commit_time = now = time.time()  # the daemon journals it with the commit
        for ep in episodes:
            self._live(ep, now)
        writer, self.next_writer = self.next_writer, None
        if writer is not None:
            code = self._code("writer", writer)
            first, last = episodes[0].id - self._base, episodes[-1].id - self._base
            if first == last:  # one episode, the usual commit: no slice
                self._values["writer"][first] = code
                self._present["writer"][first] = True
            else:
                self._values["writer"][first : last + 1] = code
                self._present["writer"][first : last + 1] = True

    def _live(self, ep: Episode, now: float | None = None) -> None:
        i = ep.id - self._base
        self._alive[i] = True
        self._starts[i] = ep.start
        self._values["length"][i] = ep.end - ep.start
        self._present["length"][i] = True
        if now is not None:
            self._values["commit_time"][i] = now
            self._present["commit_time"][i] = True

    def on_evict(self, start: int, stop: int, evicted: Sequence[Episode], rows: int) -> None:
        base = self._base
        for ep in evicted:
            if ep.id >= base:
                self._alive[ep.id - base] = False
        if self.ring.unit == "transition":  # a chunk the range trimmed at its front
            trimmed = self.ring.registry.starting_at(stop)
            if (
                trimmed is not None
                and trimmed.id >= base
                and self._starts[trimmed.id - base] != stop
            ):
                self._live(trimmed)
                self._forget_standing("length")  # its length changed

    def on_restore(self, episodes: Sequence[Episode], rows: int) -> None:
        self.epoch += 1
        self._forget_standing()  # they may have forgotten these ids once they were dead
        for ep in episodes:
            if ep.id >= self._base:  # the entries in front of base were dropped: none held
                self._cover(ep.id)
                self._live(ep)

    def _forget_standing(self, name: str | None = None) -> None:
        """Drop the standing filters (that read ``name``): their next draw tests afresh."""
        for text, standing in list(self._standing.items()):
            if name is None or name in standing.where.names:
                del self._standing[text]

    def on_clear(self, rows: int) -> None:
        self.epoch += 1
        self._reset(self.ring.registry.next_id)
        self._standing.clear()

    def on_load(self) -> None:
        """A saved ring: its episodes live again, with their lengths (a saved ring holds no
        metadata: the values attached before are not brought back)."""
        registry = self.ring.registry
        episodes = list(registry)
        self._reset(episodes[0].id if episodes else registry.next_id)
        self._standing = {}
        self.epoch += 1
        if episodes:
            self._cover(episodes[-1].id)
            for ep in episodes:
                self._live(ep)

    # -- saving --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The live episodes' values, for a snapshot or a checkpoint: the names' kinds, the
        live ids and, per name, its values (a string's as codes, with the strings) and where
        they are present, as bytes. ``length`` is the registry's and is left out."""
        positions = np.flatnonzero(self._alive[: self._size])
        columns: dict[str, Any] = {}
        for name, values in self._values.items():
            if name == "length":
                continue
            present = self._present[name][positions]
            column: dict[str, Any] = {
                "values": np.ascontiguousarray(values[positions]).tobytes(),
                "present": np.packbits(present).tobytes(),
            }
            if name in self._strings:
                column["strings"] = self._strings[name].tolist()
            columns[name] = column
        ids = (positions + self._base).astype("<i8")
        return {
            "kinds": dict(self._kinds),
            "declared": self.declared,
            "ids": ids.tobytes(),
            "columns": columns,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take the values :meth:`state_dict` saved, for the episodes live now (the ring is
        loaded first: the registry decides which episodes live, and their lengths).
        ValueError for a name saved with another kind than this one keeps."""
        self.declared = self.declared or bool(state.get("declared", False))
        for name, kind in state["kinds"].items():
            known = self._kinds.get(name)
            if known is None:
                check_name(name)
                if kind not in KINDS:
                    raise ValueError(f"metadata {name!r}: saved kind {kind!r}")
                self._kinds[name] = kind
                self._add_column(name, kind)
            elif known != kind:
                raise ValueError(f"metadata {name!r} was saved as {kind}, is declared {known}")
        ids = np.frombuffer(state["ids"], dtype="<i8").astype(np.int64)
        positions = ids - self._base
        keep = (positions >= 0) & (positions < self._size)
        keep[keep] = self._alive[positions[keep]]
        at = positions[keep]
        for name, column in state["columns"].items():
            if name not in self._values or name == "length":
                raise ValueError(f"saved metadata {name!r} has no kind")
            values = np.frombuffer(column["values"], dtype=self._values[name].dtype)
            present = np.unpackbits(np.frombuffer(column["present"], np.uint8), count=len(ids))
            if len(values) != len(ids):
                raise ValueError(f"saved metadata {name!r}: {len(values)} values, {len(ids)} ids")
            if name in self._strings:
                strings = list(column.get("strings", []))
                self._strings[name] = np.array(strings, dtype=object)
                self._codes[name] = {text: code for code, text in enumerate(strings)}
            self._values[name][at] = values[keep]
            self._present[name][at] = present[keep].astype(bool)
        self._standing.clear()

    # -- queries -------------------------------------------------------------------------------

    def parsed(self, where: str) -> Where:
        """``where`` parsed (QueryError, with the position, if it does not parse)."""
        if not isinstance(where, str):
            raise InvalidArgumentError(f"where must be a str (a filter), got {where!r}")
        if self._where is None or self._where.text != where:
            self._where = parse_where(where)
        return self._where

    def subset(self, where: str, table: Table) -> Subset:
        """The episodes ``where`` selects, for ``table`` to draw from (``among``). A filter
        drawn with again is a standing one: only the episodes committed since its last draw
        are tested, so a draw costs O(episodes it selects), not O(live episodes)."""
        standing = self._standing.pop(where, None) or _Standing(self.parsed(where), self._base)
        self._standing[where] = standing  # the most recent last; the oldest beyond 8 goes
        if len(self._standing) > _STANDING:
            del self._standing[next(iter(self._standing))]
        return self.among(standing.update(self) - self._base, table, f"where={where!r}")

    def among(self, positions: I64 | None, table: Table, what: str) -> Subset:
        """The live episodes at ``positions`` (None: every live one) that ``table`` holds
        and its bounds keep, for it to draw from (``what`` selected them, for its messages).
        For a table that holds only some episodes, O(span) more, to find its own."""
        factor = None
        held = None  # which positions hold an episode of the table, where it holds not all
        if not table.holds_all:
            size = self._size
            held = table.holding(np.arange(self._base, self._base + size, dtype=np.int64))
            if positions is not None:
                positions = positions[held[positions]]
        if table.bounds is not None:
            positions, factor = table.bounds.restrict(self, positions, held)
        elif positions is None:
            live = self.live()
            positions = np.flatnonzero(live if held is None else live & held)
        starts = self._starts[positions]
        ends = starts + self._values["length"][positions]
        return table.filtered(positions + self._base, starts, ends, what, factor)

    def live(self) -> npt.NDArray[np.bool_]:
        """Whether the entry at each position ``[0, span)`` is live (a view: do not write)."""
        return self._alive[: self._size]

    def column(self, name: str) -> tuple[np.ndarray, npt.NDArray[np.bool_]]:
        """The values of ``name`` at each position ``[0, span)`` and whether each has one
        (views: do not write); KeyError for a name not kept."""
        return self._values[name][: self._size], self._present[name][: self._size]

    def require(self, name: str, kind: str, why: str) -> None:
        """Keep ``name`` as ``kind`` from now on, for ``why`` (a table's bounds read it):
        declared already as that kind, or taken now if names are taken lazily (a value of
        another kind is then refused with the name). InvalidArgumentError, saying ``why``,
        for a name declared or given with another kind, or not declared."""
        known = self._kinds.get(name)
        if known == kind:
            return
        if known is not None:
            raise InvalidArgumentError(
                f"{why} reads metadata {name!r} as {kind}, but it holds {known} values"
            )
        if self.declared:
            raise InvalidArgumentError(
                f"{why} reads metadata {name!r} ({kind}): declare it (meta={{{name!r}: "
                f"{kind!r}, ...}})"
            )
        self._kinds[name] = kind
        self._add_column(name, kind)

    def matching(self, where: Where | None) -> I64:
        """Positions of the live episodes ``where`` selects (all live ones for None), in id
        order; QueryError for a name no episode has or a comparison of mismatched kinds."""
        size = self._size
        mask = self._alive[:size]
        if where is not None:
            mask = mask & where.mask(_Columns(self, 0, size), size)
        return np.flatnonzero(mask)

    def bounds(self, where: Where | None) -> tuple[I64, I64, I64]:
        """``(ids, starts, ends)`` of the live episodes ``where`` selects, in id order."""
        positions = self.matching(where)
        starts = self._starts[positions]
        return positions + self._base, starts, starts + self._values["length"][positions]

    def select(
        self,
        where: Where | None = None,
        order_by: str | None = None,
        limit: int | None = None,
        names: Sequence[str] | None = None,
    ) -> EpisodeRecords:
        """The live episodes ``where`` selects, ordered by ``order_by`` (``"-return"``:
        descending; episodes without the value last; ties and None: oldest first), at most
        ``limit``, with the values of ``names`` (None: every name)."""
        positions = self.matching(where)
        if order_by is not None:
            name, descending = parse_order(order_by)
            if name not in self.kinds:
                raise InvalidArgumentError(
                    f"order_by: no metadata named {name!r} (known: {', '.join(sorted(self.kinds))})"
                )
            positions = self._ordered(positions, name, descending)
        if limit is not None:
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
                raise InvalidArgumentError(f"limit must be an int >= 0, got {limit!r}")
            positions = positions[:limit]
        wanted = list(self.kinds) if names is None else list(names)
        unknown = [name for name in wanted if name not in self.kinds]
        if unknown:
            raise InvalidArgumentError(
                f"no metadata named {unknown[0]!r} (known: {', '.join(sorted(self.kinds))})"
            )
        ids = positions + self._base
        columns: dict[str, np.ma.MaskedArray] = {}
        for name in wanted:
            if name == "id":
                columns[name] = np.ma.MaskedArray(ids, mask=np.zeros(len(ids), dtype=bool))
            else:
                values, present = self._values[name][positions], self._present[name][positions]
                columns[name] = np.ma.MaskedArray(self._decoded(name, values), mask=~present)
        return EpisodeRecords(ids, columns)

    def _ordered(self, positions: I64, name: str, descending: bool) -> I64:
        if name == "id":
            return positions[::-1] if descending else positions
        values, present = self._values[name][positions], self._present[name][positions]
        has, missing = positions[present], positions[~present]
        keys = values[present]
        strings = self._strings.get(name)
        if strings is not None and len(strings):  # codes ranked by their strings' order
            rank = np.empty(len(strings), dtype=np.int64)
            rank[np.argsort(strings, kind="stable")] = np.arange(len(strings))
            keys = rank[keys]
        if keys.dtype == np.float64:  # NaN sorts last either way, as a missing value does
            nan = np.isnan(keys)
            missing = np.concatenate([has[nan], missing])
            has, keys = has[~nan], keys[~nan]
        order = np.argsort(keys, kind="stable")
        if descending:  # stable descending: reverse the ascending order of the reversed keys
            order = len(keys) - 1 - np.argsort(keys[::-1], kind="stable")[::-1]
        return np.concatenate([has[order], missing]).astype(np.int64)

    def stats(self) -> dict[str, Any]:
        return {"names": self.kinds, "span": self._size}


class _Standing:
    """A filter draws are made with again and again, and the ids it selected so far: each
    update tests only the entries added since (an entry's values never change after its
    commit) and drops those no longer live."""

    def __init__(self, where: Where, first_id: int) -> None:
        self.where = where
        self.ids = np.empty(0, dtype=np.int64)
        self.upto = first_id  # every id below it was tested

    def update(self, meta: EpisodeMeta) -> I64:
        """The live ids it selects now, in id order."""
        base, end = meta.base, meta.base + meta._size
        if self.upto < end:
            lo = max(self.upto, base) - base
            hi = end - base
            found = np.flatnonzero(self.where.mask(_Columns(meta, lo, hi), hi - lo)) + lo + base
            self.ids = np.concatenate([self.ids, found])
            self.upto = end
        ids = self.ids[self.ids >= base]
        live = ids[meta._alive[ids - base]]
        if live.size * 2 < self.ids.size:  # forget the dead once they are half of it
            self.ids = live
        return live


#: Filters kept standing at once (:meth:`EpisodeMeta.subset`).
_STANDING = 8


def _grown(array: np.ndarray, slots: int) -> np.ndarray:
    grown = np.zeros(slots, dtype=array.dtype)
    grown[: len(array)] = array
    return grown
