"""Writers: env-worker processes that put rows into a daemon's buffer.

A local writer copies its rows straight into the shared segment: ``reserve`` (one round trip)
→ copy → ``commit``. The commit rides on the writer's next ``reserve`` (one message per
episode), or is sent on its own once it has waited ``commit_delay`` seconds (checked on every
``add_transition``), and at the latest by :meth:`Writer.flush` / :meth:`Writer.close`, which
wait for every acknowledgement. The daemon never touches the bytes.

A writer that streams also hides the reserve's round trip: it reserves its next write ahead
while it copies this one (:mod:`shmbuffer.clients.ahead`). A remote writer (``remote=True``, or
a daemon on another host) sends the rows as raw frames instead and the daemon copies them in.
Both have the same API as the in-process :class:`~shmbuffer.Buffer`.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from shmbuffer import rows, streamcopy
from shmbuffer.clients.ahead import ReserveAhead, Shape, Written, commit_fields
from shmbuffer.clients.connection import Connection
from shmbuffer.clients.staging import Staging
from shmbuffer.clients.ticker import Ticker
from shmbuffer.cuda_rows import DeviceWriter
from shmbuffer.cuda_segment import attach_segment
from shmbuffer.episodes import DEFAULT_DONE_KEYS, EpisodeAssembler, FinishedEpisode
from shmbuffer.errors import InvalidArgumentError
from shmbuffer.protocol import MAX_PRIORITIES, encode_f64
from shmbuffer.samplers.base import check_priority
from shmbuffer.schema import Schema
from shmbuffer.segment import Segment
from shmbuffer.writeplan import env_major, plan_write

#: The largest write the Writer gathers with others (see ``batch_bytes``): a larger one is
#: stored at once, since copying it twice would cost more than its round trip. Batches are
#: larger (``batch_bytes``, 8 MiB): with one or two small-row writers, each doubling of the
#: batch from 1 MiB measured 7-22% more rows/s, the daemon's work per reservation amortised.
STAGE_MAX_BYTES = 512 << 10

#: A write's priority once checked: None (the daemon's default, the largest seen so far), one
#: number for every item, or one float64 per item (row in transition unit, episode in episode
#: unit).
Items = float | np.ndarray | None


class Writer:
    """Writes into the buffer served by a daemon.

    Args:
        target: a buffer name (found through its runtime file) or an endpoint.
        remote: send rows over the socket instead of writing shared memory (automatic for a
            ``tcp://`` endpoint on another host).
        timeout: seconds any single wait on the daemon may take.
        reserve_timeout: seconds a reservation may wait for readers' leases to end.
        commit_delay: seconds a copied episode may wait for the next write to carry its commit,
            and a small write may wait to share a round trip with the next ones. 50 ms: with
            two env workers, a learner and the daemon on two cores, 10 ms (one blocking
            reserve per worker every 10 ms) measured 7% fewer env steps per second.
        batch_bytes: small writes (at most :data:`STAGE_MAX_BYTES`, and at most half this)
            are gathered (copied) until this many bytes are waiting, then stored with one
            reservation. 0 stores each write at once, as a daemon with ``--mode fixed``
            always does (each write's rows are reserved before its call returns, so a write
            that does not fit raises in its own call).
        curve_server_key, curve_client_cert: CURVE keys for a daemon started with
            ``--curve-secret`` (see :class:`~shmbuffer.clients.connection.Connection`).
        The rest are the episode-assembly options of :class:`~shmbuffer.Buffer`.
    """

    def __init__(
        self,
        target: str = "default",
        *,
        remote: bool | None = None,
        timeout: float = 10.0,
        reserve_timeout: float = 30.0,
        num_envs: int | Mapping[str, int] | None = None,
        auto_truncate: bool = True,
        done_keys: Sequence[str] = DEFAULT_DONE_KEYS,
        postprocess_fn: Callable[[dict[str, list[Any]]], Mapping[str, Any]] | None = None,
        curve_server_key: str | bytes | os.PathLike[str] | None = None,
        curve_client_cert: str | os.PathLike[str] | None = None,
        commit_delay: float = 0.05,
        batch_bytes: int = 8 << 20,
    ) -> None:
        self.conn = Connection(
            target,
            "writer",
            timeout=timeout,
            remote=remote,
            curve_server_key=curve_server_key,
            curve_client_cert=curve_client_cert,
        )
        self.remote = self.conn.remote
        self.reserve_timeout = reserve_timeout
        self.assembler = EpisodeAssembler(
            num_envs=num_envs,
            auto_truncate=auto_truncate,
            done_keys=done_keys,
            postprocess_fn=postprocess_fn,
        )
        self.capacity: int = self.conn.buffer["capacity"]
        self.unit: str = self.conn.buffer["unit"]
        self.mode: str = self.conn.buffer["mode"]
        #: The daemon's sampler (a daemon before protocol 1.2 samples uniformly).
        self.sampler: str = self.conn.buffer.get("sampler", "uniform")
        self.schema: Schema | None = None
        self.segment: Segment | None = None
        #: (seq, what it publishes) of unacknowledged commits; None: an abort of an unused
        #: reservation.
        self._in_flight: list[tuple[int, Written | None]] = []
        # Copied writes whose commits ride on this writer's next reserve (one message per
        # write, or per batch reserved ahead, instead of two), or go alone once they have
        # waited ``commit_delay`` seconds: (reservation, what it publishes, since), oldest first.
        self.commit_delay = commit_delay
        self._uncommitted: list[tuple[int, Written, float]] = []
        self._ticker: Ticker | None = None
        self._ticker_error: Exception | None = None
        # Small writes (transitions of small rows) wait here to share one round trip.
        self.batch_bytes = batch_bytes
        self._staged: Staging | None = None  # made with the schema, on the first small write
        self._staged_lengths: list[int] = []
        self._staged_since = 0.0
        #: Per staged piece: its priority (Items) and how many items it holds.
        self._staged_priority: list[tuple[Items, int]] = []
        #: The next write's reserve, sent ahead while this one copies.
        self._ahead = ReserveAhead(
            self.conn, self.capacity, self.mode, commit_delay, self._in_flight
        )
        self._last_write = 0.0  # when the last local write finished; 0 after a flush
        self._lock = threading.RLock()  # the ticker thread shares the socket
        #: The copy into reserved rows: rows.write, or a DeviceWriter's for a CUDA segment
        #: (pinned staging, host -> device; device -> device for GPU rows).
        self._write_rows: Callable[..., None] = rows.write
        self._closed = False
        self.episodes_committed = 0
        self.rows_committed = 0
        self._adopt(self.conn.buffer)

    def _adopt(self, buffer: dict[str, Any]) -> None:
        if buffer["schema"] is None:
            return
        self.schema = Schema.from_spec(buffer["schema"])
        if not self.remote and self.segment is None:
            seg = buffer["segment"]
            self.segment = attach_segment(seg["name"], seg["storage_dir"])
            if self.segment.device != "cpu":
                self._write_rows = DeviceWriter(self.segment.device).write
            else:  # here, not at the first write: its ~0.9 s must not stall a stream
                streamcopy.warm(self.schema.row_nbytes)

    # -- the Buffer API -----------------------------------------------------------------------

    def extend(self, batch: Mapping[str, Any], priority: Any = None) -> None:
        """Write a chunk of transitions (or, in episode unit, one whole episode).

        ``priority`` (a daemon with ``--sampler prioritized`` only): one number, one value
        per row (transition unit) or one for the episode (episode unit); None gives the
        largest priority seen so far. Checked before anything is written (InvalidArgumentError
        naming the value); at most 4096 distinct values a write."""
        self.conn.check()
        with self._lock:
            self._write(batch, priority=priority)

    def add_episode(
        self, episode: Mapping[str, Any], num_envs: int = 1, priority: Any = None
    ) -> None:
        """Write a finished episode; with ``num_envs > 1`` its leaves are ``[L, num_envs,
        ...]`` and each sub-env becomes its own episode. ``priority`` as for :meth:`extend`;
        with ``num_envs > 1`` one value per sub-episode (episode unit) or per row, shaped
        ``[L, num_envs]`` like the data (transition unit)."""
        # Checked before the lock (a forked child may inherit it held) and before anything is
        # staged: a closed or forked writer must refuse the write, not drop it.
        self.conn.check()
        with self._lock:
            if num_envs == 1:
                self._write(episode, priority=priority)
                return
            if priority is not None and self.unit == "transition":
                value = _host(priority)
                if np.ndim(value) == 2:  # env-major, as the rows are
                    priority = np.asarray(value).T.reshape(-1)
            self._write(env_major(episode, num_envs), num_sub_episodes=num_envs, priority=priority)

    def add_transition(self, env_id: str, transition: Mapping[str, Any]) -> None:
        self.conn.check()
        with self._lock:
            self._write_finished(self.assembler.add_transition(env_id, transition))

    def end_episode(self, env_id: str) -> None:
        self.conn.check()
        with self._lock:
            self._write_finished(self.assembler.end_episode(env_id))

    def truncate_episodes(self, env_ids: Iterable[str]) -> None:
        for env_id in env_ids:
            self.end_episode(env_id)

    def _write_finished(self, episodes: list[FinishedEpisode]) -> None:
        for ep in episodes:
            self._write(ep.data, num_sub_episodes=ep.num_sub_episodes)

    # -- the write path -----------------------------------------------------------------------

    def _write(
        self, batch: Mapping[str, Any], num_sub_episodes: int = 1, priority: Any = None
    ) -> None:
        self._check_ticker()
        if priority is not None and self.sampler != "prioritized":  # before anything else
            raise InvalidArgumentError(
                f"priority given, but the daemon's sampler {self.sampler!r} keeps no "
                "priorities (start it with --sampler prioritized)"
            )
        schema = self.schema if self.schema is not None else Schema.from_batch(batch)
        # Refused here, before any copy, if it does not fit the schema; and a lazy schema is
        # defined only by a batch that passed every check the Writer can make.
        plan = plan_write(schema, batch, num_sub_episodes, self.capacity, self.mode)
        if plan is None:
            return
        leaves, first_row, num_rows, kept = plan
        items = self._items(priority, first_row, num_rows, num_sub_episodes, kept)
        compact = _compact(items)  # refuses too many distinct values before anything is sent
        if self.schema is None:  # SchemaError if another writer defined a different one
            reply = self.conn.call("define_schema", schema=schema.to_spec())
            self._adopt(reply["buffer"])
        assert self.schema is not None
        lengths = [num_rows // kept] * kept
        if self.remote:
            self._write_remote(leaves, first_row, num_rows, kept, compact)
        elif self._gathers(num_rows):
            self._stage(leaves, first_row, num_rows, lengths, items)
        else:
            self._write_staged()  # what came first is stored first
            self._write_local([(leaves, first_row, num_rows)], lengths, compact)

    def _gathers(self, num_rows: int) -> bool:
        """Whether a local write of ``num_rows`` is staged, to share a reservation with the
        writes after it: a small one, into a ring. A fixed buffer reserves each write in its
        own call: there a reservation can be refused for want of room, and the refusal must
        come from the call whose rows do not fit, not from a later one, after calls that
        returned had their rows staged in the refused batch."""
        assert self.schema is not None
        nbytes = num_rows * self.schema.row_nbytes
        return (
            self.mode == "circular" and nbytes <= STAGE_MAX_BYTES and nbytes * 2 <= self.batch_bytes
        )

    def _items(
        self, priority: Any, first_row: int, num_rows: int, num_sub: int, kept: int
    ) -> Items:
        """A write's priority, checked as the daemon checks it, for what ``plan_write`` kept
        of it (the newest rows or sub-episodes of a batch too large for the ring)."""
        if priority is None:
            return None
        value = _host(priority)
        try:
            if np.ndim(value) == 0:
                return float(check_priority(value, 1)[0])
            if self.unit == "episode":
                return check_priority(value, num_sub)[num_sub - kept :]
            return check_priority(value, first_row + num_rows)[first_row:]
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(str(exc)) from None

    def _stage(
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
                self._write_staged()
        area = self._staged
        if area is None:  # room for the most a batch gathers: under 1.5 batch_bytes
            most = self.batch_bytes * 3 // (2 * max(1, self.schema.row_nbytes)) + 1
            area = self._staged = Staging(self.schema, min(most, self.capacity // 8 + 1))
        if not area:
            self._staged_since = time.monotonic()
        # Converted to the columns' dtypes now (validated: the values fit), so storing the
        # batch later is a memcpy that cannot fail and take its neighbours down with it.
        area.add(leaves, first_row, num_rows)
        self._staged_priority.append((items, count))
        self._staged_lengths.extend(lengths)
        full = area.rows * self.schema.row_nbytes >= self.batch_bytes
        if full or area.rows * 8 >= self.capacity:
            self._write_staged()
        else:
            self._start_ticker()

    def _write_staged(self) -> None:
        if self._staged:
            pieces, lengths = self._staged.take(), self._staged_lengths
            priorities = self._staged_priority
            self._staged_lengths, self._staged_priority = [], []
            items: Items = None
            if priorities[0][0] is not None:  # all of them have one (see _stage)
                items = np.concatenate(
                    [np.broadcast_to(np.asarray(p, dtype=np.float64), (n,)) for p, n in priorities]
                )
            self._write_local(pieces, lengths, _compact(items))

    def _write_local(
        self,
        pieces: list[tuple[dict[Any, Any], int, int]],
        lengths: list[int],
        priority: float | bytes | None = None,
    ) -> None:
        """Reserve rows for ``pieces`` (laid out one after another), copy each into them, and
        leave the commit to ride on the next reserve (which publishes them with
        ``priority``, as the daemon checked it at this reserve)."""
        assert self.segment is not None
        num_rows = sum(lengths)
        fields: dict[str, Any] = {"rows": num_rows, "timeout_ms": int(self.reserve_timeout * 1000)}
        if priority is not None:
            fields["priority"] = priority
        if all(n == lengths[0] for n in lengths):
            fields["episodes"] = len(lengths)
        else:
            fields["lengths"] = lengths
        shape: Shape = (num_rows, fields.get("episodes"), fields.get("lengths"))
        # A write with a priority never takes (or sends) a reservation made ahead: its
        # reserve carries the priority its commit publishes.
        reply = self._take_ahead(shape if priority is None else None)
        if reply is None:
            previous, self._uncommitted = self._uncommitted, []
            fields.update(commit_fields([r for r, _, _ in previous]))
            reply = self.conn.call(
                "reserve", timeout=self.reserve_timeout + self.conn.timeout, **fields
            )
            for _, written, _ in previous:
                self._count(written)
        if self._ahead.wanted(shape, self._last_write, with_priority=priority is not None):
            # it carries the pending commits of the writes before this one
            previous, self._uncommitted = self._uncommitted, []
            self._ahead.send(shape, [(r, w) for r, w, _ in previous])
        elif not self._ahead.holding:  # this write's rows came ahead: send the commits now
            self._commit_if_due(now=True)
        # else reservations ahead are in hand: the next batch's reserve carries the commits
        self._collect_acks(block=False)
        reservation = reply["reservation"]
        ranges = [(int(s), int(e)) for s, e in reply["ranges"]]
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
        self._last_write = time.monotonic()
        self._uncommitted.append((reservation, (num_rows, len(lengths)), self._last_write))
        if self.commit_delay <= 0:
            self._commit_if_due(now=True)
        else:
            self._start_ticker()

    # -- reserving ahead (shmbuffer/clients/ahead.py) ------------------------------------------

    def _take_ahead(self, shape: Shape | None) -> dict[str, Any] | None:
        """The reply of the reserve sent ahead if it reserved ``shape``, else None."""
        reply, written = self._ahead.take(shape)
        self._count(written)
        return reply

    def _count(self, written: Written) -> None:
        """Count what an acknowledged commit published."""
        self.rows_committed += written[0]
        self.episodes_committed += written[1]

    def _return_ahead(self, idle_only: bool) -> None:
        if self._ahead.due_back(idle_only, self._last_write):
            self._take_ahead(None)  # None matches no shape: a granted reservation is aborted

    def _start_ticker(self) -> None:
        if self._ticker is None and self.commit_delay > 0:
            # A weak reference: the thread must not keep an unclosed writer alive forever.
            tick = weakref.WeakMethod(self._commit_from_ticker)
            self._ticker = Ticker(self.commit_delay / 2, tick, "shmbuffer-commit")

    def _commit_if_due(self, now: bool = False) -> None:
        """Send the pending commits on their own (without waiting for the replies), each
        once it has waited ``commit_delay`` seconds, or all at once when ``now``."""
        due = time.monotonic() - self.commit_delay
        while self._uncommitted and (now or self._uncommitted[0][2] <= due):
            reservation, written, _ = self._uncommitted.pop(0)
            self._in_flight.append((self.conn.send("commit", reservation=reservation), written))

    def _commit_from_ticker(self) -> None:
        # An idle writer's last episode must not wait for a next write that may never come
        # (its reservation would expire): the ticker stores and commits what is due.
        if not self._tick_due(time.monotonic()):
            return
        with self._lock:
            if self._closed or self._ticker_error is not None:
                return
            try:
                if self._staged and time.monotonic() - self._staged_since >= self.commit_delay:
                    self._write_staged()
                self._commit_if_due()
                self._return_ahead(idle_only=True)
            except Exception as exc:  # raised to the caller at its next call
                self._ticker_error = exc

    def _tick_due(self, now: float) -> bool:
        """Whether a tick may find work, read without the lock: a streaming writer holds it
        for every write, and a tick that queued on it cost a wake-up and a GIL hand-over per
        tick (~4% of a one-writer image stream). A stale read only moves the work one tick."""
        delay = self.commit_delay
        if self._staged and now - self._staged_since >= delay:
            return True
        pending = self._uncommitted
        if pending and now - pending[0][2] >= delay:
            return True
        return self._ahead.holding and now - self._last_write >= delay

    def _check_ticker(self) -> None:
        error, self._ticker_error = self._ticker_error, None
        if error is not None:
            raise error

    def _write_remote(
        self,
        leaves: dict[Any, Any],
        first_row: int,
        num_rows: int,
        num_sub: int,
        priority: float | bytes | None = None,
    ) -> None:
        assert self.schema is not None
        extra = {} if priority is None else {"priority": priority}
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
            episodes=num_sub,
            timeout_ms=int(self.reserve_timeout * 1000),
            **extra,
        )
        self._count((num_rows, num_sub))

    def _collect_acks(self, block: bool) -> None:
        """Take the replies of commits sent earlier; raises the first error among them."""
        while self._in_flight:
            seq, written = self._in_flight[0]
            if not block and not self.conn.ready(seq):
                return
            # Taken off first: a refused commit (out_of_space) is reported once, and a later
            # flush must not wait for a reply already consumed.
            self._in_flight.pop(0)
            self.conn.wait(seq)
            if written is not None:  # an abort's reply says nothing to count
                self._count(written)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until everything written so far is committed and visible to readers.
        Pending (unfinished) episodes are not written: end them first if you want them."""
        self.conn.check()
        with self._lock:
            self._flush(timeout)

    def _flush(self, timeout: float | None) -> None:
        self._check_ticker()
        # Nothing is reserved ahead of what is flushed now, and the write after a flush starts
        # a stream anew (a loop of write + flush never reserves ahead only to give it back).
        self._last_write = 0.0
        self._write_staged()
        self._return_ahead(idle_only=False)
        self._commit_if_due(now=True)
        if self._in_flight:
            self.conn.wait_all([seq for seq, _ in self._in_flight], timeout)
            self._collect_acks(block=True)

    def close(self, timeout: float | None = None) -> None:
        """Commit and wait for everything written, then disconnect. Safe to call twice.
        In a process forked from the writer's, only this copy is dropped: what it staged
        is the parent's to commit, and the socket is the parent's."""
        if self.conn.forked:
            self._closed = True
            self.conn.close()
            return
        with self._lock:
            if self._closed:
                return
            try:
                self._flush(timeout)
            finally:
                self._closed = True
                if self.segment is not None:
                    self.segment.close()
                    self.segment = None
                self.conn.close()
        if self._ticker is not None:  # outside the lock: its last tick may be waiting for it
            self._ticker.stop()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _host(value: Any) -> Any:
    """A tensor (on any device, maybe needing grad) as a numpy array; others as given."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return value


def _compact(items: Items) -> float | bytes | None:
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
