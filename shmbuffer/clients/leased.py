"""The reader's side of leases: the episode views ``Reader.sample_episodes`` hands out, whether
their lease still holds, and the thread that renews it.

A lease protects views only while the daemon holds it, and the daemon drops one that is not
renewed within ``lease_ttl`` seconds (a dead reader must not stall writers). Three things keep
a live reader's views safe and a lapsed one detectable:

* **Views cost O(1) per call.** :class:`EpisodeViews` builds each episode's view when it is
  accessed (one slice per column), not all of them before the block starts: building
  2**20 TensorDict views up front took longer than the lease TTL.
* **Renewal.** While a block is open a ticker thread of the reader sends ``renew``
  every ``lease_ttl / 3`` seconds, for at most ``max_lease_hold`` seconds per lease (so a hung
  learner cannot stall writers forever); ``EpisodeViews.renew()`` is the explicit heartbeat.
* **Staleness is detectable.** :class:`ClientLease` keeps a conservative deadline: the send time
  of the last acknowledged grant or renewal plus the TTL. The daemon granted (renewed) the lease
  after that send, so before the deadline the lease certainly holds. Past it, or once the
  daemon said the lease is gone, ``valid()`` is False, building a view raises
  :class:`LeaseExpiredError`, and so does the block's exit.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, overload

import numpy as np

from shmbuffer.clients.connection import Connection
from shmbuffer.errors import LeaseExpiredError, NotFoundError, UnknownClientError

if TYPE_CHECKING:  # imported by the first view (a Reader imports neither before it attaches)
    from tensordict import TensorDict

Key = tuple[str, ...]


class ClientLease:
    """One lease as its reader sees it. Not thread-safe by itself: the reader's renewer and the
    caller's thread only ever set ``valid_until`` forward or mark it ``lapsed``."""

    def __init__(self, lease_id: int, episodes: int, ttl: float, sent: float) -> None:
        self.id = lease_id
        self.episodes = episodes
        self.ttl = ttl
        self.opened = sent
        self.valid_until = sent + ttl  # the daemon granted it after ``sent``
        self.lapsed = False  # the daemon said it is gone (expired) before we released it
        self.released = False

    def valid(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return not (self.lapsed or self.released) and now < self.valid_until

    def renew(self, conn: Connection) -> None:
        """Renew now (one round trip). Raises :class:`LeaseExpiredError` if the daemon no
        longer holds the lease: its rows may have been overwritten."""
        if self.released or self.lapsed:
            raise self.expired_error()
        sent = time.monotonic()
        try:
            reply = conn.call("renew", lease=self.id)
        except (NotFoundError, UnknownClientError) as exc:
            if not self.released:  # else the block's own release, just before, removed it
                self.lapsed = True
            raise self.expired_error() from exc
        self.valid_until = max(self.valid_until, sent + float(reply.get("ttl", self.ttl)))

    def expired_error(self) -> LeaseExpiredError:
        if self.released and not self.lapsed:
            return LeaseExpiredError(
                f"lease {self.id} was released (its block exited, or the Reader was closed): "
                "its views are no longer protected from writers; copy what must outlive the "
                "block"
            )
        return LeaseExpiredError(
            f"lease {self.id} lapsed: it was not renewed within the daemon's lease_ttl of "
            f"{self.ttl:g}s, so writers may have overwritten the rows of its {self.episodes} "
            "episode views and data read from them may have changed. Keep the Reader's "
            "auto_renew on, call episodes.renew() more often than every lease_ttl, or copy "
            "what must outlive the block"
        )


class EpisodeViews(Sequence["TensorDict"]):
    """The episodes of one ``sample_episodes`` call, a sequence (like a list) whose item ``i``
    is episode ``i`` as a ``[length_i]`` TensorDict, built when accessed.

    Locally each item is a zero-copy view of the shared rows, safe from writers while
    :meth:`valid` is True; remotely it is a slice of one copy and always valid. ``ids``,
    ``starts`` and ``lengths`` are the episodes' ids, first rows (physical, or in the copy) and
    lengths, as int64 arrays.
    """

    def __init__(
        self,
        columns: dict[Key, Any],
        ids: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        lease: ClientLease | None = None,
        conn: Connection | None = None,
    ) -> None:
        # Imported by the attach that gave these columns, so a lookup; bound once here, not
        # per view (an import statement per view was a twentieth of a view's cost).
        from shmbuffer.storage.rows import nest

        self._nest = nest
        self._columns = columns
        self.ids, self.starts, self.lengths = ids, starts, lengths
        self._lease = lease
        self._conn = conn

    @property
    def lease(self) -> int | None:
        """The lease id (None for copies, which need none)."""
        return None if self._lease is None else self._lease.id

    def valid(self) -> bool:
        """Whether the lease certainly still holds: no writer can have touched these rows.
        Check it after reading from views you kept, to know that what you read is whole."""
        return self._lease is None or self._lease.valid()

    def renew(self) -> None:
        """Heartbeat: renew the lease now for another ``lease_ttl``. Raises
        :class:`LeaseExpiredError` if it already lapsed. A no-op for copies."""
        if self._lease is not None:
            assert self._conn is not None
            self._lease.renew(self._conn)

    def __len__(self) -> int:
        return len(self.starts)

    @overload
    def __getitem__(self, index: int) -> TensorDict: ...

    @overload
    def __getitem__(self, index: slice) -> list[TensorDict]: ...

    def __getitem__(self, index: int | slice) -> TensorDict | list[TensorDict]:
        if isinstance(index, slice):
            return [self._view(i) for i in range(*index.indices(len(self)))]
        i = range(len(self))[index]  # IndexError, negative indices, as a list does
        return self._view(i)

    def __iter__(self) -> Iterator[TensorDict]:
        for i in range(len(self)):
            yield self._view(i)

    def _view(self, i: int) -> TensorDict:
        if self._lease is not None and not self._lease.valid():
            raise self._lease.expired_error()
        start, length = int(self.starts[i]), int(self.lengths[i])
        cut = {key: column[start : start + length] for key, column in self._columns.items()}
        return self._nest(cut, [length])

    def __repr__(self) -> str:
        state = "copies" if self._lease is None else f"lease {self._lease.id}"
        return f"EpisodeViews({len(self)} episodes, {state}, valid={self.valid()})"
