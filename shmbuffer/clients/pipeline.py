"""A Writer's writes from the moment they are validated until the daemon acknowledges them.

:class:`~shmbuffer.clients.writer.Writer` checks and plans a write, then hands it here: a small
one is staged (:mod:`~shmbuffer.clients.staging`) to share a reservation with the next ones; a
local write's rows are reserved (ahead of time while it streams:
:mod:`~shmbuffer.clients.ahead`) and copied, and its commit rides on the next reserve or goes
alone once it has waited ``commit_delay`` (the ticker thread, :mod:`~shmbuffer.clients.ticker`);
a remote write sends its rows; acknowledgements are collected as they come, and all of them by
:meth:`WritePipeline.flush`.

Why a part of its own: what a Writer was given but the daemon has not stored yet lives here,
and nothing here refers back to the Writer. The Writer registers :meth:`WritePipeline.finalise`
with ``weakref.finalize``, so a Writer collected, or left at interpreter exit, without
``close()`` still stores what it was given, as a Python file object flushes: the finaliser holds
the pipeline (the rows on their way) and never the Writer, which is collected as usual.
Finalising is bounded by the Writer's ``timeout`` (a daemon that is gone never holds up a
collection or the interpreter's exit) and ends with ``bye``; rows it could not store are
named in an :class:`~shmbuffer.errors.UnstoredWritesWarning`.

Locking: every call is made with :attr:`WritePipeline.lock` held (the Writer's calls, the
ticker's and the finaliser's); the lock is reentrant.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from shmbuffer.api.writeplan import Items
from shmbuffer.clients.ahead import ReserveAhead, Shape, Written, commit_fields
from shmbuffer.clients.connection import Connection
from shmbuffer.clients.staging import Piece, Staging
from shmbuffer.clients.ticker import Ticker
from shmbuffer.errors import InvalidArgumentError, UnstoredWritesWarning
from shmbuffer.storage import rows, streamcopy
from shmbuffer.storage.cuda_rows import DeviceWriter
from shmbuffer.storage.cuda_segment import attach_segment
from shmbuffer.storage.schema import Schema
from shmbuffer.storage.segment import Segment
from shmbuffer.wire.protocol import MAX_PRIORITIES, encode_f64


class WritePipeline:
    """Staging, reserving, copying and committing a Writer's writes (the arguments are
    :class:`~shmbuffer.clients.writer.Writer`'s, documented there)."""

    def __init__(
        self, conn: Connection, reserve_timeout: float, commit_delay: float, batch_bytes: int
    ) -> None:
        self.conn = conn
        self.remote = conn.remote
        self.reserve_timeout = reserve_timeout
        self.capacity: int = conn.buffer["capacity"]
        self.unit: str = conn.buffer["unit"]
        self.mode: str = conn.buffer["mode"]
        self.schema: Schema | None = None
        self.segment: Segment | None = None
        #: (seq, what it publishes) of unacknowledged commits; None: an abort of an unused
        #: reservation.
        self.in_flight: list[tuple[int, Written | None]] = []
        # Copied writes whose commits ride on this writer's next reserve (one message per
        # write, or per batch reserved ahead, instead of two), or go alone once they have
        # waited ``commit_delay`` seconds: (reservation, what it publishes, since), oldest first.
        self.commit_delay = commit_delay
        self._uncommitted: list[tuple[int, Written, float]] = []
        self._ticker: Ticker | None = None
        self._ticker_error: Exception | None = None
        #: What the failed tick behind ``_ticker_error`` dropped, until a call is told.
        self._ticker_lost: Written = (0, 0)
        #: Set when the Writer was collected on the ticker's own thread, mid-tick: the tick
        #: finalises once it is done (see finalise).
        self._orphaned = False
        # Small writes (transitions of small rows) wait here to share one round trip.
        self.batch_bytes = batch_bytes
        self.staged: Staging | None = None  # made with the schema, on the first small write
        self._staged_lengths: list[int] = []
        self._staged_since = 0.0
        #: Per staged piece: its priority (Items) and how many items it holds.
        self._staged_priority: list[tuple[Items, int]] = []
        #: The metadata each copied write's commit attaches, by reservation, until it is sent.
        self.metas: dict[int, dict[str, Any]] = {}
        #: The next write's reserve, sent ahead while this one copies.
        self.ahead = ReserveAhead(
            conn, self.capacity, self.mode, commit_delay, self.in_flight, self.metas
        )
        self._last_write = 0.0  # when the last local write finished; 0 after a flush
        self.lock = threading.RLock()  # the ticker thread shares the socket
        #: The copy into reserved rows: rows.write, or a DeviceWriter's for a CUDA segment
        #: (pinned staging, host -> device; device -> device for GPU rows).
        self._write_rows: Callable[..., None] = rows.write
        self._carried: list[Written] = []  # commits a reserve carries (carry_commits)
        #: The rows each local reservation copied into, in the order its rows were laid out,
        #: while a caller asked where its writes land (Writer.placing); None: not asked.
        self.placed: list[tuple[int, int]] | None = None
        self.closed = False
        self.episodes_committed = 0
        self.rows_committed = 0
        self.adopt(conn.buffer)

    def adopt(self, buffer: dict[str, Any]) -> None:
        """Take the buffer's schema (a ``hello`` or ``define_schema`` reply's ``buffer``) and,
        locally, map its segment."""
        if buffer["schema"] is None:
            return
        self.schema = Schema.from_spec(buffer["schema"])
        if not self.remote and self.segment is None:
            seg = buffer["segment"]
            self.segment = attach_segment(seg["name"], seg["storage_dir"])
            if self.segment.device != "cpu":
                self._write_rows = DeviceWriter(self.segment.device).write
            else:  # here, not at the first write: its compile must not stall a stream
                streamcopy.warm(self.schema.row_nbytes)

    # -- staging small writes -----------------------------------------------------------------

    def stage(
        self,
        leaves: dict[Any, Any],
        first_row: int,
        num_rows: int,
        lengths: list[int],
        items: Items = None,
    ) -> None:
        """Keep a copy of a small write, to store several in one round trip: at
        ``batch_bytes``, once the oldest waited ``commit_delay``, or on flush. Writes with a
        priority and writes without are never gathered together (a reservation carries one
        priority for all of its items, or one per item)."""
        assert self.schema is not None
        count = num_rows if self.unit == "transition" else len(lengths)
        if self._staged_priority:
            with_priority = self._staged_priority[0][0] is not None
            if with_priority != (items is not None) or (
                items is not None
                and sum(n for _, n in self._staged_priority) + count > MAX_PRIORITIES
            ):
                self.write_staged()
        area = self.staged
        if area is None:  # room for the most a batch gathers: under 1.5 batch_bytes
            most = self.batch_bytes * 3 // (2 * max(1, self.schema.row_nbytes)) + 1
            area = self.staged = Staging(self.schema, min(most, self.capacity // 8 + 1))
        if not area:
            self._staged_since = time.monotonic()
        # Converted to the columns' dtypes now (validated: the values fit), so storing the
        # batch later is a memcpy that cannot fail and take its neighbours down with it.
        area.add(leaves, first_row, num_rows)
        self._staged_priority.append((items, count))
        self._staged_lengths.extend(lengths)
        full = area.rows * self.schema.row_nbytes >= self.batch_bytes
        if full or area.rows * 8 >= self.capacity:
            self.write_staged()
        else:
            self._start_ticker()

    def write_staged(self) -> None:
        if self.staged:
            pieces, lengths = self.staged.take(), self._staged_lengths
            priorities = self._staged_priority
            self._staged_lengths, self._staged_priority = [], []
            items: Items = None
            if priorities[0][0] is not None:  # all of them have one (see stage)
                items = np.concatenate(
                    [np.broadcast_to(np.asarray(p, dtype=np.float64), (n,)) for p, n in priorities]
                )
            self.write_local(pieces, lengths, compact(items))

    # -- local and remote writes --------------------------------------------------------------

    def write_local(
        self,
        pieces: list[Piece],
        lengths: list[int],
        priority: float | bytes | None = None,
        meta: dict[str, Any] | None = None,
        tables: list[str] | None = None,
    ) -> None:
        """Reserve rows for ``pieces`` (laid out one after another) going into ``tables``,
        copy each into them, and leave the commit to ride on the next reserve (which publishes
        them with ``priority``, as the daemon checked it at this reserve, and ``meta``)."""
        assert self.segment is not None
        num_rows = sum(lengths)
        fields = reserve_fields(lengths, self.reserve_timeout, priority, tables)
        shape: Shape = (num_rows, fields.get("episodes"), fields.get("lengths"))
        # A write with a priority, or into only some tables, never takes (or sends) a
        # reservation made ahead: its reserve carries them.
        plain = priority is None and tables is None
        reply = self._take_ahead(shape if plain else None)
        if reply is None:
            previous, self._uncommitted = self._uncommitted, []
            fields.update(commit_fields([r for r, _, _ in previous], self.metas))
            reply = self.conn.call(
                "reserve", timeout=self.reserve_timeout + self.conn.timeout, **fields
            )
            for _, written, _ in previous:
                self._count(written)
        if self.ahead.wanted(shape, self._last_write, with_priority=not plain):
            # it carries the pending commits of the writes before this one
            previous, self._uncommitted = self._uncommitted, []
            self.ahead.send(shape, [(r, w) for r, w, _ in previous])
        elif not self.ahead.holding:  # this write's rows came ahead: send the commits now
            self._commit_if_due(now=True)
        # else reservations ahead are in hand: the next batch's reserve carries the commits
        self._collect_acks(block=False)
        reservation = reply["reservation"]
        ranges = [(int(s), int(e)) for s, e in reply["ranges"]]
        if self.placed is not None:
            self.placed.extend(ranges)
        offset = 0  # rows of the reservation the pieces before this one filled

        def abort(touched: int) -> None:  # of the piece being copied
            # The daemon publishes again what the reservation evicted from untouched rows.
            self.conn.send("abort", reservation=reservation, written=offset + touched)

        with rows.Progress(abort) as progress:
            for leaves, first_row, n in pieces:
                target = rows.split_ranges(ranges, offset, n)
                self._write_rows(
                    self.segment.columns, self.segment.arrays, target, leaves, first_row, progress
                )
                offset += n
                progress.rows = 0
        self.copied(reservation, (num_rows, len(lengths)), meta)

    def carry_commits(self, fields: dict[str, Any]) -> None:
        """Put the pending commits into a reserve's ``fields`` (counted once it is answered:
        :meth:`count`), for a write path of its own (``clients/packed_io.py``)."""
        previous, self._uncommitted = self._uncommitted, []
        fields.update(commit_fields([r for r, _, _ in previous], self.metas))
        self._carried = [w for _, w, _ in previous]

    def count_carried(self) -> None:
        for written in self._carried:
            self._count(written)
        self._carried = []

    def copied(self, reservation: int, written: Written, meta: dict[str, Any] | None) -> None:
        """A reservation's rows are copied: its commit rides on the next reserve, or goes
        once it waited ``commit_delay``."""
        self._last_write = time.monotonic()
        if meta:
            self.metas[reservation] = meta
        self._uncommitted.append((reservation, written, self._last_write))
        if self.commit_delay <= 0:
            self._commit_if_due(now=True)
        else:
            self._start_ticker()

    def write_remote(
        self,
        leaves: dict[Any, Any],
        first_row: int,
        num_rows: int,
        num_sub: int | list[int],
        priority: float | bytes | None = None,
        meta: dict[str, Any] | None = None,
        tables: list[str] | None = None,
    ) -> None:
        assert self.schema is not None
        extra: dict[str, Any] = {} if priority is None else {"priority": priority}
        # episodes of their own lengths: a write laid out with tail rows (api/frames.py)
        split = {"lengths": num_sub} if isinstance(num_sub, list) else {"episodes": num_sub}
        if meta:
            extra["meta"] = meta
        if tables is not None:
            extra["tables"] = tables
        frames = [
            rows.to_bytes(leaves[f.key][first_row : first_row + num_rows], f.dtype)
            for f in self.schema.fields
        ]
        # The reply's episode ids count registry entries (one across the ring's end is two).
        self.conn.call(
            "write",
            frames,
            timeout=self.reserve_timeout + self.conn.timeout,
            rows=num_rows,
            timeout_ms=int(self.reserve_timeout * 1000),
            **split,
            **extra,
        )
        self._count((num_rows, num_sub if isinstance(num_sub, int) else len(num_sub)))

    # -- reserving ahead (shmbuffer/clients/ahead.py) ------------------------------------------

    def _take_ahead(self, shape: Shape | None) -> dict[str, Any] | None:
        """The reply of the reserve sent ahead if it reserved ``shape``, else None."""
        reply, written = self.ahead.take(shape)
        self._count(written)
        return reply

    def _count(self, written: Written) -> None:
        """Count what an acknowledged commit published."""
        self.rows_committed += written[0]
        self.episodes_committed += written[1]

    def _return_ahead(self, idle_only: bool) -> None:
        if self.ahead.due_back(idle_only, self._last_write):
            self._take_ahead(None)  # None matches no shape: a granted reservation is aborted

    # -- commits and their acknowledgements ---------------------------------------------------

    def _start_ticker(self) -> None:
        if self._ticker is None and self.commit_delay > 0:
            # A weak reference: the thread must not keep the pipeline alive once its Writer
            # was finalised (the finaliser stops it too).
            tick = weakref.WeakMethod(self._commit_from_ticker)
            self._ticker = Ticker(self.commit_delay / 2, tick, "shmbuffer-commit")

    def _commit_if_due(self, now: bool = False) -> None:
        """Send the pending commits on their own (without waiting for the replies), each
        once it has waited ``commit_delay`` seconds, or all at once when ``now``."""
        due = time.monotonic() - self.commit_delay
        while self._uncommitted and (now or self._uncommitted[0][2] <= due):
            reservation, written, _ = self._uncommitted.pop(0)
            meta = self.metas.pop(reservation, None)
            extra: dict[str, Any] = {} if meta is None else {"meta": meta}
            seq = self.conn.send("commit", reservation=reservation, **extra)
            self.in_flight.append((seq, written))

    def _commit_from_ticker(self) -> None:
        # An idle writer's last episode must not wait for a next write that may never come
        # (its reservation would expire): the ticker stores and commits what is due.
        if self._tick_due(time.monotonic()):
            with self.lock:
                self._tick()
        if self._orphaned:
            self._finalise_now()

    def _tick(self) -> None:
        if self.closed or self._ticker_error is not None:
            return
        before, stored = self.unstored(), self._stored()
        try:
            if self.staged and time.monotonic() - self._staged_since >= self.commit_delay:
                self.write_staged()
            self._commit_if_due()
            self._return_ahead(idle_only=True)
        except Exception as exc:  # raised to the caller at its next call
            self._ticker_error = exc
            self._ticker_lost = self._lost(before, stored)

    def _tick_due(self, now: float) -> bool:
        """Whether a tick may find work, read without the lock: a streaming writer holds it
        for every write, and a tick that queued on it cost a wake-up and a GIL hand-over per tick (a
        visible share of a one-writer image stream). A stale read only moves the work one tick."""
        delay = self.commit_delay
        if self.staged and now - self._staged_since >= delay:
            return True
        pending = self._uncommitted
        if pending and now - pending[0][2] >= delay:
            return True
        return self.ahead.holding and now - self._last_write >= delay

    def check_ticker(self) -> None:
        """Raise what the ticker's last store or commit raised (to the Writer's next call)."""
        error, self._ticker_error = self._ticker_error, None
        self._ticker_lost = (0, 0)
        if error is not None:
            raise error

    def _collect_acks(self, block: bool) -> None:
        """Take the replies of commits sent earlier; raises the first error among them."""
        while self.in_flight:
            seq, written = self.in_flight[0]
            if not block and not self.conn.ready(seq):
                return
            # Taken off first: a refused commit (out_of_space) is reported once, and a later
            # flush must not wait for a reply already consumed.
            self.in_flight.pop(0)
            self.conn.wait(seq)
            if written is not None:  # an abort's reply says nothing to count
                self._count(written)

    # -- flush, close, finalise ---------------------------------------------------------------

    def flush(self, timeout: float | None) -> None:
        """Store what is staged, give back what was reserved ahead, commit, and wait for
        every acknowledgement (``timeout``: the wait for those; None: the connection's)."""
        self.check_ticker()
        # Nothing is reserved ahead of what is flushed now, and the write after a flush starts
        # a stream anew (a loop of write + flush never reserves ahead only to give it back).
        self._last_write = 0.0
        self.write_staged()
        self._return_ahead(idle_only=False)
        self._commit_if_due(now=True)
        if self.in_flight:
            self.conn.wait_all([seq for seq, _ in self.in_flight], timeout)
            self._collect_acks(block=True)

    def close(self, timeout: float | None = None) -> None:
        """Flush, then disconnect (``bye``). Safe to call twice. In a process forked from the
        writer's, only this copy is dropped: what it staged is the parent's to commit, and
        the socket is the parent's."""
        if self.conn.forked:
            self.closed = True
            self.conn.close()
            return
        with self.lock:
            if self.closed:
                return
            try:
                self.flush(timeout)
            finally:
                self._disconnect(goodbye=True)
        self._stop_ticker()

    def _disconnect(self, goodbye: bool) -> None:
        self.closed = True
        if self.segment is not None:
            self.segment.close()
            self.segment = None
        self.conn.close(goodbye=goodbye)

    def _stop_ticker(self) -> None:
        if self._ticker is not None:  # outside the lock: its last tick may be waiting for it
            self._ticker.stop()

    def unstored(self) -> Written:
        """``(rows, episodes)`` given to this pipeline whose commits are not acknowledged yet:
        staged, copied and uncommitted, or committed with no reply so far."""
        pending: list[Written] = [w for _, w, _ in self._uncommitted]
        pending += [w for _, w in self.in_flight if w is not None]
        if self.ahead.pending is not None:  # the commits a reserve sent ahead carries
            pending.append(self.ahead.pending[2])
        if self.staged:
            pending.append((self.staged.rows, len(self._staged_lengths)))
        return sum(w[0] for w in pending), sum(w[1] for w in pending)

    def _stored(self) -> Written:
        return self.rows_committed, self.episodes_committed

    def _lost(self, before: Written, stored: Written) -> Written:
        """What was unstored at ``before`` (when ``stored`` had been acknowledged) and is
        neither acknowledged nor still waiting now: dropped by a failed store or commit."""
        now, acked = self.unstored(), self._stored()
        return (
            max(0, before[0] - now[0] - (acked[0] - stored[0])),
            max(0, before[1] - now[1] - (acked[1] - stored[1])),
        )

    def finalise(self) -> None:
        """What ``close()`` does, for a Writer collected (or left at interpreter exit)
        without it: store and commit what it was given, waiting at most the connection's
        timeout, and say ``bye``; never raises. Rows it could not store are named in an
        :class:`~shmbuffer.errors.UnstoredWritesWarning`. In a forked child it does nothing
        (the rows and the socket are the parent's).

        A Writer is collected on whichever thread the collector runs: if that is this
        pipeline's ticker, in the middle of a tick, the tick finishes first (a flush from
        inside it would close the segment under the copy in progress)."""
        if self._ticker is not None and self._ticker.is_current():
            self._orphaned = True
            return
        self._finalise_now()

    def _finalise_now(self) -> None:
        self._orphaned = False
        if self.conn.forked or self.closed:
            return
        budget = self.conn.timeout
        if not self.lock.acquire(timeout=budget):  # a tick stuck longer than it may be
            self._warn(self.unstored(), "its commit thread held it", budget)
            return
        try:
            if self.closed:
                return
            before = _add(self.unstored(), self._ticker_lost)
            stored = self._stored()
            error: Exception | None = None
            start = time.monotonic()
            try:
                with self.conn.bounded(budget):
                    self.flush(None)
            except Exception as exc:  # the daemon gone, slow or refusing: a warning, below
                error = exc
            # No goodbye to a daemon that said nothing while it failed (it would only wait
            # again); one that answered, if only a ping, forgets this client at once.
            answered = error is None or self.conn.last_heard >= start
            with contextlib.suppress(Exception):
                self._disconnect(goodbye=answered)
            if error is not None:
                self._warn(self._lost(before, stored), f"{type(error).__name__}: {error}", budget)
        finally:
            self.lock.release()
            self._stop_ticker()

    def _warn(self, lost: Written, why: str, budget: float) -> None:
        if lost[0] == 0:
            return
        rows_, episodes = lost
        warnings.warn(
            UnstoredWritesWarning(
                f"a Writer of {self.conn.endpoint} (pid {os.getpid()}) was dropped without "
                f"close() and could not store its last {rows_:,} rows ({episodes:,} "
                f"episode{'s' if episodes != 1 else ''}) within its timeout of {budget:.1f}s: "
                f"{why}. close() a Writer, or use it in a `with` block, to see such errors "
                "where they happen"
            ),
            stacklevel=2,
        )


def _add(a: Written, b: Written) -> Written:
    return a[0] + b[0], a[1] + b[1]


def compact(items: Items) -> float | bytes | None:
    """A checked priority as a request carries it: one number when every item has the same
    (whatever the count), else f64 bytes; InvalidArgumentError for more distinct values than
    one request holds (``MAX_PRIORITIES``)."""
    if items is None or isinstance(items, float):
        return items
    if items.size and bool((items == items[0]).all()):
        return float(items[0])
    if items.size > MAX_PRIORITIES:
        raise InvalidArgumentError(
            f"priority: {items.size} distinct values in one write, over the limit of "
            f"{MAX_PRIORITIES} a request carries; write fewer rows per call, or give one "
            "priority for the whole write"
        )
    return encode_f64(items)


def reserve_fields(
    lengths: list[int],
    timeout: float,
    priority: float | bytes | None = None,
    tables: list[str] | None = None,
) -> dict[str, Any]:
    """A ``reserve``'s fields for episodes of ``lengths`` going into ``tables`` (None: every
    one), the daemon waiting at most ``timeout`` seconds: equal episodes as a count, others
    as their lengths."""
    fields: dict[str, Any] = {"rows": sum(lengths), "timeout_ms": int(timeout * 1000)}
    if priority is not None:
        fields["priority"] = priority
    if tables is not None:
        fields["tables"] = tables
    if all(n == lengths[0] for n in lengths):
        fields["episodes"] = len(lengths)
    else:
        fields["lengths"] = lengths
    return fields
