"""The daemon's metadata journal: what makes ``start --resume`` after a SIGKILL possible.

Row data already survives a dead daemon (it lives in the tmpfs segment, whose page cache
outlives every process); the registry, ring pointer and counters live only in the daemon's
memory. So every change to them is appended to ``<segment dir>/journal.bin`` *before* the reply
that acknowledges it, and a resumed daemon rebuilds them as ``state.json`` (the last snapshot)
plus the journal records written after it.

Records (:mod:`shmbuffer.daemon.records`, their format, types and replay) are int64 fields
behind a length and a CRC: EPOCH, RESERVE, COMMIT, CLEAR, RESTORE, PRIORITY (the ring, the
registry and priorities), META (what a commit attached), SAMPLE (a draw), LEASE, RENEW,
RELEASE (leases), RESERVE_PINNED, ABORT (rows pinned to a writer, ``pins.py``) and REWRITE,
REWRITTEN (a rewrite's copy: begun, not done, its episodes go on resume). A crash in the
middle of a write leaves a short or CRC-failing last record, which :meth:`Journal.load`
ignores (its request was never acknowledged).

Space is reserved ahead, never discovered at append: the file is preallocated with
``posix_fallocate`` in chunks of :data:`JOURNAL_CHUNK` bytes and records are written in place
after the last one, through a shared mapping of the allocated file (a copy into the page
cache, which outlives the process like a ``pwrite``'s bytes, minus the syscall); everything
after them is zeros. The service calls
:meth:`Journal.reserve` *before* it changes any state for a request; when the file system is full
it first tries a snapshot (which resets the journal to its start) and otherwise raises
:class:`OutOfSpaceError`, so the request is refused, nothing was applied, and no record is ever
torn in the middle of the journal: what was acknowledged is always replayed.

Replay runs the records through the container's ``replay_*`` methods, the same code as the live
requests (eviction, registry add, and what both tell the sampler and the rate limiter), so a
replayed registry equals the live one (ids included) and sampler state follows it: priorities
come back exactly. A SAMPLE record is redone by drawing again on the table
that drew it (:meth:`Container.replay_sample`; a record of a table other than the default one
names it by its place) with the generator where it was, so what only samples change
comes back too: FIFO consumed marks (nothing consumed before a SIGKILL is handed out again),
the without-replacement epoch's walk, ``max_times_sampled`` counts and the limiter's sampled
count (journaled, exact). That holds because a sampler whose draws change its state draws as a
function of its state, the live episodes and the generator (``samplers/base.py``). A replayed
draw that does not go as journaled is counted (``diverged`` in :meth:`Journal.load`, logged by
the resume). A SAMPLE is appended after the draw and before the reply that hands the rows out;
its room, and a lease's, is reserved before the draw (:meth:`Journal.room_for_sample`).

Draws that change nothing but the generator and the sampled figure (a uniform or prioritized
sampler without ``max_times_sampled``, no sample-to-insert limiter: :func:`journals_samples`,
decided per table) are not journaled, so they cost nothing (a record's CPU in the loop is
measured by ``python -m bench.sample_journal``, figures in ``docs/architecture.md``): a resume
takes the sampled figure from the last snapshot and moves the generator 2**127 steps on from the
snapshot's, so it does not repeat the draws it handed out since. (Replaying them would not give
the generator back anyway: a uniform draw goes through the registry's internal layout, which a
resume rebuilds compact.)

Use counters are not journaled: :meth:`Journal.track` moves each table's per-row counter array
into ``<segment dir>/use_counts.bin`` (the default table's; ``use_counts.<table>.bin`` for each
other one), a file on the same tmpfs that every read updates in place (so
a SIGKILL loses nothing and a sample pays nothing more); a resume keeps the counts of every row the
replayed registry holds. Leases live in the snapshot and in LEASE, RENEW and RELEASE records (see
``leases.py``): a resumed daemon pins what they pinned until their TTL passes. Pins live in the
snapshot and in RESERVE_PINNED and ABORT records (a COMMIT of a pin's episodes ends it too): a
resumed daemon holds the rows of a writer whose process still runs, as the dead daemon did
(``pins.py``). The snapshot also keeps ``iterate``'s shuffle seed (``iterate_seed``), so a rank that
asks for pass k after a restart gets the order another rank got before it.

Snapshots bound replay time: :meth:`Journal.snapshot` writes ``state.json`` under a new epoch
(temp file + ``os.replace``) and then truncates the journal and starts it with an ``EPOCH``
record. A crash between the two leaves a journal of the previous epoch, whose records are already
in the snapshot and are skipped. tmpfs needs no fsync: the files only have to outlive the
process, not the machine (which takes the segment with it anyway).
"""

from __future__ import annotations

import errno
import functools
import json
import mmap
import os
import struct
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from shmbuffer.daemon.clients import ClientTable
from shmbuffer.daemon.journal_hooks import (
    file_backed,
    holder_lookup,
    journals_samples,
    lease_struct,
    move_on,
    sample_log_for,
)
from shmbuffer.daemon.leases import Lease, LeaseTable
from shmbuffer.daemon.pins import Pin, PinTable
from shmbuffer.daemon.records import (
    ABORT,
    CLEAR,
    COMMIT,
    EPOCH,
    HEAD,
    LEASE,
    LEASE_FIELDS,
    META,
    PRIORITY,
    RELEASE,
    RELEASE_BODY,
    RENEW,
    RENEW_BODY,
    RESERVE,
    RESERVE_PINNED,
    RESTORE,
    REWRITE,
    REWRITTEN,
    SAMPLE,
    SAMPLE_BODY,
    SAMPLE_RNG_BODY,
    SAMPLE_RNG_TABLE_BODY,
    SAMPLE_TABLE_BODY,
    apply_record,
    drop_cut_short,
    encode_record,
    iter_records,
    meta_body,
    pin_fields,
    priority_fields,
    record_bytes,
    rewrite_spans,
    time_bits,
    writer_body,
)
from shmbuffer.daemon.saved_state import (
    USE_COUNTS_FILE,
    container_state,
    restore_container,
    use_counts_file,
)
from shmbuffer.errors import JournalError, OutOfSpaceError
from shmbuffer.registry.intervals import Episode
from shmbuffer.ring.container import Container, Range, SampleRecord

__all__ = [  # the record and saved-state names are re-exported: importers know them from here
    "ABORT",
    "CLEAR",
    "COMMIT",
    "EPOCH",
    "JOURNAL_FILE",
    "LEASE",
    "META",
    "PRIORITY",
    "RELEASE",
    "RENEW",
    "RESERVE",
    "RESERVE_PINNED",
    "RESTORE",
    "SAMPLE",
    "STATE_FILE",
    "USE_COUNTS_FILE",
    "Journal",
    "apply_record",
    "container_state",
    "encode_record",
    "iter_records",
    "priority_fields",
    "record_bytes",
    "restore_container",
]

JOURNAL_FILE = "journal.bin"
STATE_FILE = "state.json"

_SAMPLE_BYTES = HEAD.size + SAMPLE_RNG_BODY.size
_EPOCH_BYTES = record_bytes(1)
#: Snapshot once the journal holds this many records (and more than twice the episodes).
SNAPSHOT_EVERY = 20_000
#: The journal file grows by preallocated chunks of this many bytes (~500 reserve + commit
#: pairs); a snapshot rewinds it, so it stays a few chunks long.
JOURNAL_CHUNK = 64 * 1024
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


# -- the journal ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _int64s(count: int) -> struct.Struct:
    """The packer of a record body of ``count`` little-endian int64s (one per length seen)."""
    return struct.Struct(f"<{count}q")


class Journal:
    """Append-only record of a container's changes next to a snapshot; see the module docs.

    ``Journal(folder)`` names the files; :meth:`start` begins a new generation from a state (a
    fresh or resumed daemon), :meth:`load` reads what a dead daemon left.
    """

    def __init__(
        self,
        folder: str | Path,
        snapshot_every: int = SNAPSHOT_EVERY,
        chunk: int = JOURNAL_CHUNK,
    ) -> None:
        self.folder = Path(folder)
        self.path = self.folder / JOURNAL_FILE
        self.state_path = self.folder / STATE_FILE
        self.snapshot_every = snapshot_every
        self.chunk = chunk
        self.epoch = 0
        self.records = 0
        self._fd: int | None = None
        #: The allocated file, mapped shared: a record is a copy into the page cache, not a
        #: syscall (a pwrite was a large share of a record's time in the loop); what a process
        #: stores there outlives it, as a pwrite's bytes do.
        self._map: mmap.mmap | None = None
        self._offset = 0  # where the next record goes; zeros from here on
        self._allocated = 0  # bytes of the file reserved with posix_fallocate
        self._state_fn: Callable[[], dict[str, Any]] | None = None
        self._leases: LeaseTable | None = None  # put in every snapshot (track)
        self._pins: PinTable | None = None  # the same
        self._iterate_seed: int | None = None
        #: Writers' codes in this generation (a snapshot starts a new one, and new codes).
        self._writers: dict[str, int] = {}

    # -- what else a resume keeps ---------------------------------------------------------

    def track(
        self,
        container: Container,
        leases: LeaseTable | None = None,
        clients: ClientTable | None = None,
        iterate_seed: int | None = None,
        pins: PinTable | None = None,
    ) -> None:
        """Keep what samples and leases change across a resume (call before :meth:`start`):
        every table of the container tells this journal its draws (SAMPLE records naming the
        table; the journal is their :class:`~shmbuffer.ring.listeners.SampleLog`) where a draw
        changes anything but the generator and figures (:func:`journals_samples`), and each
        table's use counters move into a file beside it (:func:`use_counts_file`: their
        current values copied; written in place from then on); ``leases`` tell it grants,
        renewals and releases and go into every snapshot, matched to processes through
        ``clients``; ``iterate_seed`` too."""
        for index, (name, table) in enumerate(container.tables.items()):
            path = self.folder / use_counts_file(container, name)
            table.keep_use_counts_in(file_backed(path, table.use_counts))
            table.listen(sample_log_for(table, self, index))
        if leases is not None:
            leases.log = self
            if clients is not None:
                leases.holder_of = holder_lookup(clients)
        self._leases = leases
        self._pins = pins
        self._iterate_seed = iterate_seed

    def room_for_sample(self, n: int) -> None:
        """Room for a SAMPLE record and a lease of up to ``n`` episodes (a sample of ``n``
        items is held by at most ``n`` episodes), before the draw changes anything."""
        self.reserve(_SAMPLE_BYTES + record_bytes(LEASE_FIELDS + n))

    def sampled(self, draw: SampleRecord) -> None:
        """Append a SAMPLE record (see :class:`~shmbuffer.ring.listeners.SampleLog`)."""
        if self._fd is None:
            return
        call, n, length, strict, handed, refused, rng = draw
        head = (SAMPLE, call, n, length, int(strict), handed, int(refused))
        body = SAMPLE_BODY.pack(*head) if rng is None else SAMPLE_RNG_BODY.pack(*head, *rng)
        self._append_body(body)

    def sampled_by(self, draw: SampleRecord, table: int) -> None:
        """Append a SAMPLE record of the table at ``table`` (not the default one)."""
        if self._fd is None:
            return
        call, n, length, strict, handed, refused, rng = draw
        head = (SAMPLE, call, n, length, int(strict), handed, int(refused))
        if rng is None:
            self._append_body(SAMPLE_TABLE_BODY.pack(*head, table))
        else:
            self._append_body(SAMPLE_RNG_TABLE_BODY.pack(*head, *rng, table))

    def lease_granted(self, lease: Lease, expires_us: int) -> None:
        if self._fd is None:
            return
        pid, host_crc = lease.holder or (0, 0)
        ids = lease.episode_ids
        body = lease_struct(len(ids)).pack(
            LEASE, lease.id, pid, host_crc, expires_us, len(ids), *ids
        )
        self._append_body(body)

    def lease_renewed(self, lease_id: int, expires_us: int) -> None:
        if self._fd is not None:
            self._append_body(RENEW_BODY.pack(RENEW, lease_id, expires_us))

    def lease_released(self, lease_id: int) -> None:
        if self._fd is not None:
            self._append_body(RELEASE_BODY.pack(RELEASE, lease_id))

    def _extras(self) -> dict[str, Any]:
        """What a snapshot keeps besides the container state."""
        out: dict[str, Any] = {}
        if self._leases is not None:
            out["leases"] = self._leases.to_state(time.monotonic())
        if self._pins is not None:
            out["pins"] = self._pins.to_state()
        if self._iterate_seed is not None:
            out["iterate_seed"] = str(self._iterate_seed)  # 128 bits: JSON ints are not
        return out

    # -- writing ----------------------------------------------------------------------------

    def start(
        self, state: dict[str, Any], state_fn: Callable[[], dict[str, Any]] | None = None
    ) -> None:
        """Snapshot ``state`` and open an empty journal after it (for appends). ``state_fn``
        gives the current state when :meth:`reserve` needs a snapshot to make room."""
        if self._fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                size = os.fstat(fd).st_size
                self._fallocate(fd, 0, max(size, self.chunk))
            except BaseException:
                os.close(fd)
                raise
            # What a previous daemon left is zeroed by the first snapshot below.
            self._fd, self._offset, self._allocated = fd, size, max(size, self.chunk)
            self._remap()
        self._state_fn = state_fn
        try:
            previous = json.loads(self.state_path.read_text()).get("epoch", 0)
        except (OSError, ValueError, AttributeError):
            previous = 0
        self.epoch = max(self.epoch, int(previous))
        self.snapshot(state)

    def snapshot(self, state: dict[str, Any]) -> None:
        """Write ``state`` (which must include every journaled change) and reset the journal.
        A full file system raises :class:`OutOfSpaceError` and leaves both files as they were."""
        if self._fd is None:
            raise JournalError("journal is not open: call start() first")
        epoch = self.epoch + 1
        tmp = self.state_path.with_name(f".{STATE_FILE}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({**state, **self._extras(), "epoch": epoch}, f, separators=(",", ":"))
            os.replace(tmp, self.state_path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if exc.errno in _NO_SPACE:
                raise OutOfSpaceError(
                    f"cannot write the snapshot {self.state_path}: its file system is full"
                ) from None
            raise
        # From here the snapshot holds everything; a journal of the old epoch is ignored. The
        # old records are zeroed behind the old EPOCH record first, so a crash half way leaves
        # an old-epoch journal (skipped), never old records after the new EPOCH record.
        self._zero(_EPOCH_BYTES, self._offset)
        self._pwrite(encode_record(EPOCH, [epoch]), 0)
        self._offset = _EPOCH_BYTES
        self.epoch, self.records = epoch, 0
        self._writers = {}

    def needs_snapshot(self, num_episodes: int) -> bool:
        return self._fd is not None and self.records >= max(self.snapshot_every, 2 * num_episodes)

    def reserve(self, nbytes: int) -> None:
        """Make sure the next ``nbytes`` of records can be written, before the caller changes
        any state: preallocate more chunks, or else snapshot (which rewinds the journal).
        Raises :class:`OutOfSpaceError` when neither works; nothing changed then."""
        if self._fd is None or self._offset + nbytes <= self._allocated:
            return
        try:
            self._grow(nbytes)
        except OutOfSpaceError as exc:
            if self._state_fn is None or self.records == 0:
                raise
            try:
                self.snapshot(self._state_fn())
            except OutOfSpaceError:
                raise OutOfSpaceError(f"{exc}; a snapshot to make room failed too") from None
            if self._offset + nbytes > self._allocated:
                self._grow(nbytes)

    def _grow(self, nbytes: int) -> None:
        assert self._fd is not None
        need = self._offset + nbytes - self._allocated
        extra = -(-need // self.chunk) * self.chunk  # whole chunks
        self._fallocate(self._fd, self._allocated, extra)
        self._allocated += extra
        self._remap()

    def _remap(self) -> None:
        """Map the allocated file (all of it is allocated: no store can SIGBUS)."""
        assert self._fd is not None
        if self._map is not None:
            self._map.close()
        self._map = mmap.mmap(self._fd, self._allocated)

    def _fallocate(self, fd: int, offset: int, length: int) -> None:
        try:
            os.posix_fallocate(fd, offset, length)
        except OSError as exc:
            if exc.errno in _NO_SPACE:
                raise OutOfSpaceError(
                    f"the journal {self.path} cannot grow by {length:,} bytes: no space left on "
                    "its file system; the request was not applied (free space, then retry)"
                ) from None
            raise

    def _pwrite(self, data: bytes, offset: int) -> None:
        assert self._fd is not None
        end = offset + len(data)
        if self._map is not None and end <= self._allocated:
            self._map[offset:end] = data
            return
        written = os.pwrite(self._fd, data, offset)
        if written == len(data):
            return
        view, offset = memoryview(data)[written:], offset + written
        while view:  # preallocated: a short write is not expected, but never leave one
            written = os.pwrite(self._fd, view, offset)
            view, offset = view[written:], offset + written

    def _zero(self, start: int, stop: int) -> None:
        block = bytes(min(max(stop - start, 0), 1 << 20))
        for offset in range(start, stop, len(block) or 1):
            self._pwrite(block[: stop - offset], offset)

    def _append(self, kind: int, fields: list[int] | np.ndarray) -> None:
        if self._fd is None:
            return
        if isinstance(fields, np.ndarray):  # vectorised: no Python int per field
            body = np.concatenate([np.array([kind], dtype="<i8"), fields.astype("<i8")])
            self._append_body(body.tobytes())
        else:  # a few fields (a reserve's, a commit's: two per write): struct, not numpy
            self._append_body(_int64s(len(fields) + 1).pack(kind, *fields))

    def _append_body(self, body: bytes) -> None:
        """Frame and write one record body (its type first, little-endian int64s). Inline,
        no helper calls: it runs once per sample, where each Python call shows."""
        assert self._fd is not None
        record = HEAD.pack(len(body), zlib.crc32(body)) + body
        end = self._offset + len(record)
        if end > self._allocated:
            self._grow(len(record))  # a caller that did not reserve: grow, never snapshot
        try:
            if self._map is not None:
                self._map[self._offset : end] = record
            else:
                self._pwrite(record, self._offset)
        except BaseException:
            # The record is not in the journal (the request fails); zero what may have
            # landed, so the next record starts on clean bytes.
            self._zero(self._offset, self._offset + len(record))
            raise
        self._offset += len(record)
        self.records += 1

    def append_reserve(
        self,
        evicted: list[Range],
        pointer: int,
        rows_written: int,
        next_reservation: int,
        pin: Pin | None = None,
    ) -> None:
        """A reservation; with ``pin``, pinned to its writer (room: :func:`reserve_bytes`)."""
        flat = [v for r in evicted for v in r]
        fields = [pointer, rows_written, next_reservation, len(evicted), *flat]
        if pin is None:
            self._append(RESERVE, fields)
            return
        process = pin.process
        extra = pin_fields(
            pin.reservation, process.pid, process.start, pin.ranges, pin.split, pin.tables
        )
        self._append(RESERVE_PINNED, [*fields, *extra])

    def append_rewrite(self, spans: list[tuple[int, int]] | None) -> None:
        """The rows a rewrite is about to change in place; None: it changed them."""
        flat = [] if spans is None else [len(spans), *(v for span in spans for v in span)]
        self._append(REWRITE if spans is not None else REWRITTEN, flat)

    def append_abort(self, reservation_id: int) -> None:
        """A pinned reservation ended without a commit."""
        self._append(ABORT, [reservation_id])

    def append_commit(
        self,
        episodes: list[tuple[int, int, int]],
        rows_committed: int,
        episodes_committed: int,
        tables: int = 0,
        commit_time: float = 0.0,
        writer: str = "",
    ) -> None:
        """A commit: its episodes, the mask of the tables they go into
        (``Container.members_mask``; 0: every table), its time and its ``writer`` (a code,
        whose WRITER record goes first the first time this generation sees it; room for it:
        :func:`commit_bytes`; none for ``""``)."""
        code = self._writers.get(writer, -1) if writer else -1  # -1: none named
        if code < 0 and writer:
            code = self._writers[writer] = len(self._writers)
            self._append_body(writer_body(code, writer))
        flat = [v for ep in episodes for v in ep]
        fields = [rows_committed, episodes_committed, len(episodes), *flat]
        self._append(COMMIT, [*fields, tables, time_bits(commit_time), code])

    def append_meta(self, ids: list[int], payload: bytes) -> None:
        """What a commit attached to the episodes ``ids`` (``records.meta_payload``)."""
        if self._fd is not None:
            self._append_body(meta_body(ids, payload))

    def append_clear(self, pointer: int) -> None:
        self._append(CLEAR, [pointer])

    def append_restore(self, episodes: list[Episode], pointer: int, rows_written: int) -> None:
        flat = [v for ep in episodes for v in (ep.id, ep.start, ep.end)]
        self._append(RESTORE, [pointer, rows_written, len(episodes), *flat])

    def append_priorities(self, rows: np.ndarray, priority: np.ndarray, table: int = 0) -> None:
        """Priorities applied to ``rows`` (validated, stale rows left out) of the table at
        ``table``; reserve ``record_bytes(2 + 2 * len(rows))`` first."""
        self._append(PRIORITY, priority_fields(rows, priority, table))

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # -- reading ----------------------------------------------------------------------------

    def exists(self) -> bool:
        return self.state_path.is_file()

    def load(self) -> dict[str, Any]:
        """The state a dead daemon left: its last snapshot plus every whole journal record of
        the same epoch. The result has ``replayed`` (records) and ``torn`` (bytes ignored)."""
        try:
            state = json.loads(self.state_path.read_text())
        except FileNotFoundError:
            raise JournalError(f"nothing to resume: no {self.state_path}") from None
        except (OSError, ValueError) as exc:
            raise JournalError(f"unreadable {self.state_path}: {exc}") from exc
        if not isinstance(state, dict):
            raise JournalError(f"{self.state_path} is not a JSON object")
        container = restore_container(state)
        counters = dict(state.get("counters", {}))
        saved_leases = state.get("leases") or {}
        leases = {int(entry[0]): list(entry) for entry in saved_leases.get("held", [])}
        pins = {int(entry[0]): list(entry) for entry in state.get("pins") or []}
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            data = b""
        replayed, used, diverged = 0, 0, 0
        writers: dict[int, str] = {}  # the generation's writer codes, as its records say
        stateful = any(t.sampler.draws_change_state for t in container.tables.values())
        records = iter_records(data)
        first = next(records, None)
        if first is not None and first[0] == EPOCH and int(first[1][0]) == state.get("epoch"):
            used = first[2]
            cut: list[tuple[int, int]] = []  # a rewrite begun and not done (records.py)
            for kind, fields, end in records:
                if kind in (REWRITE, REWRITTEN):
                    cut = rewrite_spans(fields) if kind == REWRITE else []
                elif not apply_record(container, counters, kind, fields, leases, pins, writers):
                    diverged += stateful
                replayed, used = replayed + 1, end
            drop_cut_short(container, cut)
        elif first is not None:  # an older generation: already in the snapshot
            used = len(data)
        for table in container.tables.values():
            if not journals_samples(table):  # draws since the snapshot are not journaled:
                move_on(table.rng)  # do not repeat them
        out = container_state(container, counters)
        torn = len(data[used:].rstrip(b"\0"))  # the preallocated rest is zeros
        out.update(epoch=state.get("epoch", 0), replayed=replayed, torn=torn, diverged=diverged)
        out["leases"] = {"next": saved_leases.get("next", 1), "held": sorted(leases.values())}
        out["pins"] = sorted(pins.values())
        if state.get("iterate_seed") is not None:
            out["iterate_seed"] = int(state["iterate_seed"])
        for name in container.tables:
            entry = out if container.tables[name] is container.table else out["tables"][name]
            entry["use_counts"] = self._saved_use_counts(
                container.capacity, use_counts_file(container, name)
            )
        return out

    def _saved_use_counts(self, capacity: int, file: str) -> np.ndarray | None:
        """A counter file a dead daemon left (None: none, or not of this ring)."""
        path = self.folder / file
        try:
            if path.stat().st_size != 4 * capacity:
                return None
            return np.fromfile(path, dtype="<i4")
        except OSError:
            return None
