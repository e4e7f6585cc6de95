"""The control-plane wire protocol: message shapes, version, codec and validation.

A message is a list of frames: one msgpack map (the header), then zero or more raw payload
frames (row bytes, used only by remote clients). Clients use DEALER sockets, the daemon one
ROUTER socket, or the local lane beside it (``unix.py``: the same messages).
``docs/protocol.md`` is the specification; this module is its code (the msgpack codec itself is
``codec.py``), and a test checks that the two agree on the version.

Every request header carries ``v`` (protocol version), ``op`` and ``seq`` (echoed in the reply
so a client can match replies to requests). Every reply carries ``v``, ``seq`` and ``ok``; an
error reply carries ``error = {"code", "message"}`` with a code from :mod:`shmbuffer.errors`.

Requests are checked against :data:`REQUESTS` before they touch any state: unknown ops, missing
or extra fields, wrong types and out-of-range numbers are refused with a message that names the
field, and the checks across fields that a per-field :class:`Spec` cannot express (``rows``
split by ``episodes`` or ``lengths``, a slice's ``length``) are the op's entry in
:data:`VALIDATORS`. :data:`REPLIES` is the other direction: every field a successful reply may
carry (``replies.py``, handed on from here, as is :class:`Spec` from ``spec.py``).
``tests/test_protocol.py`` holds both tables and ``docs/protocol.md`` together, and
``tests/test_handlers.py`` checks that the daemon's real replies match :data:`REPLIES`. Adding
an op is three places: its request entries here, its reply entries in ``replies.py`` and its
handler in ``daemon/service.py``. Nothing here knows about sockets.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from shmbuffer.errors import (
    LimitExceededError,
    ProtocolError,
    ShmBufferError,
    VersionMismatchError,
)

# The codec's names are handed on (``as``: re-exported): importers know them from here.
from shmbuffer.wire.codec import MAX_HEADER_BYTES as MAX_HEADER_BYTES  # noqa: PLC0414
from shmbuffer.wire.codec import decode as decode  # noqa: PLC0414
from shmbuffer.wire.codec import decode_f64 as decode_f64  # noqa: PLC0414
from shmbuffer.wire.codec import decode_i64 as decode_i64  # noqa: PLC0414
from shmbuffer.wire.codec import encode as encode  # noqa: PLC0414
from shmbuffer.wire.codec import encode_f64 as encode_f64  # noqa: PLC0414
from shmbuffer.wire.codec import encode_i64 as encode_i64  # noqa: PLC0414

# The reply tables and a field's spec live beside this module; importers know them from here.
from shmbuffer.wire.replies import REPLIES as REPLIES  # noqa: PLC0414
from shmbuffer.wire.replies import validate_reply as validate_reply  # noqa: PLC0414
from shmbuffer.wire.spec import Spec as Spec  # noqa: PLC0414
from shmbuffer.wire.spec import check_field

#: Versioned separately from the package. Minor bumps add optional fields or ops only.
PROTOCOL_VERSION = "1.11"
PROTOCOL_MAJOR = int(PROTOCOL_VERSION.split(".", maxsplit=1)[0])

MAX_INT = 2**62


def _int(lo: int = 0, hi: int = MAX_INT, required: bool = True) -> Spec:
    return Spec((int,), required, lo, hi)


_ID = _int(1)
_TIMEOUT = _int(0, 3_600_000, required=False)
#: A table's name, where a request addresses one (absent: the default table).
_TABLE = Spec((str,), required=False)
#: A priority for what a write publishes: one number for every item, or f64 bytes holding one
#: value per item (row in transition unit, episode in episode unit; see ``encode_f64``).
_PRIORITY = Spec((bytes, float, int), required=False)
#: Episode metadata: a map of name -> scalar (checked by the daemon, which names the name).
_META = Spec((dict,), required=False)
#: The tables a write's episodes go into: a list of table names (checked by the daemon).
_TABLES = Spec((list,), required=False)
#: A metadata filter (``docs/metadata.md``), parsed by the daemon, never evaluated.
_WHERE = Spec((str,), required=False)
#: Most episodes an ``episodes`` reply lists (what one reply's header carries well).
MAX_EPISODE_ROWS = 1 << 20
#: Most values a request's f64/i64 array field may hold: its header stays within
#: ``MAX_HEADER_BYTES`` (``update_priorities`` sends three arrays: 3 x 8 x 2048 = 48 KiB).
MAX_PRIORITIES = 4096
MAX_UPDATES = 2048
#: Most items (rows, slices or episodes) one sample may ask for: ``n`` of a request, and
#: of every sampling call, in-process ``Buffer`` included (:func:`check_sample_size`).
MAX_SAMPLE = 1 << 20
#: Most rows one sample may hand out (a slice counts its length, an episode its rows),
#: whatever carries it: a local reply holds an index and a stamp per row, so this is the
#: default ``max_payload_bytes`` / 16, and a daemon configured lower refuses sooner.
MAX_SAMPLE_ROWS = 1 << 27
#: Most reservations one ``reserve`` asks for ahead (``count``), and most it commits first.
MAX_AHEAD = 16

#: Every request op and its fields (besides ``v``, ``op`` and ``seq``).
REQUESTS: dict[str, dict[str, Spec]] = {
    "hello": {
        "role": Spec((str,), choices=("writer", "reader", "admin")),
        "pid": _int(0, 2**31),
        "host": Spec((str,)),
        "remote": Spec((bool,), required=False),
    },
    "bye": {},
    "ping": {},
    "stats": {},
    "define_schema": {"schema": Spec((dict,))},
    # Reserve rows, optionally committing an earlier reservation in the same round trip.
    "reserve": {
        "rows": _int(1),
        "episodes": _int(1, required=False),
        # Lengths of the episodes the rows hold, when they differ (a batch of small ones).
        "lengths": Spec((list,), required=False),
        "commit": _int(1, required=False),
        "timeout_ms": _TIMEOUT,
        # The priority of what this reservation's commit publishes (since 1.2).
        "priority": _PRIORITY,
        # A reservation asked for ahead of the write that will fill it: never parked; one
        # that would have to wait, or evict episodes while many are live, is answered at
        # once with reservation 0 (since 1.3).
        "ahead": Spec((bool,), required=False),
        # With ``ahead``: up to this many reservations of the same shape, one after another
        # (since 1.5); the reply's ``more`` holds those after the first.
        "count": _int(1, MAX_AHEAD, required=False),
        # Open reservations of this client to commit first, in order (since 1.5; with
        # ``commit``, that one first).
        "commits": Spec((list,), required=False),
        # ``[reservation, meta]`` pairs: what each commit carried attaches to the episodes it
        # publishes (since 1.9).
        "metas": Spec((list,), required=False),
        # The tables this reservation's episodes go into (since 1.9; absent: every table).
        "tables": _TABLES,
        # A buffer with compressed columns: each episode's chunk size in bytes per compressed
        # column (schema order), episode-major, i64 (since 1.10); the reply's ``offsets``
        # say where in ``bytes.bin`` the writer copies each.
        "chunks": Spec((bytes,), required=False),
    },
    # meta: scalars attached to every episode the commit publishes (since 1.9).
    "commit": {"reservation": _ID, "priority": _PRIORITY, "meta": _META},
    # written: rows the writer's copy may have touched; what the reservation evicted from the
    # others is published again (since 1.1).
    "abort": {"reservation": _ID, "written": _int(0, required=False)},
    # Remote writers: rows travel as payload frames, one per schema column, in schema order.
    "write": {
        "rows": _int(1),
        "episodes": _int(1, required=False),
        # Lengths of the episodes the rows hold, when they differ (since 1.10): a write with
        # a next_of column's tail rows (docs/frames.md).
        "lengths": Spec((list,), required=False),
        "timeout_ms": _TIMEOUT,
        "priority": _PRIORITY,
        "meta": _META,  # since 1.9
        "tables": _TABLES,  # since 1.9
    },
    # Committed rows changed in place (since 1.11): ``rows`` (i64), the bytes as payload
    # frames, one per key of ``keys`` (absent: every stored column, in schema order); with
    # ``generation`` (i64, one per row) rows whose stamp moved are skipped, not refused.
    "rewrite": {
        "rows": Spec((bytes,)),
        "keys": Spec((list,), required=False),
        "generation": Spec((bytes,), required=False),
        "timeout_ms": _TIMEOUT,
    },
    "sample": {
        "kind": Spec((str,), choices=("rows", "episodes", "slices")),
        "n": _int(1, MAX_SAMPLE),
        "length": _int(1, required=False),
        "lease": Spec((bool,), required=False),
        "payload": Spec((bool,), required=False),
        "release": _int(1, required=False),
        # Since 1.2: slices of shorter episodes too, padded (strict false); the importance
        # exponent of the weights; the reply's per-item info arrays; how long the sample may
        # wait in the daemon for data (FIFO, consume-once) or for the rate limiter.
        "strict": Spec((bool,), required=False),
        "beta": Spec((float, int), required=False),
        "info": Spec((bool,), required=False),
        "timeout_ms": _TIMEOUT,
        # The table to draw from (since 1.9; absent: the default table).
        "table": _TABLE,
        # Since 1.9: draw only from the episodes this metadata filter selects (uniformly, or
        # by priority on a prioritized table).
        "where": _WHERE,
        # Since 1.10: each drawn row's place in its episode (``before``, ``left`` in the
        # reply), for reads that reach the rows around it (frame stacks, n-step returns).
        "context": Spec((bool,), required=False),
    },
    # The live episodes a filter selects, ordered, at most ``limit``, with their metadata
    # (since 1.9).
    "episodes": {
        "where": _WHERE,
        "order_by": Spec((str,), required=False),
        "limit": _int(0, MAX_EPISODE_ROWS, required=False),
    },
    # Rows a reader drew itself over the runs the daemon publishes and the sample calls they
    # came from, counted as the daemon counts its own draws; the rows and their stamps then
    # travel as two payload frames of int64 (1.8).
    "drawn": {"rows": _int(0, MAX_SAMPLE_ROWS), "samples": _int(0), "table": _TABLE},
    # Set the priorities of sampled rows; stale ones (overwritten since) are skipped (1.2).
    "update_priorities": {
        "index": Spec((bytes,)),
        "priority": Spec((bytes,)),
        "generation": Spec((bytes,), required=False),
        "table": _TABLE,  # whose priorities (since 1.9; absent: the default table)
    },
    # This rank's share of every stored row, each once: the rows of one pass (1.2).
    "iterate": {
        "rank": _int(0, 1 << 20),
        "world_size": _int(1, 1 << 20),
        "shuffle": Spec((bool,), required=False),
        "drop_last": Spec((bool,), required=False),
        "epoch": _int(0, required=False),
        "table": _TABLE,  # whose use counts the pass raises (since 1.9)
    },
    # A remote reader's copy of rows named by physical index (iterate's rows), checked
    # against the stamps it was given (1.2).
    "read": {"rows": Spec((bytes,)), "gens": Spec((bytes,))},
    # Change the rate limiter's settings live (admin only; 1.2).
    "configure": {
        "samples_per_insert": Spec((float, int), required=False),
        "min_size": _int(0, required=False),
        "error_buffer": Spec((float, int), required=False),
        "table": _TABLE,  # whose limiter (since 1.9; absent: the default table)
    },
    "release": {"lease": _ID},
    # A reader's heartbeat: the lease lasts another lease_ttl (since 1.1).
    "renew": {"lease": _ID},
    "clear": {},
    "shutdown": {"keep": Spec((bool,), required=False)},
    # Write data, registry and sampler state to <to>/checkpoint (admin only); the reply comes
    # once the copy is done, the daemon serving everyone meanwhile.
    "checkpoint": {"to": Spec((str,))},
}

#: Most episodes one ``reserve`` may describe by ``lengths`` (a batch of small ones).
MAX_LENGTHS = 65_536


def _check_split(op: str, fields: Mapping[str, Any]) -> None:
    """``rows`` split into ``episodes`` equal episodes, or into episodes of ``lengths``."""
    num_rows = fields["rows"]
    lengths = fields.get("lengths")
    if lengths is None:
        num_sub = fields.get("episodes", 1)
        if num_rows % num_sub:
            raise ProtocolError(
                f"op {op!r}: field 'rows'={num_rows} is not a multiple of field "
                f"'episodes'={num_sub}"
            )
        return
    if "episodes" in fields:
        raise ProtocolError(f"op {op!r}: fields 'episodes' and 'lengths' are exclusive")
    if not 0 < len(lengths) <= MAX_LENGTHS or not all(type(n) is int and n > 0 for n in lengths):
        raise ProtocolError(
            f"op {op!r}: field 'lengths': 1 to {MAX_LENGTHS} positive ints expected"
        )
    if sum(lengths) != num_rows:
        raise ProtocolError(
            f"op {op!r}: field 'lengths' adds up to {sum(lengths)}, not 'rows'={num_rows}"
        )


def _check_sample(op: str, fields: Mapping[str, Any]) -> None:
    if fields["kind"] == "slices" and "length" not in fields:
        raise ProtocolError(f"op {op!r}: kind 'slices' needs field 'length'")
    if "strict" in fields and fields["kind"] != "slices":
        raise ProtocolError(f"op {op!r}: field 'strict' is for kind 'slices' only")


def _array_size(op: str, name: str, data: bytes, most: int) -> int:
    """Values in an 8-byte-per-value array field (``encode_i64``/``encode_f64``)."""
    if len(data) % 8:
        raise ProtocolError(
            f"op {op!r}: field {name!r} holds {len(data)} bytes, not a whole number of "
            "8-byte values"
        )
    if len(data) // 8 > most:
        raise ProtocolError(
            f"op {op!r}: field {name!r} holds {len(data) // 8} values, over the limit of {most}"
        )
    return len(data) // 8


def _check_priority(op: str, fields: Mapping[str, Any]) -> None:
    if op in ("reserve", "write"):
        _check_split(op, fields)
    priority = fields.get("priority")
    if isinstance(priority, bytes) and not _array_size(op, "priority", priority, MAX_PRIORITIES):
        raise ProtocolError(f"op {op!r}: field 'priority' holds no values")


def _check_reserve(op: str, fields: Mapping[str, Any]) -> None:
    _check_priority(op, fields)
    if "chunks" in fields:
        _array_size(op, "chunks", fields["chunks"], MAX_SAMPLE_ROWS)
    _check_metas(op, fields)
    if "count" in fields and not fields.get("ahead"):
        raise ProtocolError(f"op {op!r}: field 'count' is only for a reserve 'ahead'")
    commits = fields.get("commits")
    if commits is None:
        return
    ids = [*commits, *([fields["commit"]] if "commit" in fields else [])]
    if (
        len(commits) > MAX_AHEAD
        or not all(type(r) is int and 1 <= r <= MAX_INT for r in commits)
        or len(set(ids)) != len(ids)
    ):
        raise ProtocolError(
            f"op {op!r}: field 'commits' must list at most {MAX_AHEAD} distinct reservation "
            f"ids (ints 1..{MAX_INT}, 'commit' not among them), got {commits!r:.200}"
        )


def _check_metas(op: str, fields: Mapping[str, Any]) -> None:
    metas = fields.get("metas")
    if metas is None:
        return
    commits = [*fields.get("commits", ()), *([fields["commit"]] if "commit" in fields else [])]
    if not commits or not all(
        isinstance(pair, list) and len(pair) == 2 and type(pair[0]) is int and type(pair[1]) is dict
        for pair in metas
    ):
        raise ProtocolError(
            f"op {op!r}: field 'metas' must list [reservation, map] pairs of the commits the "
            f"reserve carries, got {metas!r:.200}"
        )


def _check_update(op: str, fields: Mapping[str, Any]) -> None:
    count = _array_size(op, "index", fields["index"], MAX_UPDATES)
    for name in ("priority", "generation"):
        if name in fields and _array_size(op, name, fields[name], MAX_UPDATES) != count:
            raise ProtocolError(
                f"op {op!r}: field {name!r} holds {len(fields[name]) // 8} values, field "
                f"'index' {count}: one per index expected"
            )


def _check_read(op: str, fields: Mapping[str, Any]) -> None:
    count = _array_size(op, "rows", fields["rows"], MAX_INT)
    if _array_size(op, "gens", fields["gens"], MAX_INT) != count:
        raise ProtocolError(f"op {op!r}: fields 'rows' and 'gens' must hold as many values")


def _check_rewrite(op: str, fields: Mapping[str, Any]) -> None:
    count = _array_size(op, "rows", fields["rows"], MAX_INT)
    if not count:
        raise ProtocolError(f"op {op!r}: field 'rows' holds no rows")
    stamps = fields.get("generation")
    if stamps is not None and _array_size(op, "generation", stamps, MAX_INT) != count:
        raise ProtocolError(
            f"op {op!r}: field 'generation' must hold one stamp per row of field 'rows' ({count})"
        )
    keys = fields.get("keys")
    if keys is not None and (not keys or not all(isinstance(k, str) for k in keys)):
        raise ProtocolError(f"op {op!r}: field 'keys' must list key names, got {keys!r:.200}")


def _check_iterate(op: str, fields: Mapping[str, Any]) -> None:
    if fields["rank"] >= fields["world_size"]:
        raise ProtocolError(
            f"op {op!r}: field 'rank'={fields['rank']} must be below field "
            f"'world_size'={fields['world_size']}"
        )


def _check_configure(op: str, fields: Mapping[str, Any]) -> None:
    if not set(fields) - {"table"}:
        raise ProtocolError(f"op {op!r}: give at least one setting to change")


#: Checks across an op's fields (or inside a list) that a per-field :class:`Spec` cannot
#: express; run by :func:`validate_request` once every field passed its own.
VALIDATORS: dict[str, Callable[[str, Mapping[str, Any]], None]] = {
    "reserve": _check_reserve,
    "write": _check_priority,
    "commit": _check_priority,
    "sample": _check_sample,
    "update_priorities": _check_update,
    "iterate": _check_iterate,
    "read": _check_read,
    "rewrite": _check_rewrite,
    "configure": _check_configure,
}


def check_sample_size(n: int, length: int = 1, what: str = "n") -> None:
    """Refuse a sample of ``n`` items of ``length`` rows each (a slice's length; an
    episode's, expected) over :data:`MAX_SAMPLE` items or :data:`MAX_SAMPLE_ROWS` rows with
    LimitExceededError naming the argument: before anything is drawn, sent or allocated."""
    if n > MAX_SAMPLE:
        raise LimitExceededError(
            f"{what}={n:,} is over the limit of {MAX_SAMPLE:,} items per sample; sample in "
            "several calls"
        )
    if n * length > MAX_SAMPLE_ROWS:
        raise LimitExceededError(
            f"{what}={n:,} items of {length:,} rows each make {n * length:,} rows, over the "
            f"limit of {MAX_SAMPLE_ROWS:,} rows per sample; sample fewer or shorter ones"
        )


def episode_split(fields: Mapping[str, Any]) -> int | list[int]:
    """How a validated ``reserve`` or ``write`` splits its rows: a number of equal episodes,
    or the lengths of unequal ones."""
    lengths = fields.get("lengths")
    return int(fields.get("episodes", 1)) if lengths is None else list(lengths)


_VERSION_RE = re.compile(r"([0-9]{1,6})(?:\.[0-9]{1,6}){0,2}")


def check_version(version: Any) -> None:
    match = _VERSION_RE.fullmatch(version) if isinstance(version, str) else None
    if match is None:  # ASCII digits only: str.isdigit() accepts "²", which int() refuses
        raise ProtocolError(f"field 'v': expected a version string like {PROTOCOL_VERSION!r}")
    if int(match.group(1)) != PROTOCOL_MAJOR:
        raise VersionMismatchError(
            f"protocol version {version} is not compatible with this side's {PROTOCOL_VERSION}"
        )


def validate_request(header: Mapping[str, Any]) -> dict[str, Any]:
    """Return the request's fields (without v/op/seq) after checking every one of them."""
    check_version(header.get("v"))
    op = header.get("op")
    if not isinstance(op, str) or op not in REQUESTS:
        raise ProtocolError(f"field 'op': unknown op {op!r}; known: {sorted(REQUESTS)}")
    seq = header.get("seq")
    if type(seq) is not int or not 0 <= seq < MAX_INT:
        raise ProtocolError(f"field 'seq': expected a non-negative int, got {seq!r}")
    specs = REQUESTS[op]
    fields = {k: v for k, v in header.items() if k not in ("v", "op", "seq")}
    for name in fields.keys() - specs.keys():
        raise ProtocolError(f"op {op!r}: unknown field {name!r}")
    for name, spec in specs.items():
        if name not in fields:
            if spec.required:
                raise ProtocolError(f"op {op!r}: missing field {name!r}")
            continue
        check_field(op, name, fields[name], spec)
    validator = VALIDATORS.get(op)
    if validator is not None:
        validator(op, fields)
    return fields


def request(op: str, seq: int, **fields: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "op": op, "seq": seq, **fields}


def ok_reply(seq: int, **fields: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "seq": seq, "ok": True, **fields}


def error_reply(seq: Any, error: ShmBufferError) -> dict[str, Any]:
    return {
        "v": PROTOCOL_VERSION,
        "seq": seq if type(seq) is int else -1,
        "ok": False,
        "error": {"code": error.code, "message": str(error)},
    }


def payload_sizes(frames: Sequence[bytes | memoryview]) -> int:
    return sum(len(f) for f in frames)
