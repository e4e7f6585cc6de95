"""The daemon's read ops: ``sample`` (rows, slices, episodes), ``iterate`` and ``read``, lease
``release``/``renew``, and ``update_priorities``.

A sample reply carries the generation stamps of the rows it names: a reader that copies them
and finds the same stamps afterwards knows no writer touched them meanwhile (a mismatch means
"sample again"). Leased episodes need no stamps: no writer can reach them until released. A
sample that flow control holds back, or that a consume-once sampler has nothing for yet,
raises :class:`~shmbuffer.daemon.state.Deferred`. Each op that draws, counts or sets
priorities does so on the table its ``table`` field names (absent: the default table); an
unknown name is refused naming the tables there are.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shmbuffer.daemon.clients import Client
from shmbuffer.daemon.journal import record_bytes
from shmbuffer.daemon.state import DaemonState, Deferred, Frames, Reply
from shmbuffer.errors import (
    EmptyBufferError,
    InvalidArgumentError,
    LimitExceededError,
    SchemaError,
    TornReadError,
    WaitTimeoutError,
)
from shmbuffer.ring.container import EpisodeSample, RowSample, SliceSample
from shmbuffer.ring.table import Table
from shmbuffer.storage import rows
from shmbuffer.wire.protocol import (
    decode_f64,
    decode_i64,
    encode_f64,
    encode_i64,
)


class SampleOps(DaemonState):
    def op_sample(
        self, client: Client, fields: dict[str, Any], frames: Frames, now: float
    ) -> Reply:
        # A lease to release first is released once: a retry is parked without it.
        rest = None
        if "release" in fields:
            self.leases.release(fields["release"], client.id)
            rest = {k: v for k, v in fields.items() if k != "release"}
        deadline = now + fields.get("timeout_ms", 30_000) / 1000
        table = self.container.table_named(fields.get("table"))
        try:
            return self._sample(client, fields, now, table)
        except WaitTimeoutError as exc:  # the rate limiter refuses it now: wait in the daemon
            raise Deferred(str(exc), deadline, "sample", rest) from None
        except EmptyBufferError as exc:
            # A sampler that declares it waits for data (FIFO, consume-once) waits for
            # writers; an empty buffer under any other is an error at once, as it always was.
            if not table.sampler.waits_when_empty:
                raise
            raise Deferred(f"nothing to consume yet: {exc}", deadline, "sample", rest) from None

    def _sample(self, client: Client, fields: dict[str, Any], now: float, table: Table) -> Reply:
        """Draw through ``table``'s sampler (which counts the reads and tells the limiter), as
        in the in-process Buffer; every size limit is checked before the draw, since a
        consume-once sampler hands its items out for good."""
        kind, n, beta = fields["kind"], fields["n"], fields.get("beta")
        if fields.get("payload") and self.schema is not None and self.schema.has_frames:
            raise InvalidArgumentError(  # built where the rows are mapped (api/framegather.py)
                "a remote reader cannot sample a buffer with frame stacks or next_of columns: "
                "read it through a local Reader, which builds the stacks from the shared rows"
            )
        c = self.container
        where = fields.get("where")
        among = None if where is None else self.meta.subset(where, table)
        reply: dict[str, Any] = {}
        drawn: RowSample | SliceSample | EpisodeSample
        leased = fields.get("lease", False) and not fields.get("payload", False)
        held = self.leases.count_owner(client.id) if leased else 0
        if held >= self.config.max_leases_per_client:
            raise LimitExceededError(
                f"client {client.id} holds {held} leases (limit max_leases_per_client="
                f"{self.config.max_leases_per_client}); release some"
            )
        if kind == "rows":
            self._check_sample_size(n, fields)
            drawn = table.sample_rows(n, beta=beta, among=among)
            physical = index = drawn.rows
            reply["rows"] = encode_i64(physical)
            if fields.get("context", False):  # where each row lies in its episode
                before, left = c.extent(physical)
                reply.update(before=encode_i64(before), left=encode_i64(left))
        elif kind == "slices":
            length = fields["length"]  # validation made sure of it
            self._check_sample_size(n * length, fields)
            strict = fields.get("strict", True)
            sliced = table.sample_slices(n, length, strict=strict, beta=beta, among=among)
            drawn, physical, index = sliced, sliced.rows, sliced.starts
            reply["starts"] = encode_i64(sliced.starts)
            if not strict:  # a padded slice's real rows: a prefix of its length
                reply["lengths"] = encode_i64(sliced.lengths)
        else:
            if c.num_episodes:  # the lengths are known after the draw: judge by the mean
                self._check_sample_size(n * max(1, c.num_rows // c.num_episodes), fields)
            episodes = table.sample_episodes(n, beta=beta, among=among)
            ids, index = episodes.ids, episodes.starts
            drawn, physical = episodes, episodes.rows
            if not table.sampler.waits_when_empty:  # drawn for good otherwise: never refuse
                self._check_sample_size(physical.size, fields)
            reply.update(
                ids=encode_i64(ids),
                starts=encode_i64(index),
                lengths=encode_i64(episodes.ends - index),
            )
            if leased:
                reply["lease"] = self.leases.grant(client.id, ids.tolist(), now).id
        if leased and kind != "episodes":
            # The episodes holding the rows, pinned until the reader's copy is done: what a
            # consume-once sampler hands out may be overwritten the moment it is consumed
            # (the writer waiting for it is retried at once), before the reader copied it.
            reply["lease"] = self.leases.grant(client.id, self._holding(physical), now).id
        if fields.get("info", False):  # per item: its physical (first) row and its stamp
            reply.update(
                index=encode_i64(index),
                generation=encode_i64(self.generations[index]),
                probability=encode_f64(drawn.probability),
                weight=encode_f64(drawn.weight),
            )
        self.counters.samples += 1
        self.counters.rows_sampled += len(physical)
        client.rows_sampled += len(physical)
        if fields.get("payload", False):  # remote reader: the daemon copies the rows out
            assert self.segment is not None
            data = rows.gather_columns(self.segment.columns, physical, self.segment.arrays)
            return reply, [rows.to_bytes(t, t.dtype) for t in data.values()]
        if kind != "episodes":  # leased episodes need no stamps: no writer can reach them
            reply["gens"] = encode_i64(self.generations[physical])
        return reply, []

    def op_episodes(
        self, client: Client, fields: dict[str, Any], frames: Frames, now: float
    ) -> Reply:
        """The live episodes a filter selects, ordered and cut, with every metadata name:
        ids as int64 bytes, per name its kind and its values (nil where an episode has none)."""
        meta = self.meta
        where = fields.get("where")
        found = meta.select(
            None if where is None else meta.parsed(where),
            fields.get("order_by"),
            fields.get("limit"),
        )
        columns = {}
        for name, column in found.columns.items():
            if name == "id":
                continue
            values = column.data.tolist()
            for i in np.flatnonzero(np.ma.getmaskarray(column)).tolist():
                values[i] = None
            columns[name] = values
        return {"ids": encode_i64(found.ids), "kinds": meta.kinds, "columns": columns}, []

    def op_drawn(self, client: Client, fields: dict[str, Any], frames: Frames, now: float) -> Reply:
        """Rows a reader drew itself over the published runs (``ring/publisher.py``), sent
        in bulk after the fact, as two payload frames (the rows, their stamps then): counted
        as the daemon counts the rows of its own draws (use counts, the limiter's sampled
        figure, the counters). Nothing is journaled, as for the daemon's own draws of such a
        table: they change no sampler state."""
        num_rows = fields["rows"]
        size = 16 * num_rows
        if size > self.config.max_payload_bytes:
            raise LimitExceededError(
                f"op 'drawn': {num_rows:,} rows make a payload of {size:,} bytes, over the "
                f"limit max_payload_bytes={self.config.max_payload_bytes:,}; report fewer"
            )
        sizes = [memoryview(frame).nbytes for frame in frames]
        if sizes != [8 * num_rows] * 2:
            raise InvalidArgumentError(
                f"op 'drawn': expected two payload frames of {8 * num_rows} bytes (the rows and "
                f"their stamps, int64), got {sizes}"
            )
        physical = np.frombuffer(frames[0], dtype="<i8").astype(np.int64, copy=False)
        gens = np.frombuffer(frames[1], dtype="<i8").astype(np.int64, copy=False)
        outside = (physical < 0) | (physical >= self.config.capacity)
        if outside.any():
            raise InvalidArgumentError(
                f"op 'drawn': row {int(physical[outside][0])} is out of range for a buffer of "
                f"capacity {self.config.capacity}"
            )
        table = self.container.table_named(fields.get("table"))
        counted = table.count_drawn(physical, gens, self.generations)
        self.counters.samples += fields["samples"]
        self.counters.rows_sampled += num_rows
        client.rows_sampled += num_rows
        return {"counted": counted}, []

    def _holding(self, physical: np.ndarray) -> list[int]:
        """Ids of the episodes holding ``physical`` rows (one registry query per run of
        consecutive rows: a FIFO's rows and a slice are runs)."""
        order = np.unique(physical)
        breaks = np.flatnonzero(np.diff(order) != 1) + 1
        registry = self.container.registry
        ids: set[int] = set()
        for run in np.split(order, breaks) if order.size else []:
            ids.update(ep.id for ep in registry.overlapping(int(run[0]), int(run[-1]) + 1))
        return sorted(ids)

    def _check_sample_size(self, num_rows: int, fields: dict[str, Any]) -> None:
        """Refuse a sample whose reply would exceed ``max_payload_bytes`` before any of it is
        built (rows travel as frames to a remote reader; as indices and stamps otherwise)."""
        per_row = 16  # an index and a generation stamp
        if fields.get("payload", False) and self.schema is not None:
            per_row = self.schema.row_nbytes
        size = num_rows * per_row
        if size > self.config.max_payload_bytes:
            raise LimitExceededError(
                f"op 'sample': {num_rows:,} rows make a reply of {size:,} bytes, over the "
                f"limit max_payload_bytes={self.config.max_payload_bytes:,}; sample fewer rows"
            )

    def update_priorities(
        self, rows: Any, priority: Any, generation: Any = None, table: str | None = None
    ) -> int:
        """Set priorities of sampled rows of ``table`` (None: the default one; the
        ``update_priorities`` op's work): validated (invalid_argument, nothing done), rows
        whose generation stamp changed since the sample left out and counted stale, the rest
        journaled (PRIORITY, naming the table) before the reply."""
        c = self.container
        chosen = c.table_named(table)
        update = chosen.check_priorities(rows, priority, generation, self.generations)
        self._journal_room(record_bytes(2 + 2 * update.rows.size))
        applied = chosen.apply_priorities(update)
        if self.journal is not None and update.rows.size:
            index = list(c.tables.values()).index(chosen)
            self.journal.append_priorities(update.rows, update.priority, index)
        return applied

    def op_update_priorities(
        self, client: Client, fields: dict[str, Any], frames: Frames, now: float
    ) -> Reply:
        generation = fields.get("generation")
        table = self.container.table_named(fields.get("table"))
        stale = table.priority_updates_stale
        updated = self.update_priorities(
            decode_i64(fields["index"]),
            decode_f64(fields["priority"]),
            None if generation is None else decode_i64(generation),
            fields.get("table"),
        )
        return {"updated": updated, "stale": table.priority_updates_stale - stale}, []

    def op_iterate(
        self, client: Client, fields: dict[str, Any], frames: Frames, now: float
    ) -> Reply:
        """This rank's rows of one pass over everything stored (``Container.rank_rows``),
        with their stamps: the reader copies them batch by batch and checks the stamps."""
        world_size = fields["world_size"]
        total = self.container.num_rows
        share = -(-total // world_size)
        if share * 16 > self.config.max_payload_bytes:
            raise LimitExceededError(
                f"op 'iterate': {share:,} rows per rank make a reply of {share * 16:,} bytes, "
                f"over the limit max_payload_bytes={self.config.max_payload_bytes:,}; use "
                "more ranks"
            )
        table = self.container.table_named(fields.get("table"))  # whose use counts it raises
        physical = table.rank_rows(
            fields["rank"],
            world_size,
            shuffle=fields.get("shuffle", True),
            drop_last=fields.get("drop_last", False),
            seed=[self._iterate_seed, fields.get("epoch", 0)],
        )
        table.count_use(physical)
        gens = self.generations[physical]
        return {"rows": encode_i64(physical), "gens": encode_i64(gens), "total": total}, []

    def op_read(self, client: Client, fields: dict[str, Any], frames: Frames, now: float) -> Reply:
        """A remote reader's copy of rows it was handed by physical index (``iterate``),
        refused whole (``torn``) if a writer reached any of them since ``gens`` were taken."""
        if self.segment is None:
            raise SchemaError("the buffer has no schema yet: nothing to read")
        physical, gens = decode_i64(fields["rows"]), decode_i64(fields["gens"])
        outside = (physical < 0) | (physical >= self.config.capacity)
        if outside.any():
            raise InvalidArgumentError(
                f"op 'read': row {int(physical[outside][0])} is out of range for a buffer of "
                f"capacity {self.config.capacity}"
            )
        self._check_sample_size(physical.size, {"payload": True})
        moved = self.generations[physical] != gens
        if moved.any():
            raise TornReadError(
                f"op 'read': {int(moved.sum())} of {physical.size} rows were overwritten since "
                f"they were listed (row {int(physical[moved][0])}); iterate over a buffer no "
                "writer is writing to"
            )
        data = rows.gather_columns(self.segment.columns, physical, self.segment.arrays)
        return {}, [rows.to_bytes(t, t.dtype) for t in data.values()]

    def op_release(
        self, client: Client, fields: dict[str, Any], frames: Frames, now: float
    ) -> Reply:
        self.leases.release(fields["lease"], client.id)
        return {}, []

    def op_renew(self, client: Client, fields: dict[str, Any], frames: Frames, now: float) -> Reply:
        """A reader's heartbeat for a lease it still uses: another ``lease_ttl`` from now."""
        self.leases.renew(fields["lease"], client.id, now)
        return {"ttl": self.config.lease_ttl}, []
