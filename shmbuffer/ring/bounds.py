"""A table's bounds: which live episodes it draws from at all, by age and by policy version.

A table may draw only from the newest ``max_episodes`` live episodes (a small "recent" table:
in transition unit an entry is a written chunk), and only from episodes whose
``policy_version`` lags the newest committed one by at most ``max_staleness`` (or by a lag
``staleness_weights`` weighs, each lag's episodes drawn in proportion to its weight):
``api/tables.py`` declares and checks the options (:class:`~shmbuffer.api.tables.Bounds`),
:class:`TableBounds` applies them. Every draw of a bounded table, with a ``where=`` or without,
goes through the selection (:meth:`~shmbuffer.ring.meta.EpisodeMeta.among`), drawn as its
sampler would draw over it (``ring/subset.py``): so only uniform and prioritized tables that
consume nothing take bounds.

The lag of an episode is ``newest - policy_version``, where ``newest`` is the largest
``policy_version`` committed since the metadata started (or was cleared or loaded): the
policy the learner is at, as its actors report it. An episode without a ``policy_version`` has
no lag and is never drawn by a table bounded by staleness.

Cost per draw: O(N) for ``max_episodes=N`` (its window is the tail of the metadata's span);
O(episodes kept) for staleness alone, whose selection is kept across draws (the ids at or above
the floor; each draw tests only the entries committed since, and drops those the rising floor
or an eviction let go); with a ``where=``, O(episodes it selects) more.

Not thread-safe: the ring's owner serialises calls, as the listener contract says.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from shmbuffer.api.tables import POLICY_VERSION, Bounds
from shmbuffer.errors import InvalidArgumentError
from shmbuffer.ring.subset import Subset

__all__ = ["LAG_BUCKETS", "TableBounds"]

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]
#: ``stats()`` counts live episodes per lag up to this one, the rest together.
LAG_BUCKETS = 4


class Metadata(Protocol):
    """What the bounds read of the episodes' metadata (``ring/meta.py``'s ``EpisodeMeta``,
    which imports this module, so it is named by what it does here)."""

    @property
    def base(self) -> int: ...

    epoch: int

    def live(self) -> npt.NDArray[np.bool_]: ...

    def column(self, name: str) -> tuple[np.ndarray, npt.NDArray[np.bool_]]: ...

    def require(self, name: str, kind: str, why: str) -> None: ...

    def among(self, positions: I64 | None, table: Any, what: str) -> Subset: ...


class TableBounds:
    """``bounds`` applied to the draws of table ``name`` (None: the only one) over the
    metadata it is bound to (:meth:`bind`); see the module docstring."""

    def __init__(self, bounds: Bounds, name: str | None = None) -> None:
        self.bounds = bounds
        self.name = name
        self.meta: Metadata | None = None
        lag = bounds.max_lag
        self._weights = None
        if bounds.staleness_weights is not None:
            self._weights = np.asarray(bounds.staleness_weights, dtype=np.float64)
        self._lag = lag
        parts = [f"{k}={v}" for k, v in vars(bounds).items() if v is not None]
        table = "the table" if name is None else f"table {name!r}"
        #: What selected a bounded draw's episodes, for its messages.
        self.what = f"{table}'s bounds ({', '.join(parts)})"
        self._reset(-1)

    def _reset(self, epoch: int) -> None:
        self._epoch = epoch
        self._newest: int | None = None  # the largest policy_version committed
        self._seen = -1  # ids below it were read for the newest
        self._kept = np.empty(0, dtype=np.int64)  # ids at or above the floor, ascending
        self._tested = -1  # ids below it were tested against the floor
        self._floor: int | None = None

    def bind(self, meta: Metadata) -> None:
        """Read the episodes' metadata from ``meta`` (the ring's), which keeps
        ``policy_version`` as an int from now on if staleness bounds the table
        (InvalidArgumentError if it holds another kind, or is declared without it)."""
        if self._lag is not None:
            meta.require(POLICY_VERSION, "int", self.what)
        self.meta = meta
        self._reset(-1)

    def subset(self, table: Any) -> Subset:
        """What a draw of ``table`` without ``where=`` is made over: every live episode the
        bounds keep."""
        if self.meta is None:
            raise InvalidArgumentError(
                f"{self.what} read the episodes' metadata, which this buffer does not keep"
            )
        return self.meta.among(None, table, self.what)

    # -- the selection -----------------------------------------------------------------------

    def restrict(
        self, meta: Metadata, positions: I64 | None, held: npt.NDArray[np.bool_] | None = None
    ) -> tuple[I64, F64 | None]:
        """The positions among ``positions`` (None: every live one; ``held``: only those it
        marks, the table's own episodes where it holds only some) the bounds keep, in id
        order, and each one's weight (None: 1 each). ``max_episodes`` counts the newest of the
        table's own; the newest ``policy_version`` is the ring's."""
        self._catch_up(meta)
        size = len(meta.live())
        if self.bounds.max_episodes is not None:
            live = meta.live() if held is None else meta.live() & held
            newest = _newest_live(live, self.bounds.max_episodes)
            if positions is None:
                positions = newest
            elif newest.size:
                positions = positions[positions >= newest[0]]
            else:
                positions = newest
        if self._lag is None:
            if positions is None:  # not reached: a bound of some kind is always given
                positions = np.flatnonzero(meta.live() if held is None else meta.live() & held)
            return positions, None
        if self._newest is None:
            return np.empty(0, dtype=np.int64), None if self._weights is None else np.empty(0)
        floor = self._newest - self._lag
        values, present = meta.column(POLICY_VERSION)
        if positions is None:
            positions = self._at_or_above(meta, floor, values, present, size)
            if held is not None:
                positions = positions[held[positions]]
        else:
            positions = positions[present[positions] & (values[positions] >= floor)]
        if self._weights is None:
            return positions, None
        return positions, self._weights[self._newest - values[positions]]

    def _catch_up(self, meta: Metadata) -> None:
        """The newest policy_version, reading only the entries committed since the last draw
        (an entry's values never change after its commit); all of them after a restore, a
        clear or a load."""
        if self._epoch != meta.epoch:
            self._reset(meta.epoch)
        if self._lag is None:
            return
        values, present = meta.column(POLICY_VERSION)
        lo = max(self._seen - meta.base, 0)
        if lo < len(values):
            fresh = values[lo:][present[lo:]]
            if fresh.size:
                top = int(fresh.max())
                self._newest = top if self._newest is None else max(self._newest, top)
            self._seen = meta.base + len(values)

    def _at_or_above(
        self, meta: Metadata, floor: int, values: np.ndarray, present: np.ndarray, size: int
    ) -> I64:
        """Positions of the live episodes at or above ``floor``, kept across draws: only the
        entries added since are tested, and the kept ones again only when the floor rose."""
        base = meta.base
        kept = self._kept
        if self._floor is not None and floor > self._floor and kept.size:
            kept = kept[kept >= base]
            kept = kept[values[kept - base] >= floor]
        self._floor = floor
        lo = max(self._tested - base, 0)
        if lo < size:
            new = np.flatnonzero(present[lo:size] & (values[lo:size] >= floor)) + lo + base
            kept = np.concatenate([kept, new])
            self._tested = base + size
        kept = kept[kept >= base]
        live = kept[meta.live()[kept - base]]
        self._kept = live if live.size * 2 < kept.size else kept  # forget the dead in bulk
        return live - base

    # -- status ------------------------------------------------------------------------------

    def stats(self, table: Any = None) -> dict[str, Any]:
        """The options, and with staleness the newest policy_version and the live episodes per
        lag (``"0"`` .. ``"3"``, ``"4+"``; ``"none"``: without a policy_version): those of
        ``table`` where it holds only some."""
        out: dict[str, Any] = {k: v for k, v in vars(self.bounds).items() if v is not None}
        meta = self.meta
        if meta is None or self._lag is None:
            return out
        self._catch_up(meta)
        values, present = meta.column(POLICY_VERSION)
        live = meta.live()
        if table is not None and not table.holds_all:
            live = live & table.holding(np.arange(meta.base, meta.base + len(live)))
        out["newest_policy_version"] = self._newest
        lags = {str(lag): 0 for lag in range(LAG_BUCKETS)}
        lags[f"{LAG_BUCKETS}+"] = 0
        lags["none"] = int(np.count_nonzero(live & ~present))
        if self._newest is not None:
            lag = self._newest - values[live & present]
            counts = np.bincount(np.minimum(lag, LAG_BUCKETS), minlength=LAG_BUCKETS + 1)
            for bucket, count in zip(lags, counts.tolist(), strict=False):
                lags[bucket] = count
        out["lags"] = lags
        return out


def _newest_live(live: npt.NDArray[np.bool_], n: int) -> I64:
    """Positions of the newest ``n`` live entries (fewer if fewer live), ascending: a window
    at the tail of the span, widened while dead entries leave it short."""
    size = len(live)
    width = n
    while True:
        lo = max(size - width, 0)
        positions = np.flatnonzero(live[lo:]) + lo
        if positions.size >= n or lo == 0:
            return positions[-n:]
        width *= 2
