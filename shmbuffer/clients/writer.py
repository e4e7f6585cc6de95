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

This module checks and plans each write; :mod:`shmbuffer.clients.pipeline` stages, reserves,
copies and commits it. A Writer never closed still stores what it was given, when it is
collected or the interpreter exits (the pipeline's finaliser, bounded by ``timeout``).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from shmbuffer.api.episodes import DEFAULT_DONE_KEYS, EpisodeAssembler, FinishedEpisode
from shmbuffer.api.metadata import check_values
from shmbuffer.api.tables import checked_tables
from shmbuffer.api.writeplan import plan_write, vector_episode, write_priority
from shmbuffer.clients.connection import Connection
from shmbuffer.clients.packed_io import PackedWrites, refuse_remote, write_packed
from shmbuffer.clients.pipeline import WritePipeline, compact
from shmbuffer.clients.rewrites import rewrite
from shmbuffer.samplers import SAMPLERS
from shmbuffer.storage.packed import packed_fields
from shmbuffer.storage.schema import Schema
from shmbuffer.storage.segment import Segment

#: The largest write the Writer gathers with others (see ``batch_bytes``): a larger one is
#: stored at once, since copying it twice would cost more than its round trip. Batches are
#: larger (``batch_bytes``, 8 MiB): with one or two small-row writers, each doubling of the
#: batch from 1 MiB gave more rows/s, the daemon's work per reservation amortised.
STAGE_MAX_BYTES = 512 << 10

#: Scalars attached to an episode (``docs/metadata.md``).
Meta = Mapping[str, Any] | None


class Writer:
    """Writes into the buffer served by a daemon.

    Args:
        target: a buffer name (found through its runtime file) or an endpoint.
        remote: send rows over the socket instead of writing shared memory (automatic for a
            ``tcp://`` endpoint on another host).
        timeout: seconds any single wait on the daemon may take; also all that a Writer
            never closed waits, when it is collected or the interpreter exits, to store what
            it was given (then an :class:`~shmbuffer.errors.UnstoredWritesWarning` names the
            rows it could not).
        reserve_timeout: seconds a reservation may wait for readers' leases to end.
        commit_delay: seconds a copied episode may wait for the next write to carry its commit,
            and a small write may wait to share a round trip with the next ones. 50 ms: with
            two env workers, a learner and the daemon on two cores, a fifth of it (one
            blocking reserve per worker that often) gave fewer env steps per second.
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
        conn = Connection(
            target,
            "writer",
            timeout=timeout,
            remote=remote,
            curve_server_key=curve_server_key,
            curve_client_cert=curve_client_cert,
        )
        self._pipe = WritePipeline(conn, reserve_timeout, commit_delay, batch_bytes)
        # Holds the pipeline, never the Writer: one collected, or left at interpreter exit,
        # without close() still stores what it was given (a file object flushes the same way).
        self._finalizer = weakref.finalize(self, self._pipe.finalise)
        self.conn = conn
        self.remote = conn.remote
        self.assembler = EpisodeAssembler(
            num_envs=num_envs,
            auto_truncate=auto_truncate,
            done_keys=done_keys,
            postprocess_fn=postprocess_fn,
        )
        self.capacity: int = conn.buffer["capacity"]
        self.unit: str = conn.buffer["unit"]
        self.mode: str = conn.buffer["mode"]
        #: The daemon's sampler (a daemon before protocol 1.2 samples uniformly).
        self.sampler: str = conn.buffer.get("sampler", "uniform")
        #: Whether that sampler declares priorities (one this side does not know: no).
        kind = SAMPLERS.get(self.sampler)
        self._keeps_priorities = kind is not None and kind.has_priorities
        self.batch_bytes = batch_bytes
        self._packed: PackedWrites | None = None  # compressed columns' chunks, once known
        #: The daemon's tables (one, "default", before protocol 1.9).
        self._table_names = [t["name"] for t in conn.buffer.get("tables") or []] or ["default"]
        #: The metadata kinds known here (the daemon's at hello, then this writer's own).
        info = conn.buffer.get("meta") or {}
        self._meta_kinds: dict[str, str] = dict(info.get("kinds") or {})
        self._meta_declared = bool(info.get("declared", False))

    @property
    def schema(self) -> Schema | None:
        """The buffer's schema; None while a lazy one waits for the first write."""
        return self._pipe.schema

    @property
    def segment(self) -> Segment | None:
        """The shared segment this (local) writer copies into, once there is a schema."""
        return self._pipe.segment

    @property
    def episodes_committed(self) -> int:
        """Episodes this writer's acknowledged commits published."""
        return self._pipe.episodes_committed

    @property
    def rows_committed(self) -> int:
        """Rows this writer's acknowledged commits published."""
        return self._pipe.rows_committed

    # -- the Buffer API -----------------------------------------------------------------------

    def extend(
        self,
        batch: Mapping[str, Any],
        priority: Any = None,
        meta: Meta = None,
        tables: Sequence[str] | None = None,
    ) -> None:
        """Write a chunk of transitions (or, in episode unit, one whole episode).

        ``priority`` (a daemon with ``--sampler prioritized`` only): one number, one value
        per row (transition unit) or one for the episode (episode unit); None gives the
        largest priority seen so far. Checked before anything is written (InvalidArgumentError
        naming the value); at most 4096 distinct values a write. ``meta``: scalars to attach
        to what is written (``docs/metadata.md``), checked here against the kinds this writer
        knows and by the daemon at the commit. ``tables``: the daemon's tables it goes into
        (None: every one; ``docs/tables.md``), refused here naming the tables there are."""
        self.conn.check()
        with self._pipe.lock:
            into = self._checked_tables(tables)
            self._write(batch, priority=priority, meta=self._checked_meta(meta), tables=into)

    def add_episode(
        self,
        episode: Mapping[str, Any],
        num_envs: int = 1,
        priority: Any = None,
        meta: Meta = None,
        tables: Sequence[str] | None = None,
    ) -> None:
        """Write a finished episode; with ``num_envs > 1`` its leaves are ``[L, num_envs,
        ...]`` and each sub-env becomes its own episode. ``priority`` as for :meth:`extend`;
        with ``num_envs > 1`` one value per sub-episode (episode unit) or per row, shaped
        ``[L, num_envs]`` like the data (transition unit). ``meta``: scalars to attach to the
        episode (to each sub-episode), and ``tables``, as :meth:`extend` takes them."""
        # Checked before the lock (a forked child may inherit it held) and before anything is
        # staged: a closed or forked writer must refuse the write, not drop it.
        self.conn.check()
        with self._pipe.lock:
            checked, into = self._checked_meta(meta), self._checked_tables(tables)
            if num_envs == 1:
                self._write(episode, priority=priority, meta=checked, tables=into)
                return
            batch, priority = vector_episode(episode, num_envs, self.unit, priority)
            self._write(
                batch, num_sub_episodes=num_envs, priority=priority, meta=checked, tables=into
            )

    def add_transition(
        self,
        env_id: str,
        transition: Mapping[str, Any],
        meta: Meta = None,
        tables: Sequence[str] | None = None,
    ) -> None:
        """Append one step of ``env_id``; ``meta`` is merged into the metadata of the episode
        in progress and attached when it ends (a later value of a name replaces one before);
        ``tables``, where given, are the tables that episode goes into (the last given wins;
        never given: every table)."""
        self.conn.check()
        with self._pipe.lock:
            checked = self._checked_meta(meta)
            self._checked_tables(tables)  # refused before the step is taken
            finished = self.assembler.add_transition(env_id, transition, checked, tables)
            self._write_finished(finished)

    def end_episode(self, env_id: str) -> None:
        self.conn.check()
        with self._pipe.lock:
            self._write_finished(self.assembler.end_episode(env_id))

    def truncate_episodes(self, env_ids: Iterable[str]) -> None:
        for env_id in env_ids:
            self.end_episode(env_id)

    def _write_finished(self, episodes: list[FinishedEpisode]) -> None:
        for ep in episodes:
            self._write(
                ep.data,
                num_sub_episodes=ep.num_sub_episodes,
                meta=dict(ep.meta) or None,
                tables=self._checked_tables(ep.tables),
            )

    def _checked_tables(self, tables: Sequence[str] | None) -> list[str] | None:
        """The tables a write goes into as the daemon takes them (None: every table), checked
        against the daemon's tables with a Buffer's words (``api/tables.checked_tables``)."""
        return checked_tables(tables, self._table_names)

    def _checked_meta(self, meta: Meta) -> dict[str, Any] | None:
        """``meta`` as plain scalars, checked against the kinds the daemon declared or this
        writer gave first (the daemon checks again at the commit: another writer may have
        fixed a name's kind since)."""
        if meta is None:
            return None
        values, new = check_values(meta, self._meta_kinds, self._meta_declared)
        self._meta_kinds.update(new)
        return values

    # -- the write path -----------------------------------------------------------------------

    def _write(
        self,
        batch: Mapping[str, Any],
        num_sub_episodes: int = 1,
        priority: Any = None,
        meta: dict[str, Any] | None = None,
        tables: list[str] | None = None,
    ) -> None:
        self._pipe.check_ticker()
        # Refused here, before any copy, if it does not fit the schema; and a lazy schema is
        # defined only by a batch that passed every check the Writer can make.
        plan = plan_write(self.schema, batch, num_sub_episodes, self.capacity, self.mode, self.unit)
        if plan is None:
            return
        schema, leaves, first_row, num_rows, kept, _ = plan
        items = None
        if priority is not None:
            items = write_priority(
                priority, plan, self.unit, sampler=self.sampler, keeps=self._keeps_priorities
            )
        one = compact(items)  # refuses too many distinct values before anything is sent
        if packed_fields(schema):  # compressed columns: clients/packed_io.py
            self._write_packed(schema, leaves, first_row, plan.lengths, one, meta, tables)
            return
        if self.remote:  # its rows travel as one payload
            self.conn.check_payload("write", num_rows * schema.row_nbytes)
        pipe = self._pipe
        if self.schema is None:  # SchemaError if another writer defined a different one
            pipe.adopt(self.conn.call("define_schema", schema=schema.to_spec())["buffer"])
        assert self.schema is not None
        if self.remote:
            pipe.write_remote(leaves, first_row, num_rows, kept, one, meta, tables)
        elif meta is None and tables is None and self._gathers(num_rows):
            # (one reservation carries one meta and one set of tables for all it holds)
            pipe.stage(leaves, first_row, num_rows, plan.lengths, items)
        else:
            pipe.write_staged()  # what came first is stored first
            pipe.write_local([(leaves, first_row, num_rows)], plan.lengths, one, meta, tables)

    def _write_packed(
        self,
        schema: Schema,
        leaves: dict[Any, Any],
        first_row: int,
        lengths: list[int],
        priority: float | bytes | None,
        meta: dict[str, Any] | None,
        tables: list[str] | None,
    ) -> None:
        """A write of a buffer with compressed columns: compressed here, then reserved with
        its chunk sizes and copied (never staged, never reserved ahead)."""
        if self.remote:
            refuse_remote(schema, "writer")
        pipe = self._pipe
        if self.schema is None:  # SchemaError if another writer defined a different one
            pipe.adopt(self.conn.call("define_schema", schema=schema.to_spec())["buffer"])
        if self._packed is None:
            assert pipe.segment is not None
            self._packed = PackedWrites(schema, pipe.segment.path)
        pipe.write_staged()  # what came first is stored first
        write_packed(pipe, self._packed, leaves, first_row, lengths, priority, meta, tables)

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

    def flush(self, timeout: float | None = None) -> None:
        """Wait until everything written so far is committed and visible to readers.
        Pending (unfinished) episodes are not written: end them first if you want them."""
        self.conn.check()
        with self._pipe.lock:
            self._pipe.flush(timeout)

    def rewrite(self, index: Any, data: Mapping[str, Any], *, generation: Any = None) -> np.ndarray:
        """Change committed rows in place: rows ``index`` (physical rows, as a sample's
        ``index``) of the keys ``data`` holds (some of the schema's stored keys, or all; one
        value per row) get ``data``. Returns which rows were written (a boolean mask).

        With ``generation`` (the rows' stamps when read: a sample's ``info["generation"]``),
        a row overwritten since, or no longer stored, is skipped and left out of the mask;
        without it such rows are refused (InvalidArgumentError naming them), nothing written.
        This writer's own writes are flushed first. The bytes travel to the daemon, which
        copies them in itself, re-stamping the rows' episodes first (every row committed
        with them: stamps held for any of those, a sample's ``generation``, are out of date
        afterwards), so readers copying them meanwhile copy again; it waits while readers
        lease those episodes (``reserve_timeout``). Priorities, episodes and places do not
        change (``docs/protocol.md``, ``rewrite``)."""
        self.flush()
        return rewrite(self.conn, self.schema, index, data, generation, self._pipe.reserve_timeout)

    def placing(self) -> None:
        """Start recording where this writer's rows land: :meth:`placed` says, for the rows
        written from here on, in the order they were written. Call it with nothing staged
        (after a :meth:`flush`)."""
        with self._pipe.lock:
            self._pipe.flush(None)
            self._pipe.placed = []

    def placed(self) -> np.ndarray | None:
        """The physical rows the writes since :meth:`placing` went to, in order (a flush
        first), and stop recording. None where this writer cannot tell: remote (the daemon
        copies the rows) or not asked."""
        with self._pipe.lock:
            self._pipe.flush(None)
            ranges, self._pipe.placed = self._pipe.placed, None
        if ranges is None or self.remote:
            return None
        parts = [np.arange(start, end, dtype=np.int64) for start, end in ranges]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def close(self, timeout: float | None = None) -> None:
        """Commit and wait for everything written, then disconnect. Safe to call twice.
        In a process forked from the writer's, only this copy is dropped: what it staged
        is the parent's to commit, and the socket is the parent's."""
        self._finalizer.detach()  # closed here: nothing is left for the finaliser
        self._pipe.close(timeout)

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
