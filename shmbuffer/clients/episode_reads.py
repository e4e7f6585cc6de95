"""A reader's whole episodes: ``sample_episodes`` and the life of the lease behind its views.

Locally the episodes are handed out as zero-copy views of the shared rows under a lease that
keeps writers off them until the block exits; a ticker thread renews it every
``lease_ttl / 3`` seconds while the block is open, for at most ``max_lease_hold`` seconds
(the views and the lease itself: :mod:`shmbuffer.clients.leased`). With ``out`` the leased
episodes are copied into the caller's tensors and the lease goes before the block starts. A
remote reader receives copies as payload frames and needs no lease.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from shmbuffer.api.reads import check_episode_args, check_where
from shmbuffer.clients.leased import ClientLease, EpisodeViews
from shmbuffer.clients.readerstate import ReaderState
from shmbuffer.clients.ticker import Ticker
from shmbuffer.errors import (
    NotFoundError,
    ShmBufferError,
    UnknownClientError,
)
from shmbuffer.wire.protocol import decode_i64

if TYPE_CHECKING:  # imported by the first call that touches rows (readerstate.py says why)
    from tensordict import TensorDict

    from shmbuffer.storage import rows


class EpisodeReads(ReaderState):
    """``sample_episodes`` and its leases, over the state a Reader's jobs share."""

    @contextmanager
    def sample_episodes(
        self,
        n: int,
        out: TensorDict | Mapping[str, Any] | None = None,
        where: str | None = None,
    ) -> Iterator[EpisodeViews]:
        """``n`` whole episodes drawn by the daemon's sampler, as a sequence of ``[length]``
        TensorDicts (:class:`~shmbuffer.clients.leased.EpisodeViews`: indexable, iterable,
        ``len``).

        Locally: zero-copy views of the shared rows, built when accessed, under a lease that
        keeps writers off them until the block exits, renewed while it is open (see
        ``auto_renew``). ``episodes.valid()`` says whether the lease still certainly holds;
        once it lapsed, building a view and the block's exit raise ``LeaseExpiredError``
        (data read from the views may have changed). Remotely: copies, always valid.

        ``out``: copies instead, into a preallocated TensorDict (or nested dict of tensors)
        reused across calls, as :meth:`Buffer.sample_episodes <shmbuffer.Buffer.sample_episodes>`
        takes it (each schema key a contiguous CPU tensor of the column's dtype, leading dims
        holding at least the rows drawn). Locally the episodes are copied under their lease,
        which is released before the block starts, so writers are never held back by it; the
        views are then of ``out`` and always valid. A key, dtype or shape that does not fit
        raises InvalidArgumentError naming it, before the request when the schema is known.

        ``where``: only episodes this metadata filter selects (``Reader.episodes``).

        At most ``2**20`` episodes a call (the protocol's bound on ``n``), holding at most
        ``max_payload_bytes / 16`` rows (2**27 by default); more is refused by the daemon.
        """
        n = check_episode_args(n)  # the rows are the daemon's to count: it knows the lengths
        filtered = {} if where is None else {"where": check_where(where)}
        self._ready()
        target = self._out_target(out)  # checked before anything is drawn, if possible
        if out is not None and self.packed is not None:
            self.packed.refuse_out()
        if self.remote:
            reply, frames = self._sample(kind="episodes", n=n, **filtered)
            lengths = decode_i64(reply["lengths"])
            total = int(lengths.sum())
            copy_to = None
            if out is not None:
                from shmbuffer.storage import rows

                target = target or self._out_target(out)
                assert target is not None  # the reply brought the schema
                rows.check_out_rows(target[2], lengths)
                copy_to = target[:2]
            data = self._from_frames(frames, [total], copy_to)
            offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
            columns = {f.key: data[f.key] for f in self.schema.fields} if self.schema else {}
            yield EpisodeViews(columns, decode_i64(reply["ids"]), offsets, lengths)
            return
        sent = time.monotonic()
        reply, _ = self._sample(kind="episodes", n=n, lease=True, **filtered)
        assert self.segment is not None
        ttl = float(self.conn.buffer.get("lease_ttl", 30.0))
        lease = ClientLease(int(reply["lease"]), n, ttl, sent)
        self._leases[lease.id] = lease
        ids, starts = decode_i64(reply["ids"]), decode_i64(reply["starts"])
        lengths = decode_i64(reply["lengths"])
        if out is not None:
            yield self._copy_episodes(lease, ids, starts, lengths, out, target)
            return
        if self.packed is not None:  # no views of chunks: copies (clients/packed_io.py)
            yield self._copy_packed(lease, ids, starts, lengths)
            return
        views = EpisodeViews(self.segment.columns, ids, starts, lengths, lease, self.conn)
        try:
            self._start_renewer(ttl)
            if time.monotonic() - sent > ttl / 3:  # a slow reply: restart the clock now
                lease.renew(self.conn)
            yield views
        except BaseException:  # the block's own error wins; the lease just goes
            self._end_lease(lease, quiet=True)
            raise
        self._end_lease(lease, quiet=False)

    def _out_target(self, out: Any) -> rows.OutArrays | None:
        """``out`` checked against the schema (None when there is no ``out`` or no schema
        yet: then it is checked once the reply brought the schema)."""
        if out is None or self.schema is None:
            return None
        from shmbuffer.storage import rows

        return rows.out_arrays(self.schema, out)

    def _copy_episodes(
        self,
        lease: ClientLease,
        ids: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        out: Any,
        target: rows.OutArrays | None,
    ) -> EpisodeViews:
        """Copy leased episodes into ``out`` and let the lease go: a lease that certainly held
        until the copy ended (:meth:`ClientLease.valid`) is released without waiting; else the
        release's answer decides, and LeaseExpiredError says the copy may be torn."""
        from shmbuffer.storage import rows

        assert self.segment is not None
        try:
            target = target or self._out_target(out)
            assert target is not None  # the reply brought the schema
            arrays, flat, held = target
            rows.check_out_rows(held, lengths)
            physical = rows.episode_rows(starts, lengths)
            rows.gather_columns(self.segment.columns, physical, self.segment.arrays, out=arrays)
        except BaseException:
            self._end_lease(lease, quiet=True)
            raise
        if lease.valid():
            self._leases.pop(lease.id, None)
            lease.released = True
            self._release_soon([lease.id])
        else:
            self._end_lease(lease, quiet=False)
        offsets = (np.cumsum(lengths) - lengths).astype(np.int64)
        return EpisodeViews(flat, ids, offsets, lengths)

    def _copy_packed(
        self, lease: ClientLease, ids: np.ndarray, starts: np.ndarray, lengths: np.ndarray
    ) -> EpisodeViews:
        """Leased episodes of a buffer with compressed columns, copied (their chunks with
        them) while the lease holds writers off, decompressed once it was released."""
        from shmbuffer.storage import rows

        assert self.segment is not None and self.packed is not None
        try:
            data = self._gather(rows.episode_rows(starts, lengths))
        except BaseException:
            self._end_lease(lease, quiet=True)
            raise
        self._end_lease(lease, quiet=False)  # LeaseExpiredError: the copy may be torn
        data = self.packed.expand(data)
        offsets = (np.cumsum(lengths) - lengths).astype(np.int64)
        assert self.schema is not None
        columns = {f.key: data.get(f.key) for f in self.schema.fields}
        return EpisodeViews(columns, ids, offsets, lengths)

    def _end_lease(self, lease: ClientLease, quiet: bool) -> None:
        """Release the lease; unless ``quiet``, raise LeaseExpiredError if it had lapsed."""
        self._leases.pop(lease.id, None)
        if lease.released:
            return
        if self.segment is not None:  # GPU views: kernels queued on them run before it goes
            self.segment.settle()
        # Decided here and by this release only: a renewal racing with it fails because of it.
        lapsed = lease.lapsed
        try:
            self.conn.call("release", lease=lease.id)
        except (NotFoundError, UnknownClientError):  # the daemon dropped it before we released it
            lapsed = lease.lapsed = True
        except ShmBufferError:
            if not quiet:
                raise
        finally:
            lease.released = True
        if lapsed and not quiet:
            raise lease.expired_error()

    def _start_renewer(self, ttl: float) -> None:
        if self.auto_renew and self._renewer is None:
            renew = weakref.WeakMethod(self._renew_leases)
            self._renewer = Ticker(ttl / 3, renew, "shmbuffer-renew")

    def _renew_leases(self) -> None:
        """The renewer's tick: renew every open lease still within ``max_lease_hold``. A lease
        the daemon no longer holds is marked lapsed; a daemon that does not answer is left to
        the lease's own deadline (``valid()`` turns False by itself)."""
        now = time.monotonic()
        for lease in list(self._leases.values()):
            if lease.lapsed or lease.released:
                continue
            if self.max_lease_hold is not None and now - lease.opened >= self.max_lease_hold:
                continue
            try:
                lease.renew(self.conn)
            except ShmBufferError:  # lapsed (marked so), closed, or no answer: nothing to add
                if self.conn.closed:
                    return
