"""The daemon's metadata journal: what makes ``start --resume`` after a SIGKILL possible.

Row data already survives a dead daemon (it lives in the tmpfs segment, whose page cache
outlives every process); the registry, ring pointer and counters live only in the daemon's
memory. So every change to them is appended to ``<segment dir>/journal.bin`` *before* the reply
that acknowledges it, and a resumed daemon rebuilds them as ``state.json`` (the last snapshot)
plus the journal records written after it.

Record format (little endian)::

    u32 body_length | u32 crc32(body) | body = int64[type, field, field, ...]

Types: ``EPOCH [epoch]`` (first record of every journal generation), ``RESERVE [pointer,
rows_written, next_reservation, n, (start, stop) * n]`` (the rows a reservation evicted and where
the ring stands after it), ``COMMIT [rows_committed, episodes_committed, n, (id, start, end) *
n]``, ``CLEAR [pointer]``, ``RESTORE [pointer, rows_written, n, (id, start, end) * n]`` (an
aborted reservation publishing again what it evicted, see :meth:`Container.abort`) and
``PRIORITY [n, row * n, float64 bits * n]`` (priorities set by ``update_priorities`` or given
to a commit, rows already filtered for staleness; replayed through the sampler). A plain
abort needs no record: it changed nothing but what its RESERVE record already holds. A crash
in the middle of a write leaves a short or CRC-failing last record, which :meth:`Journal.load`
ignores (its request was never acknowledged).

Space is reserved ahead, never discovered at append: the file is preallocated with
``posix_fallocate`` in chunks of :data:`JOURNAL_CHUNK` bytes and records are written in place
(``pwrite``) after the last one; everything after them is zeros. The service calls
:meth:`Journal.reserve` *before* it changes any state for a request; when the file system is full
it first tries a snapshot (which resets the journal to its start) and otherwise raises
:class:`OutOfSpaceError`, so the request is refused, nothing was applied, and no record is ever
torn in the middle of the journal: what was acknowledged is always replayed.

Replay runs the records through the container's ``replay_*`` methods, the same code as the live
requests (eviction, registry add, and what both tell the sampler and the rate limiter), so a
replayed registry equals the live one (ids included) and sampler state follows it: priorities
come back exactly. What only a *sample* changes is not journaled (one record per sample would
cost more than the sample): FIFO consumed marks, epoch progress, ``max_times_sampled`` counts,
the limiter's sampled count and the generator come from the last snapshot, so after a daemon
crash what was handed out since may be handed out again (at least once, not exactly once).

Snapshots bound replay time: :meth:`Journal.snapshot` writes ``state.json`` under a new epoch
(temp file + ``os.replace``) and then truncates the journal and starts it with an ``EPOCH``
record. A crash between the two leaves a journal of the previous epoch, whose records are already
in the snapshot and are skipped. tmpfs needs no fsync: the files only have to outlive the
process, not the machine (which takes the segment with it anyway).

Per-row use counters are not journaled (one record per sample would cost more than the sample):
after a resume every committed row counts 0 uses.
"""

from __future__ import annotations

import errno
import json
import os
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from shmbuffer.container import Container, Range
from shmbuffer.errors import JournalError, OutOfSpaceError
from shmbuffer.registry import Episode
from shmbuffer.samplers import RateLimiter, Sampler

JOURNAL_FILE = "journal.bin"
STATE_FILE = "state.json"
STATE_FORMAT = 1

EPOCH, RESERVE, COMMIT, CLEAR, RESTORE, PRIORITY = 0, 1, 2, 3, 4, 5
_HEAD = struct.Struct("<II")
#: Snapshot once the journal holds this many records (and more than twice the episodes).
SNAPSHOT_EVERY = 20_000
#: The journal file grows by preallocated chunks of this many bytes (~500 reserve + commit
#: pairs); a snapshot rewinds it, so it stays a few chunks long.
JOURNAL_CHUNK = 64 * 1024
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


# -- container state --------------------------------------------------------------------------


def container_state(container: Container, counters: dict[str, int] | None = None) -> dict[str, Any]:
    """What a restart needs to rebuild ``container`` (:meth:`Container.state`: ring, registry,
    sampler, limiter, generator), plus the daemon's counters; JSON-able."""
    return {"format": STATE_FORMAT, **container.state(), "counters": dict(counters or {})}


def restore_container(
    state: dict[str, Any],
    container: Container | None = None,
    *,
    sampler: Sampler | None = None,
    rate_limiter: RateLimiter | None = None,
) -> Container:
    """A container in ``state`` with no open reservation (use counters restart at 0 for every
    committed row): ``container`` updated in place (its sampler must be of the saved kind), or
    a new one with ``sampler``/``rate_limiter`` (None: the saved kinds and settings)."""
    if state.get("format") != STATE_FORMAT:
        raise JournalError(f"state format {state.get('format')!r}, expected {STATE_FORMAT}")
    try:
        if container is None:
            return Container.from_state(state, sampler=sampler, rate_limiter=rate_limiter)
        container.load_state(state)
    except (KeyError, TypeError, ValueError) as exc:
        raise JournalError(f"saved state does not fit: {exc}") from exc
    return container


# -- records ----------------------------------------------------------------------------------


def encode_record(kind: int, fields: Iterable[int]) -> bytes:
    return _framed(np.array([kind, *fields], dtype="<i8").tobytes())


def _framed(body: bytes) -> bytes:
    return _HEAD.pack(len(body), zlib.crc32(body)) + body


def priority_fields(rows: np.ndarray, priority: np.ndarray) -> np.ndarray:
    """The fields of a PRIORITY record: ``[n, rows..., float64 bits...]``."""
    head = np.array([rows.size], dtype="<i8")
    bits = np.ascontiguousarray(priority, dtype="<f8").view("<i8")
    return np.concatenate([head, np.asarray(rows, dtype="<i8"), bits])


def record_bytes(num_fields: int) -> int:
    """The encoded size of a record with ``num_fields`` fields after its type."""
    return _HEAD.size + 8 * (1 + num_fields)


_EPOCH_BYTES = record_bytes(1)


def iter_records(data: bytes) -> Iterator[tuple[int, np.ndarray, int]]:
    """``(type, fields, end offset)`` of each whole record; stops at a torn or corrupt one."""
    offset = 0
    while offset + _HEAD.size <= len(data):
        length, crc = _HEAD.unpack_from(data, offset)
        start, end = offset + _HEAD.size, offset + _HEAD.size + length
        if length < 8 or length % 8 or end > len(data):
            return
        body = data[start:end]
        if zlib.crc32(body) != crc:
            return
        values = np.frombuffer(body, dtype="<i8")
        yield int(values[0]), values[1:], end
        offset = end


def apply_record(container: Container, counters: dict[str, int], kind: int, f: np.ndarray) -> None:
    """Redo one record on ``container`` through its replay methods (JournalError if it does
    not fit)."""
    try:
        if kind == RESERVE:
            pointer, rows_written, next_reservation, n = (int(v) for v in f[:4])
            evicted = [(int(f[4 + 2 * i]), int(f[5 + 2 * i])) for i in range(n)]
            container.replay_reserve(evicted, pointer, rows_written, next_reservation)
        elif kind == COMMIT:
            counters["rows_committed"], counters["episodes_committed"] = int(f[0]), int(f[1])
            n = int(f[2])
            episodes = f[3 : 3 + 3 * n].reshape(n, 3).tolist()  # ValueError if cut short
            container.replay_commit([(i, s, e) for i, s, e in episodes])
        elif kind == CLEAR:
            container.replay_clear(int(f[0]))
        elif kind == RESTORE:
            pointer, rows_written, n = (int(v) for v in f[:3])
            restored = [Episode(*(int(v) for v in f[3 + 3 * i : 6 + 3 * i])) for i in range(n)]
            container.replay_restore(restored, pointer, rows_written)
        elif kind == PRIORITY:
            n = int(f[0])
            if f.size != 1 + 2 * n:
                raise ValueError(f"PRIORITY record of {f.size} fields for {n} rows")
            container.replay_priorities(f[1 : 1 + n], f[1 + n :].view("<f8"))
        elif kind != EPOCH:
            raise JournalError(f"unknown journal record type {kind}")
    except (IndexError, ValueError) as exc:
        raise JournalError(f"journal record {kind} does not apply: {exc}") from exc


# -- the journal ------------------------------------------------------------------------------


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
        self._offset = 0  # where the next record goes; zeros from here on
        self._allocated = 0  # bytes of the file reserved with posix_fallocate
        self._state_fn: Callable[[], dict[str, Any]] | None = None

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
                json.dump({**state, "epoch": epoch}, f, separators=(",", ":"))
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
        view = memoryview(data)
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
            record = _framed(body.tobytes())
        else:
            record = encode_record(kind, fields)
        if self._offset + len(record) > self._allocated:
            self._grow(len(record))  # a caller that did not reserve: grow, never snapshot
        try:
            self._pwrite(record, self._offset)
        except BaseException:
            # The record is not in the journal (the request fails); zero what may have
            # landed, so the next record starts on clean bytes.
            self._zero(self._offset, self._offset + len(record))
            raise
        self._offset += len(record)
        self.records += 1

    def append_reserve(
        self, evicted: list[Range], pointer: int, rows_written: int, next_reservation: int
    ) -> None:
        flat = [v for r in evicted for v in r]
        self._append(RESERVE, [pointer, rows_written, next_reservation, len(evicted), *flat])

    def append_commit(
        self,
        episodes: list[tuple[int, int, int]],
        rows_committed: int,
        episodes_committed: int,
    ) -> None:
        flat = [v for ep in episodes for v in ep]
        self._append(COMMIT, [rows_committed, episodes_committed, len(episodes), *flat])

    def append_clear(self, pointer: int) -> None:
        self._append(CLEAR, [pointer])

    def append_restore(self, episodes: list[Episode], pointer: int, rows_written: int) -> None:
        flat = [v for ep in episodes for v in (ep.id, ep.start, ep.end)]
        self._append(RESTORE, [pointer, rows_written, len(episodes), *flat])

    def append_priorities(self, rows: np.ndarray, priority: np.ndarray) -> None:
        """Priorities applied to ``rows`` (validated, stale rows left out); reserve
        ``record_bytes(1 + 2 * len(rows))`` first."""
        self._append(PRIORITY, priority_fields(rows, priority))

    def close(self) -> None:
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
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            data = b""
        replayed, used = 0, 0
        records = iter_records(data)
        first = next(records, None)
        if first is not None and first[0] == EPOCH and int(first[1][0]) == state.get("epoch"):
            used = first[2]
            for kind, fields, end in records:
                apply_record(container, counters, kind, fields)
                replayed, used = replayed + 1, end
        elif first is not None:  # an older generation: already in the snapshot
            used = len(data)
        out = container_state(container, counters)
        torn = len(data[used:].rstrip(b"\0"))  # the preallocated rest is zeros
        out.update(epoch=state.get("epoch", 0), replayed=replayed, torn=torn)
        return out
