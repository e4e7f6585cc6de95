"""Readers: learner processes that sample a daemon's buffer.

The daemon picks the rows (one small reply: indices and generation stamps); the reader copies
them straight out of shared memory with one gather, then checks the stamps: rows a writer
started to overwrite in between are sampled again, so a copy is never torn. Episodes are
handed out as zero-copy views under a lease that keeps writers off them until released; the
reader renews it while the block is open (:mod:`shmbuffer.clients.leased`). A remote reader
(``remote=True``) receives the rows as frames instead.
"""

from __future__ import annotations

import operator
import os
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from shmbuffer import rows
from shmbuffer.clients.connection import Connection
from shmbuffer.clients.leased import ClientLease, EpisodeViews, Renewer
from shmbuffer.errors import (
    EmptyBufferError,
    NotFoundError,
    ShmBufferError,
    TornReadError,
    UnknownClientError,
)
from shmbuffer.protocol import decode_i64
from shmbuffer.schema import Schema
from shmbuffer.segment import Segment

MAX_RESAMPLES = 8


def _count(value: Any, name: str) -> int:
    """``value`` as a Python int (msgpack cannot send ``np.int64``); Buffer takes the same."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None


class Reader:
    """Samples the buffer served by a daemon.

    Args:
        target: a buffer name (found through its runtime file) or an endpoint.
        remote: receive rows over the socket instead of reading shared memory.
        timeout: seconds any single wait on the daemon may take.
        prefetch: request the indices of the next ``sample``/``sample_slices`` (same size)
            while the caller works on this one.
        auto_renew: while a ``sample_episodes`` block is open, renew its lease from a thread
            every ``lease_ttl / 3`` seconds (the daemon's TTL, 30 s by default).
        max_lease_hold: seconds a lease is renewed automatically (None: as long as the block
            is open); past it the lease lapses after one more TTL, so a hung learner stalls
            writers for at most ``max_lease_hold + lease_ttl``. ``episodes.renew()`` still works.
        curve_server_key, curve_client_cert: CURVE keys for a daemon started with
            ``--curve-secret`` (see :class:`~shmbuffer.clients.connection.Connection`).
    """

    def __init__(
        self,
        target: str = "default",
        *,
        remote: bool | None = None,
        timeout: float = 10.0,
        prefetch: bool = True,
        curve_server_key: str | bytes | os.PathLike[str] | None = None,
        curve_client_cert: str | os.PathLike[str] | None = None,
        auto_renew: bool = True,
        max_lease_hold: float | None = 600.0,
    ) -> None:
        self.prefetch = prefetch
        self.auto_renew = auto_renew
        self.max_lease_hold = max_lease_hold
        self._leases: dict[int, ClientLease] = {}  # of the sample_episodes blocks now open
        self._renewer: Renewer | None = None
        self._ahead: tuple[Any, int] | None = None  # (request, seq) of a sample sent ahead
        self.conn = Connection(
            target,
            "reader",
            timeout=timeout,
            remote=remote,
            curve_server_key=curve_server_key,
            curve_client_cert=curve_client_cert,
        )
        self.remote = self.conn.remote
        self.capacity: int = self.conn.buffer["capacity"]
        self.unit: str = self.conn.buffer["unit"]
        self.schema: Schema | None = None
        self.segment: Segment | None = None
        self.resamples = 0  # rows sampled again because a writer overwrote them mid-copy

    def _ready(self) -> Segment | None:
        """Attach once the buffer has a schema (a lazy schema appears with the first write)."""
        if self.schema is None:
            info = self.conn.call("stats")["stats"]
            if info["schema"] is None:
                return None
            self.schema = Schema.from_spec(info["schema"])
            if not self.remote:
                seg = info["segment"]
                self.segment = Segment.attach(seg["name"], storage_dir=seg["storage_dir"])
        return self.segment

    def _sample(self, **fields: Any) -> tuple[dict[str, Any], Any]:
        self._ready()
        return self.conn.wait(self.conn.send("sample", payload=self.remote, **fields))

    def _sample_ahead(self, **fields: Any) -> tuple[dict[str, Any], Any]:
        """Like :meth:`_sample`, but the reply was requested at the previous call (when it
        asked the same) and the next one is requested now: the round trip overlaps the
        learner's own work. Indices that went stale meanwhile are caught by the stamps."""
        key = tuple(sorted(fields.items()))
        ahead, self._ahead = self._ahead, None
        reply = None
        if ahead is not None:
            try:
                got = self.conn.wait(ahead[1])
                reply = got if ahead[0] == key else None
            except EmptyBufferError:  # stale: the buffer may have filled since
                pass
        if reply is None:
            reply = self._sample(**fields)
        if self.prefetch:
            self._ahead = (key, self.conn.send("sample", payload=self.remote, **fields))
        return reply

    # -- transitions --------------------------------------------------------------------------

    def sample(self, batch_size: int) -> TensorDict:
        """``batch_size`` transitions drawn uniformly from the committed rows (a copy)."""
        batch_size = _count(batch_size, "batch_size")
        reply, frames = self._sample_ahead(kind="rows", n=batch_size)
        if self.remote:
            return self._from_frames(frames, [batch_size])
        return self._checked_gather(decode_i64(reply["rows"]), decode_i64(reply["gens"]), "rows", 1)

    def sample_slices(self, n: int, length: int) -> TensorDict:
        """``[n, length]`` runs of consecutive rows, each inside one episode (a copy)."""
        n, length = _count(n, "n"), _count(length, "length")
        reply, frames = self._sample_ahead(kind="slices", n=n, length=length)
        if self.remote:
            return self._from_frames(frames, [n, length])
        physical = rows.slice_rows(decode_i64(reply["starts"]), length)
        data = self._checked_gather(physical, decode_i64(reply["gens"]), "slices", length)
        return data.reshape(n, length)

    def _checked_gather(
        self, physical: np.ndarray, gens: np.ndarray, kind: str, group: int
    ) -> TensorDict:
        """Gather rows, then redo (with fresh samples) the groups whose stamps moved.

        A group whose stamps still match after its copy was copied untorn, so only the groups
        just redone are checked again: rechecking all of them would blame rows that were
        overwritten after their (good) copy was taken.
        """
        assert self.segment is not None
        stamps = self.segment.generations
        data = rows.gather(self.segment.columns, physical)
        todo = np.arange(len(physical) // group)
        for _ in range(MAX_RESAMPLES):
            where = rows.slice_rows(todo * group, group)
            moved = (stamps[physical[where]] != gens[where]).reshape(-1, group).any(axis=1)
            if not moved.any():
                return data
            todo = todo[moved]
            self.resamples += len(todo)
            fields: dict[str, Any] = {"kind": kind, "n": len(todo)}
            if kind == "slices":
                fields["length"] = group
            reply, _ = self._sample(**fields)
            if kind == "slices":
                fresh = rows.slice_rows(decode_i64(reply["starts"]), group)
            else:
                fresh = decode_i64(reply["rows"])
            where = rows.slice_rows(todo * group, group)
            physical[where], gens[where] = fresh, decode_i64(reply["gens"])
            data[torch.from_numpy(where)] = rows.gather(self.segment.columns, fresh)
        raise TornReadError(f"rows kept being overwritten through {MAX_RESAMPLES} resamples")

    def _from_frames(self, frames: list[Any], batch_size: list[int]) -> TensorDict:
        assert self.schema is not None
        n = int(np.prod(batch_size))
        flat: dict[Any, Any] = {}
        for field, frame in zip(self.schema.fields, frames, strict=True):
            array = np.frombuffer(frame.buffer, dtype=np.uint8)
            flat[field.key] = rows.from_bytes(array, field.dtype, (n, *field.shape), copy=True)
        return rows.nest(flat, [n]).reshape(*batch_size)

    # -- episodes ---------------------------------------------------------------------------

    @contextmanager
    def sample_episodes(self, n: int) -> Iterator[EpisodeViews]:
        """``n`` whole episodes drawn uniformly, as a sequence of ``[length]`` TensorDicts
        (:class:`~shmbuffer.clients.leased.EpisodeViews`: indexable, iterable, ``len``).

        Locally: zero-copy views of the shared rows, built when accessed, under a lease that
        keeps writers off them until the block exits, renewed while it is open (see
        ``auto_renew``). ``episodes.valid()`` says whether the lease still certainly holds;
        once it lapsed, building a view and the block's exit raise ``LeaseExpiredError``
        (data read from the views may have changed). Remotely: copies, always valid.

        At most ``2**20`` episodes a call (the protocol's bound on ``n``), holding at most
        ``max_payload_bytes / 16`` rows (2**27 by default); more is refused by the daemon.
        """
        n = _count(n, "n")
        if self.remote:
            reply, frames = self._sample(kind="episodes", n=n)
            lengths = decode_i64(reply["lengths"])
            data = self._from_frames(frames, [int(lengths.sum())])
            offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
            columns = {f.key: data[f.key] for f in self.schema.fields} if self.schema else {}
            yield EpisodeViews(columns, decode_i64(reply["ids"]), offsets, lengths)
            return
        sent = time.monotonic()
        reply, _ = self._sample(kind="episodes", n=n, lease=True)
        assert self.segment is not None
        ttl = float(self.conn.buffer.get("lease_ttl", 30.0))
        lease = ClientLease(int(reply["lease"]), n, ttl, sent)
        self._leases[lease.id] = lease
        views = EpisodeViews(
            self.segment.columns,
            decode_i64(reply["ids"]),
            decode_i64(reply["starts"]),
            decode_i64(reply["lengths"]),
            lease,
            self.conn,
        )
        try:
            self._start_renewer(ttl)
            if time.monotonic() - sent > ttl / 3:  # a slow reply: restart the clock now
                lease.renew(self.conn)
            yield views
        except BaseException:  # the block's own error wins; the lease just goes
            self._end_lease(lease, quiet=True)
            raise
        self._end_lease(lease, quiet=False)

    def _end_lease(self, lease: ClientLease, quiet: bool) -> None:
        """Release the lease; unless ``quiet``, raise LeaseExpiredError if it had lapsed."""
        self._leases.pop(lease.id, None)
        if lease.released:
            return
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
            self._renewer = Renewer(ttl / 3, weakref.WeakMethod(self._renew_leases))

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

    # -- info ---------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = self.conn.call("stats")["stats"]
        return stats

    def __len__(self) -> int:
        stats = self.stats()
        return int(stats["rows"] if stats["unit"] == "transition" else stats["episodes"])

    def close(self) -> None:
        """Disconnect (the daemon releases this reader's leases). Safe to call twice."""
        if self._renewer is not None:
            self._renewer.stop(timeout=self.conn.timeout)
            self._renewer = None
        for lease in self._leases.values():  # their views are no longer protected
            lease.released = True
        if self.segment is not None:
            self.segment.close()
            self.segment = None
        self.conn.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
