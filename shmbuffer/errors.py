"""The exception hierarchy. Each class carries the wire code the daemon sends for it.

A client turns an error reply back into the same class with :func:`error_from_code`, so
callers catch types, never match strings.
"""

from __future__ import annotations


class ShmBufferError(Exception):
    """Base of every error shmbuffer raises on purpose."""

    code: str = "internal"


class SchemaError(ShmBufferError, ValueError):
    """A batch does not match the buffer's keys, dtypes or per-row shapes."""

    code = "schema"


class CapacityError(ShmBufferError):
    """The rows do not fit: a fixed-mode buffer is full, or a request exceeds capacity."""

    code = "capacity"


class SegmentError(ShmBufferError):
    """Creating, attaching or unlinking a shared-memory segment failed."""

    code = "segment"


class InvalidNameError(SegmentError, ValueError):
    """A buffer name that could escape the shm folder or is otherwise unusable."""

    code = "invalid_name"


class OutOfSpaceError(SegmentError):
    """The target file system cannot hold the buffer (tmpfs would SIGBUS later)."""

    code = "out_of_space"


class ProtocolError(ShmBufferError):
    """A message that is malformed, of an unknown op, or with a wrong field."""

    code = "protocol"


class VersionMismatchError(ProtocolError):
    """Client and daemon speak protocol versions with different majors."""

    code = "version"


class NotFoundError(ShmBufferError, KeyError):
    """A reservation, lease, episode or buffer that does not exist (any more)."""

    code = "not_found"

    def __str__(self) -> str:  # KeyError quotes its message; we do not want that
        return str(self.args[0]) if self.args else ""


class PermissionDeniedError(ShmBufferError, PermissionError):
    """A client acted on a reservation or lease that belongs to another client."""

    code = "permission"


class LimitExceededError(ShmBufferError):
    """Too many clients, reservations, leases, or a message over the size limit."""

    code = "limit"


class DaemonUnavailableError(ShmBufferError, ConnectionError):
    """No daemon answered within the configured time."""

    code = "unavailable"


class UnknownClientError(DaemonUnavailableError):
    """The daemon does not know this client: it restarted (``--resume``), or it dropped the
    client after ``client_idle_ttl`` of silence. Reconnect (a new Writer/Reader)."""

    code = "unknown_client"


class WaitTimeoutError(ShmBufferError, TimeoutError):
    """A bounded wait (for rows, for a lease to end, for a flush) ran out."""

    code = "timeout"


class EmptyBufferError(ShmBufferError):
    """Sampling was asked of a buffer with too few committed rows or episodes."""

    code = "empty"


class TornReadError(ShmBufferError):
    """Rows kept being overwritten under a reader through every retry (a ring far too small
    for the write rate)."""

    code = "torn"


_BY_CODE: dict[str, type[ShmBufferError]] = {
    cls.code: cls
    for cls in (
        ShmBufferError,
        SchemaError,
        CapacityError,
        SegmentError,
        InvalidNameError,
        OutOfSpaceError,
        ProtocolError,
        VersionMismatchError,
        NotFoundError,
        PermissionDeniedError,
        LimitExceededError,
        DaemonUnavailableError,
        UnknownClientError,
        WaitTimeoutError,
        EmptyBufferError,
        TornReadError,
    )
}


def error_from_code(code: str, message: str) -> ShmBufferError:
    """Rebuild the exception a daemon reported; unknown codes become the base class."""
    return _BY_CODE.get(code, ShmBufferError)(message)


def all_codes() -> list[str]:
    return sorted(_BY_CODE)
