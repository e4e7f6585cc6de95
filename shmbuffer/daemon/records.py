"""The journal's records: their format, their codec, and how each is redone on replay.

:mod:`shmbuffer.daemon.journal` writes them (before the reply that acknowledges what they
record) and says what a resume makes of them; this module encodes and decodes them
(:func:`encode_record`; :func:`iter_records` stops at a torn or corrupt record) and redoes one
(:func:`apply_record`) through the container's ``replay_*`` methods, the same code as the live
requests.

Record format (little endian)::

    u32 body_length | u32 crc32(body) | body = int64[type, field, field, ...]

Types: ``EPOCH [epoch]`` (first record of every journal generation), ``RESERVE [pointer,
rows_written, next_reservation, n, (start, stop) * n]`` (the rows a reservation evicted and
where the ring stands after it), ``COMMIT [rows_committed, episodes_committed, n, (id, start,
end) * n, tables, time, writer]`` (the last three since episodes have metadata, absent from
older records: the mask of the tables the episodes go into, ``Container.members_mask``, 0 for
every table; the commit time's float64 bits; the writer's code in this journal generation, whose
name a ``WRITER [code, nbytes]`` record of utf-8 bytes gives before its first COMMIT), ``CLEAR
[pointer]``, ``RESTORE [pointer, rows_written, n, (id, start, end) * n]`` (an aborted
reservation publishing again what it evicted, see :meth:`Container.abort`), ``PRIORITY [n, row *
n, float64 bits * n, table?]`` (priorities set by ``update_priorities`` or given to a commit,
rows already filtered for staleness; replayed through the sampler), ``SAMPLE [call, n, length,
strict, handed, refused, (rng * 6)?, table?]`` (a draw a table handed out, or one refused after
it changed the sampler; the generator's six words only when a refused draw may have moved it
since the last SAMPLE). ``table`` is the table's place among the container's
(``Container.table_at``), there only for a table other than the default one, so a one-table
daemon writes what it always did and an old record means the default table (the count of fields
tells: even for a PRIORITY with it, 7 or 13 for a SAMPLE). ``LEASE [id, pid, host crc32,
expires_us, n, episode id * n]``, ``RENEW [id, expires_us]`` and ``RELEASE [id]`` (leases,
expiries as wall-clock microseconds). ``RESERVE_PINNED`` is a RESERVE whose rows are pinned to
the local writer copying into them (``pins.py``): the RESERVE fields, then ``[id, pid, start
time, m, (start, stop) * m, k, length * k]`` (the reservation, its writer's process, its ranges,
and its episodes' lengths, or ``-k`` for k equal episodes; then the tables' mask where only
some); ``ABORT [id]`` ends such a pin without a commit (a COMMIT whose first episode starts its
rows ends it too). ``META [n, id * n, nbytes]`` and msgpack bytes follow a COMMIT whose writer
attached metadata: the values, ``{"m": values}``, padded to a whole int64. ``REWRITE [n,
(start, stop) * n]`` (the rows of the episodes a ``rewrite`` is about to change in place) and
``REWRITTEN []`` (it changed them) bracket the daemon's copy: a REWRITE the journal does not
close with a REWRITTEN was cut short by a crash, and a resume evicts those episodes
(:func:`rewrite_spans`, ``Journal.load``), whose rows may be half changed. Any other abort needs
no record: it changed nothing but what its RESERVE record already holds; nor does a lease's
expiry (a resume drops it by its wall-clock expiry). A crash in the middle of a write leaves a
short or CRC-failing last record, which :meth:`Journal.load` ignores (its request was never
acknowledged).
"""

from __future__ import annotations

import functools
import struct
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import msgpack
import numpy as np

from shmbuffer.daemon.pins import Pin
from shmbuffer.errors import JournalError
from shmbuffer.registry.intervals import Episode
from shmbuffer.ring.container import Container, SampleRecord

Range = tuple[int, int]

EPOCH, RESERVE, COMMIT, CLEAR, RESTORE, PRIORITY = 0, 1, 2, 3, 4, 5
SAMPLE, LEASE, RENEW, RELEASE = 6, 7, 8, 9
RESERVE_PINNED, ABORT = 10, 11
META, WRITER = 12, 13
REWRITE, REWRITTEN = 14, 15
HEAD = struct.Struct("<II")
#: A SAMPLE's body: its type and six fields, and with the generator's six words.
SAMPLE_BODY = struct.Struct("<7q")
SAMPLE_RNG_BODY = struct.Struct("<13q")
#: The same with the table's place last (a table other than the default one).
SAMPLE_TABLE_BODY = struct.Struct("<8q")
SAMPLE_RNG_TABLE_BODY = struct.Struct("<14q")
RENEW_BODY = struct.Struct("<3q")
RELEASE_BODY = struct.Struct("<2q")
LEASE_FIELDS = 5  # before the episode ids


def encode_record(kind: int, fields: Iterable[int]) -> bytes:
    return framed(np.array([kind, *fields], dtype="<i8").tobytes())


def framed(body: bytes) -> bytes:
    return HEAD.pack(len(body), zlib.crc32(body)) + body


def priority_fields(rows: np.ndarray, priority: np.ndarray, table: int = 0) -> np.ndarray:
    """The fields of a PRIORITY record: ``[n, rows..., float64 bits..., table?]`` (the
    table's place only for one other than the default)."""
    head = np.array([rows.size], dtype="<i8")
    bits = np.ascontiguousarray(priority, dtype="<f8").view("<i8")
    tail = np.array([table] if table else [], dtype="<i8")
    return np.concatenate([head, np.asarray(rows, dtype="<i8"), bits, tail])


def meta_payload(values: dict[str, Any]) -> bytes:
    """A META record's bytes after its int64 fields: the values a commit attached."""
    payload: bytes = msgpack.packb({"m": values})
    return payload


def writer_body(code: int, writer: str) -> bytes:
    """A WRITER record's body: ``[WRITER, code, nbytes]``, then the name padded to 8."""
    name = writer.encode()
    return struct.pack("<3q", WRITER, code, len(name)) + name + bytes(-len(name) % 8)


def time_bits(seconds: float) -> int:
    """A commit time as the int64 its float64 bits are (exact, as a COMMIT field)."""
    bits: int = _INT64.unpack(_FLOAT64.pack(seconds))[0]
    return bits


_INT64, _FLOAT64 = struct.Struct("<q"), struct.Struct("<d")


def meta_body(ids: list[int], payload: bytes) -> bytes:
    """A META record's body: ``[META, n, ids..., nbytes]``, then ``payload`` padded to 8."""
    head = struct.pack(f"<{len(ids) + 3}q", META, len(ids), *ids, len(payload))
    return head + payload + bytes(-len(payload) % 8)


def meta_bytes(num_ids: int, payload: bytes) -> int:
    """The encoded size of a META record of ``num_ids`` episodes."""
    return HEAD.size + 8 * (num_ids + 3) + len(payload) + (-len(payload) % 8)


def rewrite_spans(f: np.ndarray) -> list[Range]:
    """A REWRITE record's row ranges."""
    n = int(f[0])
    if f.size != 1 + 2 * n:
        raise JournalError(f"REWRITE record of {f.size} fields for {n} ranges")
    return [(int(f[1 + 2 * i]), int(f[2 + 2 * i])) for i in range(n)]


def drop_cut_short(container: Container, spans: list[Range]) -> None:
    """After a replay: the episodes of a rewrite the journal did not close (a REWRITE with no
    REWRITTEN after it) go, since their rows may be half changed."""
    if spans:
        c = container
        c.replay_reserve(spans, c.pointer, c.rows_written, c.next_reservation)


def record_bytes(num_fields: int) -> int:
    """The encoded size of a record with ``num_fields`` fields after its type."""
    return HEAD.size + 8 * (1 + num_fields)


def commit_bytes(episodes: int, writer: str) -> int:
    """The most a COMMIT record of ``episodes`` entries takes, with its writer's WRITER
    record (written the first time a journal generation sees that writer)."""
    return record_bytes(6 + 3 * episodes) + _writer_bytes(writer)


@functools.lru_cache(maxsize=1024)
def _writer_bytes(writer: str) -> int:
    return HEAD.size + len(writer_body(0, writer))


def reserve_bytes(evicted: int, pin: Pin | None = None) -> int:
    """The size of a RESERVE record evicting ``evicted`` ranges, pinned with ``pin``."""
    fields = 4 + 2 * evicted
    if pin is not None:
        fields += 5 + 2 * len(pin.ranges) + (0 if isinstance(pin.split, int) else len(pin.split))
        fields += 1 if pin.tables else 0
    return record_bytes(fields)


_EPOCH_BYTES = record_bytes(1)


def iter_records(data: bytes) -> Iterator[tuple[int, np.ndarray, int]]:
    """``(type, fields, end offset)`` of each whole record; stops at a torn or corrupt one."""
    offset = 0
    while offset + HEAD.size <= len(data):
        length, crc = HEAD.unpack_from(data, offset)
        start, end = offset + HEAD.size, offset + HEAD.size + length
        if length < 8 or length % 8 or end > len(data):
            return
        body = data[start:end]
        if zlib.crc32(body) != crc:
            return
        values = np.frombuffer(body, dtype="<i8")
        yield int(values[0]), values[1:], end
        offset = end


def apply_record(
    container: Container,
    counters: dict[str, int],
    kind: int,
    f: np.ndarray,
    leases: dict[int, list[Any]] | None = None,
    pins: dict[int, list[Any]] | None = None,
    writers: dict[int, str] | None = None,
) -> bool:
    """Redo one record on ``container`` through its replay methods, a lease record on
    ``leases`` (id -> ``[id, pid, host crc, expires_us, episode ids]``, as the snapshot keeps
    them) and what pins a writer's rows on ``pins`` (id -> ``[id, pid, start, ranges,
    split]``, ``PinTable.to_state``'s entries). False for a SAMPLE whose draw did not go
    as journaled; JournalError for a record that does not fit."""
    try:
        if kind == SAMPLE:
            call, n, length, strict, handed, refused = (int(v) for v in f[:6])
            if f.size not in (6, 7, 12, 13):
                raise ValueError(f"SAMPLE record of {f.size} fields")
            table = int(f[-1]) if f.size in (7, 13) else 0
            rng = [int(v) for v in f[6 : 6 + (f.size - 6) // 6 * 6]] or None
            draw = SampleRecord(call, n, length, bool(strict), handed, bool(refused), rng)
            return container.replay_sample(draw, table)
        if kind in (LEASE, RENEW, RELEASE):
            _apply_lease(leases if leases is not None else {}, kind, f)
            return True
        pins = pins if pins is not None else {}
        if kind in (RESERVE, RESERVE_PINNED):
            pointer, rows_written, next_reservation, n = (int(v) for v in f[:4])
            evicted = [(int(f[4 + 2 * i]), int(f[5 + 2 * i])) for i in range(n)]
            container.replay_reserve(evicted, pointer, rows_written, next_reservation)
            if kind == RESERVE_PINNED:
                _apply_pin(pins, f[4 + 2 * n :])
        elif kind == COMMIT:
            counters["rows_committed"], counters["episodes_committed"] = int(f[0]), int(f[1])
            n = int(f[2])
            episodes = f[3 : 3 + 3 * n].reshape(n, 3).tolist()  # ValueError if cut short
            if f.size not in (3 + 3 * n, 6 + 3 * n):
                raise ValueError(f"COMMIT record of {f.size} fields for {n} episodes")
            extra = f[3 + 3 * n :]  # the tables' mask, the time's bits, the writer's code
            mask = int(extra[0]) if extra.size else 0
            ids = container.replay_commit(
                [(i, s, e) for i, s, e in episodes], container.mask_members(mask)
            )
            if extra.size:  # who wrote them, and when
                writer = (writers or {}).get(int(extra[2]))
                container.replay_meta(ids, {}, writer, float(extra[1:2].view("<f8")[0]))
            if pins and n:  # a pinned reservation's commit: its first episode starts its rows
                first = episodes[0][1]  # (open reservations never overlap: one at most)
                for rid in [rid for rid, pin in pins.items() if pin[3][0][0] == first]:
                    del pins[rid]
        elif kind == META:
            n = int(f[0])
            ids, nbytes = f[1 : 1 + n].tolist(), int(f[1 + n])
            payload = f[2 + n :].tobytes()
            if len(ids) != n or len(payload) < nbytes:
                raise ValueError(f"META record cut short ({f.size} fields for {n} episodes)")
            saved = msgpack.unpackb(payload[:nbytes])
            container.replay_meta(ids, saved["m"], None, None)
        elif kind == WRITER:
            code, nbytes = int(f[0]), int(f[1])
            name = f[2:].tobytes()
            if len(name) < nbytes:
                raise ValueError(f"WRITER record cut short ({len(name)} bytes of {nbytes})")
            if writers is not None:
                writers[code] = name[:nbytes].decode()
        elif kind == ABORT:
            pins.pop(int(f[0]), None)
        elif kind == CLEAR:
            container.replay_clear(int(f[0]))
        elif kind == RESTORE:
            pointer, rows_written, n = (int(v) for v in f[:3])
            restored = [Episode(*(int(v) for v in f[3 + 3 * i : 6 + 3 * i])) for i in range(n)]
            container.replay_restore(restored, pointer, rows_written)
        elif kind == PRIORITY:
            n = int(f[0])
            if f.size not in (1 + 2 * n, 2 + 2 * n):
                raise ValueError(f"PRIORITY record of {f.size} fields for {n} rows")
            table = int(f[-1]) if f.size == 2 + 2 * n else 0
            rows, bits = f[1 : 1 + n], f[1 + n : 1 + 2 * n]
            container.replay_priorities(rows, bits.view("<f8"), table)
        elif kind != EPOCH:
            raise JournalError(f"unknown journal record type {kind}")
    except (IndexError, KeyError, TypeError, ValueError, msgpack.UnpackException) as exc:
        raise JournalError(f"journal record {kind} does not apply: {exc}") from exc
    return True


def pin_fields(
    reservation_id: int,
    pid: int,
    start: int,
    ranges: list[Range],
    split: int | list[int],
    tables: int = 0,
) -> list[int]:
    """What RESERVE_PINNED adds after the RESERVE fields (see the module docstring): a count
    of equal episodes is one field (negative), unequal lengths one each; then, for episodes
    going into only some tables, their mask (``Container.members_mask``)."""
    head = [reservation_id, pid, start, len(ranges), *(v for r in ranges for v in r)]
    fields = [*head, -split] if isinstance(split, int) else [*head, len(split), *split]
    return [*fields, tables] if tables else fields


def _apply_pin(pins: dict[int, list[Any]], f: np.ndarray) -> None:
    rid, pid, start, m = (int(v) for v in f[:4])
    ranges = f[4 : 4 + 2 * m].reshape(m, 2).tolist()
    k = int(f[4 + 2 * m])
    size = 5 + 2 * m + max(k, 0)
    split: int | list[int] = -k if k < 0 else f[5 + 2 * m : size].tolist()
    if f.size not in (size, size + 1):
        raise ValueError(f"RESERVE_PINNED record of {f.size} pin fields")
    tables = int(f[size]) if f.size > size else 0
    pins[rid] = [rid, pid, start, ranges, split, tables]


def _apply_lease(leases: dict[int, list[Any]], kind: int, f: np.ndarray) -> None:
    lease_id = int(f[0])
    if kind == LEASE:
        pid, host_crc, expires_us, n = (int(v) for v in f[1:5])
        if f.size != LEASE_FIELDS + n:
            raise ValueError(f"LEASE record of {f.size} fields for {n} episodes")
        leases[lease_id] = [lease_id, pid, host_crc, expires_us, f[5:].tolist()]
    elif kind == RENEW and lease_id in leases:
        leases[lease_id][3] = int(f[1])
    elif kind == RELEASE:
        leases.pop(lease_id, None)
