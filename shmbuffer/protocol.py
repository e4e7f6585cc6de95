"""The control-plane wire protocol: message shapes, version, codec and validation.

A message is a list of ZeroMQ frames: one msgpack map (the header), then zero or more raw
payload frames (row bytes, used only by remote clients). Clients use DEALER sockets, the daemon
one ROUTER socket. ``docs/protocol.md`` is the specification; this module is its code, and a
test checks that the two agree on the version.

Every request header carries ``v`` (protocol version), ``op`` and ``seq`` (echoed in the reply
so a client can match replies to requests). Every reply carries ``v``, ``seq`` and ``ok``; an
error reply carries ``error = {"code", "message"}`` with a code from :mod:`shmbuffer.errors`.

Requests are checked against :data:`REQUESTS` before they touch any state: unknown ops, missing
or extra fields, wrong types and out-of-range numbers are refused with a message that names the
field. Nothing here knows about sockets.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from shmbuffer.errors import ProtocolError, ShmBufferError, VersionMismatchError

#: Versioned separately from the package. Minor bumps add optional fields or ops only.
PROTOCOL_VERSION = "1.1"
PROTOCOL_MAJOR = int(PROTOCOL_VERSION.split(".", maxsplit=1)[0])

#: Largest header accepted, in bytes; payload frames are bounded by the daemon's own limit.
MAX_HEADER_BYTES = 64 * 1024
MAX_INT = 2**62


@dataclass(frozen=True)
class Spec:
    """One field of a request: accepted Python types, whether required, numeric bounds."""

    types: tuple[type, ...]
    required: bool = True
    lo: int | None = None
    hi: int | None = None
    choices: tuple[str, ...] | None = None


def _int(lo: int = 0, hi: int = MAX_INT, required: bool = True) -> Spec:
    return Spec((int,), required, lo, hi)


_ID = _int(1)
_TIMEOUT = _int(0, 3_600_000, required=False)

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
    },
    "commit": {"reservation": _ID},
    # written: rows the writer's copy may have touched; what the reservation evicted from the
    # others is published again (since 1.1).
    "abort": {"reservation": _ID, "written": _int(0, required=False)},
    # Remote writers: rows travel as payload frames, one per schema column, in schema order.
    "write": {"rows": _int(1), "episodes": _int(1, required=False), "timeout_ms": _TIMEOUT},
    "sample": {
        "kind": Spec((str,), choices=("rows", "episodes", "slices")),
        "n": _int(1, 1 << 20),
        "length": _int(1, required=False),
        "lease": Spec((bool,), required=False),
        "payload": Spec((bool,), required=False),
        "release": _int(1, required=False),
    },
    "release": {"lease": _ID},
    # A reader's heartbeat: the lease lasts another lease_ttl (since 1.1).
    "renew": {"lease": _ID},
    "clear": {},
    "shutdown": {"keep": Spec((bool,), required=False)},
    # Write data, registry and sampler state to <to>/checkpoint (admin only).
    "checkpoint": {"to": Spec((str,))},
}


def encode(header: Mapping[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)  # type: ignore[no-any-return]


def decode(frame: bytes | memoryview) -> dict[str, Any]:
    """Parse a header frame; anything but a msgpack map of string keys is a ProtocolError."""
    if len(frame) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(frame)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises a zoo of types for bad input
        raise ProtocolError(f"header is not valid msgpack: {type(exc).__name__}") from None
    if not isinstance(header, dict) or not all(isinstance(k, str) for k in header):
        raise ProtocolError("header must be a msgpack map with string keys")
    return header


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
        _check_field(op, name, fields[name], spec)
    return fields


def _check_field(op: str, name: str, value: Any, spec: Spec) -> None:
    # bool is an int subclass; never accept one for the other.
    if type(value) not in spec.types:
        expected = "/".join(t.__name__ for t in spec.types)
        raise ProtocolError(
            f"op {op!r}: field {name!r} must be {expected}, got {type(value).__name__}"
        )
    if (spec.lo is not None and value < spec.lo) or (spec.hi is not None and value > spec.hi):
        raise ProtocolError(
            f"op {op!r}: field {name!r}={value} is out of range [{spec.lo}, {spec.hi}]"
        )
    if spec.choices is not None and value not in spec.choices:
        raise ProtocolError(f"op {op!r}: field {name!r}={value!r} is not one of {spec.choices}")


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
