"""What every part of the daemon's request handling shares: the container (ring, registry,
reservations, sampler, rate limiter), the shared segment and its per-row generation stamps,
leases, client records, counters and the journal.

:class:`DaemonState` holds them and the steps they share (creating the segment, reserving
journal room before a change, journaling it after); the ops that change them are grouped by
job on top of it: :class:`~shmbuffer.daemon.writes.WriteOps` (reserve, commit, abort, write),
:class:`~shmbuffer.daemon.samples.SampleOps` (sample, iterate, read, leases, priorities), and
:class:`~shmbuffer.daemon.service.BufferService` (clients, admin, time, stats), which is all of
them together. A handler returns reply fields and payload frames, raises a
:class:`~shmbuffer.errors.ShmBufferError` that becomes an error reply, or raises
:class:`Deferred` when the request must wait.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from shmbuffer.daemon.checkpoint import open_destination
from shmbuffer.daemon.checkpoint_job import CheckpointJob, Cut
from shmbuffer.daemon.clients import ClientTable
from shmbuffer.daemon.config import DaemonConfig
from shmbuffer.daemon.journal import Journal
from shmbuffer.daemon.leases import LeaseTable
from shmbuffer.daemon.packing import DaemonBytes, packed_names
from shmbuffer.daemon.pins import Pin, PinTable
from shmbuffer.daemon.processes import Process
from shmbuffer.daemon.saved_state import container_state
from shmbuffer.daemon.security import segment_access
from shmbuffer.daemon.stats import Counters, RateMeter
from shmbuffer.errors import CheckpointError, OutOfSpaceError
from shmbuffer.registry.shared_spans import SPANS_FILE, SpansFile
from shmbuffer.ring.container import Container
from shmbuffer.ring.meta import EpisodeMeta
from shmbuffer.ring.publisher import SpansPublisher
from shmbuffer.ring.table import Table
from shmbuffer.storage.cuda_segment import check_room, create_segment
from shmbuffer.storage.packed import packed_fields, refuse_packed
from shmbuffer.storage.schema import Schema
from shmbuffer.storage.segment import Segment

log = logging.getLogger("shmbuffer.daemon")

Frames = list[bytes | memoryview]
#: What a handler returns: the reply's fields (``protocol.REPLIES`` lists them; the tests hold
#: real replies to it) and payload frames (rows for remote clients; usually none).
Reply = tuple[dict[str, Any], Frames]


class Deferred(Exception):
    """The request cannot proceed yet; retry it until ``deadline`` (monotonic seconds).

    ``blocked``: ``"insert"`` or ``"sample"`` when flow control holds it back (the rate
    limiter, or a FIFO sampler), so the time it waits counts in the limiter's figures; None
    for a wait on leases or on another writer. ``retry``: the request to park and retry
    instead of the one that came, when the handler did part of it already (a piggybacked
    commit, a lease released, a checkpoint started) — a new map, the request is never
    changed; None: retry the request as it came."""

    def __init__(
        self,
        reason: str,
        deadline: float,
        blocked: str | None = None,
        retry: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(reason)
        self.deadline = deadline
        self.blocked = blocked
        self.retry = retry

    def retrying(self, fields: dict[str, Any]) -> Deferred:
        """The same wait, with ``fields`` as the request to retry."""
        return Deferred(str(self), self.deadline, self.blocked, fields)


class DaemonState:
    def __init__(self, config: DaemonConfig, segment: Segment | None = None) -> None:
        self.config = config
        if segment is None and config.schema is not None:
            # before any per-row allocation below
            check_room(  # on the GPU too, with --device cuda
                config.device,
                config.name,
                Schema.from_spec(config.schema),
                config.capacity,
                config.storage_dir,
            )
        try:
            self.container = Container.of_tables(  # the first table is the default one
                config.capacity,
                config.make_tables(),
                mode=config.mode,
                unit=config.unit,
                seed=config.seed,
            )
        except MemoryError:
            raise OutOfSpaceError(
                f"capacity {config.capacity:,} rows: the daemon cannot allocate its per-row "
                f"bookkeeping (about {12 * config.capacity:,} bytes of memory)"
            ) from None
        # Every episode's metadata, kept from the start: what writers attach to their commits,
        # and the length, commit time and writer the daemon records (``ring/meta.py``); the
        # tables whose draws it bounds read it too (``--table recent:uniform,max-episodes=N``).
        self.container.bound_tables(config.tables, config.meta)
        self.container.keep_meta(config.meta)
        self.leases = LeaseTable(config.lease_ttl)
        self.clients = ClientTable(config.max_clients, config.client_idle_ttl)
        #: Reservations pinned to the local writer process copying into them (pins.py).
        self.pins = PinTable()
        #: The process a transport vouches for behind a client identity (the Server sets it
        #: to the lane's peer credentials; None: a pid only claimed).
        self.peer_process: Callable[[bytes], Process | None] = lambda identity: None
        self.counters = Counters()
        self.started = time.time()
        self.rates = RateMeter()
        #: Requests the server holds parked, by queue (it keeps this up to date, for stats).
        self.waiting = {"insert": 0, "sample": 0}
        #: Why the first parked write waits now (the server keeps it up to date; None: none).
        self.insert_wait: str | None = None
        #: Validated priorities of open reservations, for their commit (``reserve priority``).
        self._priorities: dict[int, Any] = {}
        #: iterate's shuffles are seeded with (this, epoch): every reader's k-th pass agrees,
        #: and agrees with an in-process Buffer of the same seed.
        entropy = np.random.SeedSequence(config.seed).entropy
        self._iterate_seed = int(entropy)  # type: ignore[arg-type]
        #: Why admin ops are refused on this daemon's transport (set by the Server from
        #: ``security.admin_refusal``; None: the role is enough, as on the ipc socket).
        self.admin_refused: str | None = None
        self.segment = segment
        if segment is not None:  # a next_of column's tail rows (api/frames.py)
            self.container.ring.tail = segment.schema.tail
        #: The byte store of compressed columns (None: the schema has none).
        self.bytes: DaemonBytes | None = None
        self.journal: Journal | None = None  # metadata log for --resume; see journal.py
        #: The live runs published for readers' own draws (``ring/publisher.py``); None
        #: before the segment, on a GPU, and, on a segment taken over, until the state is.
        self.spans: SpansPublisher | None = None
        #: The checkpoint being written (or the last one); see checkpoint.py.
        self.checkpoint_job: CheckpointJob | None = None
        #: Whether ``checkpoint`` replies later (the Server sets it: it parks the request until
        #: the copy is done); without a server the request waits for the copy itself.
        self.defer_checkpoints = False
        #: Called after ``configure`` changed the rate limiter (the command line keeps
        #: :meth:`resume_settings` in the runtime record: a daemon that dies before it has a
        #: segment has no journal to keep them).
        self.settings_changed: Callable[[], None] | None = None
        #: A segment created before lineages existed gets one per daemon process: its
        #: checkpoints link only to those this process wrote.
        self._lineage_fallback = uuid.uuid4().hex
        self.generations = (
            np.zeros(config.capacity, dtype=np.int64) if segment is None else segment.generations
        )
        if segment is None and config.schema is not None:
            self._create_segment(Schema.from_spec(config.schema))

    @property
    def schema(self) -> Schema | None:
        return None if self.segment is None else self.segment.schema

    def _create_segment(self, schema: Schema) -> None:
        if packed_fields(schema) and self.config.device != "cpu":
            refuse_packed(schema, f"a buffer on {self.config.device}")
        self.segment = create_segment(  # where config.device says (cuda_segment.py)
            self.config.device,
            self.config.name,
            schema,
            self.config.capacity,
            storage_dir=self.config.storage_dir,
            exist_ok=True,
            # Its pages reserved (posix_fallocate) but not mapped here: the daemon writes rows
            # only for remote writers; local writers and readers map and populate their own.
            # Mapping would cost twice the reservation's time, and the daemon's RSS.
            prefault=False,
            extra={
                "unit": self.config.unit,
                "mode": self.config.mode,
                "daemon_pid": os.getpid(),
                # which rows' stamps may be compared with a checkpoint's (checkpoint.py)
                "lineage": uuid.uuid4().hex,
                # readers with CUDA page-lock their mapping (cuda_segment.PinnedSegment)
                "pin_memory": self.config.pin_memory,
            },
            **segment_access(self.config.group),  # owner-only, or 0660 for --group
        )
        self.generations = self.segment.generations
        self.container.ring.tail = schema.tail  # before any reservation (api/frames.py)
        try:
            if packed_fields(schema):  # the byte store beside the rows (daemon/packing.py)
                nbytes = self.config.compressed_bytes
                self.bytes = DaemonBytes(schema, self.container, self.segment.path, nbytes)
            self.publish_spans()
            self._start_journal()
        except BaseException:  # no journal, no segment: a later schema must start over
            self.spans = None  # (its file went with the folder)
            self.segment.close()
            Segment.unlink(self.config.name, self.config.storage_dir)
            self.segment = None
            raise
        log.info(
            "allocated %s on %s: %d rows x %d bytes = %.1f MB (%s)",
            self.segment.path,
            self.segment.device,
            self.config.capacity,
            schema.row_nbytes,
            self.segment.nbytes / 1e6,
            schema,
        )

    def segment_info(self) -> dict[str, Any] | None:
        if self.segment is None:
            return None
        return {
            "name": self.segment.name,
            "path": str(self.segment.path),
            # the root itself, never None: the default root is per user, so a --group member
            # would look for it in a folder of its own
            "storage_dir": str(self.segment.path.parent),
        }

    def publish_spans(self) -> None:
        """Publish the live runs in ``spans.bin`` beside the rows from now on, so that readers
        draw uniform rows themselves (``registry/shared_spans.py``); a CPU segment only. A
        segment taken over (``--resume``) is published once its state is whole, never
        during the replay: the file holds the dead daemon's last runs until then, which stay
        true while no daemon grants a reservation."""
        if self.spans is not None or self.segment is None or self.segment.device != "cpu":
            return
        access = segment_access(self.config.group)
        out = SpansFile(self.segment.path / SPANS_FILE, access["file_mode"], access["group"])
        self.spans = SpansPublisher(self.container.table, out)

    def local_draws_info(self) -> dict[str, Any] | None:
        """The ``hello`` reply's word on local draws: the file's name and the seed a reader
        draws with (nil: from the OS), where this daemon publishes its runs."""
        if self.config.device != "cpu":
            return None
        seed = self.config.seed
        if seed is not None:  # a resumed daemon's may be 128 bits: a 62-bit one made of it
            seed = int(np.random.SeedSequence(seed).generate_state(1, np.uint64)[0] >> 2)
        return {"file": SPANS_FILE, "seed": seed}

    def buffer_info(self) -> dict[str, Any]:
        return {
            "name": self.config.name,
            "capacity": self.config.capacity,
            "unit": self.config.unit,
            "mode": self.config.mode,
            "schema": None if self.schema is None else self.schema.to_spec(),
            "segment": self.segment_info(),
            "lease_ttl": self.config.lease_ttl,
            "reservation_ttl": self.config.reservation_ttl,
            "max_payload_bytes": self.config.max_payload_bytes,
            "sampler": self.container.sampler.name,
            "max_times_sampled": self.container.sampler.max_times_sampled,
            "consumes": self.container.sampler.consuming,
            "local_draws": self.local_draws_info(),
            "meta": self.meta_info(),
            # since 1.9: every table, the default one first: what a Reader of one needs
            "tables": [
                {
                    "name": name,
                    "sampler": table.sampler.name,
                    "consumes": table.sampler.consuming,
                    "max_times_sampled": table.sampler.max_times_sampled,
                }
                for name, table in self.container.tables.items()
            ],
        }

    @property
    def meta(self) -> EpisodeMeta:
        meta = self.container.meta
        assert meta is not None  # kept from the start (a load keeps it too)
        return meta

    def meta_info(self) -> dict[str, Any]:
        """The metadata names a writer may attach and their kinds, and whether those are all
        (declared): what a Writer checks its values against before it writes."""
        meta = self.meta
        return {"kinds": dict(meta.kinds), "declared": meta.declared}

    def _start_journal(self) -> None:
        assert self.segment is not None
        journal = Journal(self.segment.path)
        # samples, leases and use counts survive --resume too (journal.py)
        journal.track(self.container, self.leases, self.clients, self._iterate_seed, pins=self.pins)
        journal.start(self.persistent_state(), state_fn=self.persistent_state)
        self.journal = journal  # only once it can take records

    def _journal_room(self, nbytes: int) -> None:
        """Reserve journal space for a request's records before it changes anything, so an
        acknowledged change is always on disk (OutOfSpaceError refuses the request)."""
        if self.journal is not None:
            self.journal.reserve(nbytes)

    def _journal_reserve(self, evicted: list[tuple[int, int]], pin: Pin | None = None) -> None:
        if self.journal is not None:
            c = self.container
            self.journal.append_reserve(evicted, c.pointer, c.rows_written, c.next_reservation, pin)

    def _journal_commit(
        self,
        ids: list[int],
        bounds: list[tuple[int, int]],
        tables: int,
        commit_time: float,
        writer: str,
        meta_payload: bytes | None,
    ) -> None:
        """A COMMIT record (into the ``tables`` of a mask, 0: every one; its time and
        writer), and the META record of what its writer attached, if anything."""
        if self.journal is not None:
            self.journal.append_commit(
                [(i, s, e) for i, (s, e) in zip(ids, bounds, strict=True)],
                self.counters.rows_committed,
                self.counters.episodes_committed,
                tables,
                commit_time,
                writer,
            )
            if meta_payload is not None:
                self.journal.append_meta(ids, meta_payload)

    def resume_settings(self) -> dict[str, Any]:
        """What ``start --resume`` needs of a daemon that died before its first write (it has
        no segment, so no journal): capacity, unit, mode, and the sampler's and rate
        limiter's kinds and settings as the container has them now (with several tables,
        the default one's at the top and every table's under ``"tables"``, as a state has
        them)."""
        c = self.container

        def parts(table: Table) -> dict[str, Any]:
            sampler, limiter = table.sampler, table.rate_limiter
            return {
                "sampler": {"name": sampler.name, "settings": sampler.settings()},
                "rate_limiter": {"name": limiter.name, "settings": limiter.settings()},
            }

        out = {"capacity": c.capacity, "unit": c.unit, "mode": c.mode, **parts(c.table)}
        if self.config.tables is not None:
            (first, _), *others = c.tables.items()
            out.update(table=first, tables={name: parts(t) for name, t in others})
        return out

    def persistent_state(self) -> dict[str, Any]:
        """The container and counters as JSON (what the journal snapshots and checkpoints
        store; open reservations are left out: their rows are never published)."""
        return container_state(self.container, dict(self.counters.__dict__))

    # -- checkpoints (see checkpoint.py) ------------------------------------------------------

    @property
    def lineage(self) -> str:
        """The segment's lineage: stamps of two segments of one lineage mean the same bytes."""
        extra = (self.segment.manifest.get("extra") or {}) if self.segment is not None else {}
        return str(extra.get("lineage") or self._lineage_fallback)

    def begin_checkpoint(self, to: str | Path) -> CheckpointJob:
        """Take the cut (O(metadata), in the loop) and start the copy thread. CheckpointError
        with no schema yet, while another checkpoint runs, or when ``to`` cannot be used."""
        t0 = time.perf_counter()
        if self.segment is None:
            raise CheckpointError("the buffer has no schema yet: nothing to checkpoint")
        if self.segment.device != "cpu":
            raise CheckpointError(
                f"the buffer's rows live on {self.segment.device}: checkpoints copy host "
                "memory, and a GPU buffer's are not written yet (docs/cuda.md)"
            )
        if self.bytes is not None:
            raise CheckpointError(
                f"column {packed_names(self.segment.schema)} is stored compressed, and "
                "checkpoints do not record its byte store (docs/compression.md)"
            )
        running = self.checkpoint_job
        if running is not None and not running.done:
            raise CheckpointError(
                f"a checkpoint to {running.dest} is being written ({running.progress()}); "
                "one at a time: wait for its reply"
            )
        dest, lock_fd = open_destination(to)
        try:
            # The container's state holds the sampler, the rate limiter and the generator.
            cut = Cut(
                state={**self.persistent_state(), "name": self.config.name},
                use_counts=self.use_counts_cut(),
                pointer=self.container.pointer,
                open_ranges=[r for res in self.container.reservations.values() for r in res.ranges],
                lineage=self.lineage,
            )
            job = CheckpointJob(self.segment, cut, dest, lock_fd)
        except BaseException:
            os.close(lock_fd)
            raise
        job.cut_seconds = time.perf_counter() - t0
        self.checkpoint_job = job
        job.start()
        return job

    def use_counts_cut(self) -> np.ndarray:
        """The use counters a checkpoint keeps (a copy): the default table's, or with several
        tables one row per table, in the container's order."""
        tables = list(self.container.tables.values())
        if len(tables) == 1:
            return tables[0].use_counts.copy()
        return np.stack([table.use_counts for table in tables])

    def _save_for_checkpoint(self, ranges: list[tuple[int, int]], deadline: float) -> None:
        """Before rows are granted: a running checkpoint saves the cut's rows among them first
        (copy-on-write); Deferred when it holds too much in memory to take more now."""
        job = self.checkpoint_job
        if job is not None and not job.finished and not job.protect(ranges):
            raise Deferred(
                "a checkpoint is saving these rows before they may be overwritten "
                f"({job.progress()}); the writers outrun its copy",
                deadline,
            )

    def stop_checkpoint(self) -> None:
        """Cancel a running checkpoint (the daemon is stopping): its temp folder goes."""
        job = self.checkpoint_job
        if job is not None and not job.done:
            log.warning("stopping: the checkpoint to %s is cancelled", job.dest)
            job.cancel()
