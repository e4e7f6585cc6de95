"""The wire's codec: a header as msgpack (refusing, by field, what msgpack cannot carry) and
back, capped in size; index and float arrays as the little-endian bytes the headers carry.
:mod:`shmbuffer.wire.protocol` (the message tables and their validation) hands these names on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from shmbuffer.errors import ProtocolError

#: Largest request header the daemon accepts, in bytes; payload frames are bounded by its own
#: limit. Reply headers are decoded whole (a sample reply holds 16 bytes per row: ``decode``).
MAX_HEADER_BYTES = 64 * 1024


def encode(header: Mapping[str, Any]) -> bytes:
    """A header as msgpack; a value msgpack cannot carry (an int outside 64 bits, an object)
    is a ProtocolError naming its field, before anything is sent."""
    try:
        return msgpack.packb(header, use_bin_type=True)  # type: ignore[no-any-return]
    except (OverflowError, TypeError, ValueError) as exc:
        raise ProtocolError(
            _unencodable(header, "") or f"header cannot be encoded: {exc}"
        ) from None


#: The integers msgpack carries: int64 and uint64.
_MSGPACK_INTS = (-(2**63), 2**64 - 1)
_PLAIN = (bool, int, float, str, bytes, type(None))


def _unencodable(value: Any, path: str) -> str | None:
    """The first field in ``value`` that msgpack cannot carry, described (None: none)."""
    if isinstance(value, Mapping):
        children = [(f"{path}.{k}" if path else str(k), v) for k, v in value.items()]
    elif isinstance(value, list | tuple):
        children = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    elif type(value) is int and not _MSGPACK_INTS[0] <= value <= _MSGPACK_INTS[1]:
        return f"field {path!r}={value} cannot be sent: the protocol's integers are 64-bit"
    elif isinstance(value, _PLAIN):
        return None
    else:
        return f"field {path!r} cannot be sent: a value of type {type(value).__name__}"
    for name, child in children:
        found = _unencodable(child, name)
        if found:
            return found
    return None


def decode(frame: bytes | memoryview, max_bytes: int | None = MAX_HEADER_BYTES) -> dict[str, Any]:
    """Parse a header frame; anything but a msgpack map of string keys is a ProtocolError.

    Requests are capped at ``MAX_HEADER_BYTES`` to protect the daemon; a client decodes
    replies with ``max_bytes=None``: a sample reply carries an index and a stamp per sampled
    row, so it may be megabytes."""
    if max_bytes is not None and len(frame) > max_bytes:
        raise ProtocolError(f"header of {len(frame)} bytes exceeds {max_bytes}")
    try:
        header = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises a zoo of types for bad input
        raise ProtocolError(f"header is not valid msgpack: {type(exc).__name__}") from None
    if not isinstance(header, dict) or not all(isinstance(k, str) for k in header):
        raise ProtocolError("header must be a msgpack map with string keys")
    return header


def encode_i64(values: npt.ArrayLike) -> bytes:
    """An index array as the wire carries it (``rows``, ``starts``, ``ids``, ``lengths``,
    ``gens``): msgpack bin of little-endian int64."""
    return np.ascontiguousarray(values, dtype="<i8").tobytes()


def decode_i64(data: bytes) -> npt.NDArray[np.int64]:
    """An index array from the wire, as a writable native int64 copy (a reader patches the
    rows it samples again into it)."""
    return np.frombuffer(data, dtype="<i8").astype(np.int64)


def encode_f64(values: npt.ArrayLike) -> bytes:
    """A float array as the wire carries it (``probability``, ``weight``, ``priority``):
    msgpack bin of little-endian IEEE 754 float64."""
    return np.ascontiguousarray(values, dtype="<f8").tobytes()


def decode_f64(data: bytes) -> npt.NDArray[np.float64]:
    """A float array from the wire, as a writable native float64 copy."""
    return np.frombuffer(data, dtype="<f8").astype(np.float64)
