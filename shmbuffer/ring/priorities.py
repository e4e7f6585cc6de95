"""A table's priorities: a write's checked before anything is reserved, an update checked and
its stale rows left out before anything changes, then applied and counted.

:class:`TablePriorities` is the part of :class:`~shmbuffer.ring.table.Table` that does this
(a base class of it, so callers keep calling ``table.check_priorities``): the checks raise
InvalidArgumentError naming what was wrong with nothing changed, so an owner (the daemon)
journals exactly what :meth:`~TablePriorities.apply_priorities` then applies.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from shmbuffer.api.reads import as_invalid_argument, check_update_args
from shmbuffer.errors import NotFoundError
from shmbuffer.registry.intervals import Episode
from shmbuffer.ring.listeners import F64
from shmbuffer.ring.ring import Ring, episode_lengths
from shmbuffer.ring.samples import PriorityUpdate
from shmbuffer.samplers import Sampler
from shmbuffer.samplers.base import Priority
from shmbuffer.samplers.index import rows_of

I64 = npt.NDArray[np.int64]


class TablePriorities:
    """Priority checks and updates over a table's ``ring`` and ``sampler``; the table sets
    both, and the counters, in its constructor."""

    ring: Ring
    sampler: Sampler
    #: Priority updates applied, and skipped because the row was overwritten since its
    #: sample (its generation stamp changed; the owner compares the stamps).
    priority_updates: int
    priority_updates_stale: int

    def check_priority(
        self, num_rows: int, episodes: int | Sequence[int], priority: Priority
    ) -> F64 | None:
        """The per-item priorities a commit of ``num_rows`` rows in ``episodes`` would store
        (None: the sampler's default for new data); InvalidArgumentError for a priority that is
        negative, NaN, of the wrong length, or given to a sampler that keeps none. Lets an owner
        refuse a bad priority before it reserves (and so evicts) anything."""
        if priority is None:
            return None
        with as_invalid_argument:
            lengths = episode_lengths(num_rows, episodes)
            return self.sampler.check_commit_priority([Episode(0, 0, n) for n in lengths], priority)

    def commit_priority(self, reservation_id: int, priority: Priority) -> F64 | None:
        """``priority`` checked for a commit of open reservation ``reservation_id``: one value
        per item (None for None); NotFoundError, InvalidArgumentError; nothing changes."""
        reservation = self.ring.reservations.get(reservation_id)
        if reservation is None:
            raise NotFoundError(f"no open reservation {reservation_id}")
        if priority is None:
            return None
        bounds = [Episode(0, s, e) for s, e in reservation.episodes]
        with as_invalid_argument:
            return self.sampler.check_commit_priority(bounds, priority)

    def commit_priorities(self, reservation_id: int, priority: Priority) -> PriorityUpdate | None:
        """What a commit of ``reservation_id`` with ``priority`` would store, as a priority
        update of the rows carrying the priorities (every row in transition unit, each
        episode's first row in episode unit): what the daemon journals to replay it. None for
        ``priority=None``; InvalidArgumentError for a bad one; nothing changes."""
        if priority is None:  # the daemon asks at every commit: a lookup and no more
            if reservation_id not in self.ring.reservations:
                raise NotFoundError(f"no open reservation {reservation_id}")
            return None
        given = self.commit_priority(reservation_id, priority)
        if given is None:
            return None
        episodes = self.ring.reservations[reservation_id].episodes
        starts = [s for s, _ in episodes]
        if self.ring.unit == "episode":
            return PriorityUpdate(np.array(starts, dtype=np.int64), given, 0)
        return PriorityUpdate(rows_of(starts, [e for _, e in episodes]), given, 0)

    def check_priorities(
        self,
        rows: npt.ArrayLike,
        priority: npt.ArrayLike,
        generation: npt.ArrayLike | None = None,
        stamps: I64 | None = None,
    ) -> PriorityUpdate:
        """Validate a priority update and leave out its stale rows; nothing changes.

        ``priority``: a scalar or one value per row. ``generation``: each row's stamp when it
        was sampled, compared with ``stamps`` (the owner's current per-row generation stamps):
        a row overwritten since is left out (``stale``), never applied to the new data.
        InvalidArgumentError for an index out of range, a negative, NaN or too large priority
        (one whose weight could overflow the sampler's sums), lengths that differ, or a
        sampler that keeps no priorities."""
        sampler = self.sampler
        index, given, seen = check_update_args(
            rows, priority, generation, self.ring.capacity, sampler.priority_limit
        )
        if not sampler.has_priorities:
            with as_invalid_argument:
                sampler.update_priorities(index, given)  # its refusal, naming it
        if seen is None:
            return PriorityUpdate(index, given, 0)
        if stamps is None:
            raise TypeError("check_priorities: generation given without stamps")
        fresh = stamps[index] == seen
        stale = int(index.size - np.count_nonzero(fresh))
        if stale:
            index, given = index[fresh], given[fresh]
        return PriorityUpdate(index, given, stale)

    def apply_priorities(self, update: PriorityUpdate) -> int:
        """Apply a checked update; return how many rows it set (rows holding no data are
        skipped) and count its stale rows in ``priority_updates_stale``."""
        with as_invalid_argument:  # checked already: not validated twice
            applied = self.sampler.set_priorities(update.rows, update.priority)
        self.priority_updates += applied
        self.priority_updates_stale += update.stale
        return applied

    def update_priorities(
        self,
        rows: npt.ArrayLike,
        priority: npt.ArrayLike,
        generation: npt.ArrayLike | None = None,
        stamps: I64 | None = None,
    ) -> int:
        """:meth:`check_priorities` then :meth:`apply_priorities`: set the priority of the
        items holding physical ``rows``; return how many were applied. The daemon calls the
        two halves apart, to journal exactly what it applies."""
        return self.apply_priorities(self.check_priorities(rows, priority, generation, stamps))
