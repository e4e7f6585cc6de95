"""shmbuffer: a replay/rollout buffer that many processes share through one daemon.

Public names only. ``Buffer`` is the in-process engine; ``Writer`` and ``Reader`` talk to a
``shmbuffer-daemon``; ``Storage`` is the drop-in façade for code written against RLightning's
storage backend.
"""

from shmbuffer import errors
from shmbuffer.clients.buffer import Buffer
from shmbuffer.clients.reader import Reader
from shmbuffer.clients.storage import Storage
from shmbuffer.clients.writer import Writer
from shmbuffer.errors import ShmBufferError
from shmbuffer.schema import Schema

__all__ = ["Buffer", "Reader", "Schema", "ShmBufferError", "Storage", "Writer", "errors"]
__version__ = "0.1.0"
