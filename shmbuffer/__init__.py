"""shmbuffer: a replay/rollout buffer that many processes share through one daemon.

Public names only. ``Buffer`` is the in-process engine; ``Writer`` and ``Reader`` talk to a
``shmbuffer-daemon``; ``Storage`` is the drop-in façade for code written against RLightning's
storage backend; ``checkpoint`` asks a daemon to write one; the error classes are those of
``shmbuffer.errors``.

Imports are lazy so that ``shmbuffer-daemon status`` does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Every error class too, so a training loop catches ``shmbuffer.WaitTimeoutError`` as the docs
# name it (``shmbuffer.errors`` holds the same classes).
from shmbuffer import errors
from shmbuffer.errors import (
    CapacityError,
    CheckpointError,
    ClosedError,
    ConfigError,
    DaemonUnavailableError,
    EmptyBufferError,
    ForkedClientError,
    InsecureEndpointError,
    InvalidArgumentError,
    InvalidNameError,
    JournalError,
    KeyFileError,
    LeaseExpiredError,
    LimitExceededError,
    NotFoundError,
    OutOfSpaceError,
    PermissionDeniedError,
    ProtocolError,
    QueryError,
    RecoveryError,
    SchemaError,
    SegmentError,
    SegmentNotFoundError,
    ShmBufferError,
    TornReadError,
    UnknownClientError,
    UnstoredWritesWarning,
    VersionMismatchError,
    WaitTimeoutError,
)

if TYPE_CHECKING:
    from shmbuffer.buffer import Buffer
    from shmbuffer.clients.admin import checkpoint
    from shmbuffer.clients.reader import Reader
    from shmbuffer.clients.storage import Storage
    from shmbuffer.clients.writer import Writer
    from shmbuffer.storage.schema import Schema

_LAZY = {
    "Buffer": "shmbuffer.buffer",
    "Reader": "shmbuffer.clients.reader",
    "Storage": "shmbuffer.clients.storage",
    "Writer": "shmbuffer.clients.writer",
    "Schema": "shmbuffer.storage.schema",
    "checkpoint": "shmbuffer.clients.admin",
}

__all__ = [
    "Buffer",
    "CapacityError",
    "CheckpointError",
    "ClosedError",
    "ConfigError",
    "DaemonUnavailableError",
    "EmptyBufferError",
    "ForkedClientError",
    "InsecureEndpointError",
    "InvalidArgumentError",
    "InvalidNameError",
    "JournalError",
    "KeyFileError",
    "LeaseExpiredError",
    "LimitExceededError",
    "NotFoundError",
    "OutOfSpaceError",
    "PermissionDeniedError",
    "ProtocolError",
    "QueryError",
    "Reader",
    "RecoveryError",
    "Schema",
    "SchemaError",
    "SegmentError",
    "SegmentNotFoundError",
    "ShmBufferError",
    "Storage",
    "TornReadError",
    "UnknownClientError",
    "UnstoredWritesWarning",
    "VersionMismatchError",
    "WaitTimeoutError",
    "Writer",
    "checkpoint",
    "errors",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shmbuffer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
