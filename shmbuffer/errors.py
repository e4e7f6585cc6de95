"""The exception hierarchy. Each class carries the wire code the daemon sends for it.

A client turns an error reply back into the same class with :func:`error_from_code`, so
callers catch types, never match strings. A class that sets its own ``code`` registers it by
being defined (``__init_subclass__``); one that inherits its parent's code travels as the
parent. Every error class of the package is defined here, whichever module raises it.
"""

from __future__ import annotations

from typing import Any, ClassVar

_BY_CODE: dict[str, type[ShmBufferError]] = {}


class ShmBufferError(Exception):
    """Base of every error shmbuffer raises on purpose."""

    code: ClassVar[str] = "internal"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        inherited = any(cls.code == getattr(base, "code", None) for base in cls.__mro__[1:])
        if "code" in cls.__dict__ and not inherited:
            if cls.code in _BY_CODE:
                raise TypeError(f"wire code {cls.code!r} is taken by {_BY_CODE[cls.code]}")
            _BY_CODE[cls.code] = cls


_BY_CODE[ShmBufferError.code] = ShmBufferError


class SchemaError(ShmBufferError, ValueError):
    """A batch does not match the buffer's keys, dtypes or per-row shapes."""

    code = "schema"


class InvalidArgumentError(ShmBufferError, ValueError):
    """An argument a sampler or the container cannot use: a negative, NaN or wrong-length
    priority, an index out of range, a sample size < 1, a call the sampler does not serve in
    this unit. Nothing was changed."""

    code = "invalid_argument"


class QueryError(InvalidArgumentError):
    """A metadata filter or order key that cannot be used: a syntax error, an unknown name,
    or a comparison of mismatched kinds. The message names the character position (travels
    as ``invalid_query``, since protocol 1.9)."""

    code = "invalid_query"


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


class JournalError(SegmentError):
    """The journal or its snapshot cannot be replayed (missing, foreign or inconsistent)."""


class CheckpointError(SegmentError):
    """A checkpoint cannot be written, or a folder holds no complete checkpoint."""


class RecoveryError(SegmentError):
    """Nothing to resume or restore, or it does not match the requested settings."""


class ConfigError(ShmBufferError, ValueError):
    """A setting that cannot be used as given (daemon options, key files); raised before
    anything starts."""

    code = "config"


class InsecureEndpointError(ConfigError):
    """A tcp endpoint that would expose the buffer without authentication."""


class KeyFileError(ConfigError):
    """A CURVE key or certificate that cannot be used as asked."""


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


class SegmentNotFoundError(SegmentError, NotFoundError):
    """No segment of that name: catchable as either SegmentError or NotFoundError."""

    code = "not_found"  # travels as NotFoundError


class PermissionDeniedError(ShmBufferError, PermissionError):
    """Not this client's to use: a reservation or lease of another client, an admin op without
    a credential, or another user's daemon socket or segment (the message says who may)."""

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


class ClosedError(ShmBufferError):
    """A Writer, Reader, Buffer or connection used after ``close()`` (client side; closing
    twice is fine)."""

    code = "closed"


class ForkedClientError(ShmBufferError):
    """A Writer or Reader used in a process forked after it was created (client side): its
    ZeroMQ socket belongs to the parent. Create a new one in the child."""

    code = "forked"


class LeaseExpiredError(NotFoundError):
    """A lease lapsed (its TTL ran out unrenewed) while its views were in use: the rows may
    have been overwritten (client side; the daemon reports the lease as ``not_found``, so this
    is a NotFoundError too)."""

    code = "lease_expired"


class UnstoredWritesWarning(RuntimeWarning):
    """A Writer dropped without ``close()`` (collected, or left at interpreter exit) could
    not store what it had been given: the daemon was gone, or did not answer within the
    Writer's timeout. The message names the rows (client side)."""


def error_from_code(code: str, message: str) -> ShmBufferError:
    """Rebuild the exception a daemon reported; unknown codes become the base class."""
    return _BY_CODE.get(code, ShmBufferError)(message)


def all_codes() -> list[str]:
    return sorted(_BY_CODE)
