"""``start --import``: a Parquet or Minari dataset as a daemon's starting data.

The dataset's episodes are written before the daemon listens, through the daemon's own
``write`` op (a remote writer's: the daemon copies the rows), called in process on the service
that is about to serve: the same checks, the same journal records and the same registry as
any writer's episodes, and no client sees a half-loaded buffer. One ``write`` per episode, so
each keeps its boundary and its own metadata (the writer's names; ``id``, ``commit_time``
and ``writer`` are the new buffer's, the dataset keeps the old ones). A dataset larger than
the buffer leaves its newest episodes, as a writer's stream would; one the flow control
would hold back (a rate limiter's ratio, a FIFO buffer full of unread rows) stops the start
with an error saying so.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from shmbuffer.daemon.state import Deferred
from shmbuffer.errors import ConfigError
from shmbuffer.offline.cut import BUILTIN, Episode
from shmbuffer.offline.export import parse_target
from shmbuffer.storage import progress as bars
from shmbuffer.storage.schema import Schema, key_str
from shmbuffer.wire.protocol import PROTOCOL_VERSION, validate_request

if TYPE_CHECKING:
    from shmbuffer.daemon.service import BufferService

#: The importer's identity among the service's clients (never a socket's: those are 5 bytes).
IDENTITY = b"shmbuffer-import"


class Dataset(Protocol):
    schema: Schema
    meta_kinds: dict[str, str]

    @property
    def nbytes(self) -> int: ...

    def batches(self) -> Iterator[list[Episode]]: ...


def open_dataset(spec: str) -> Dataset:
    """``parquet:DIR`` or ``minari:DATASET_ID``, opened (its schema read, no rows yet)."""
    kind, where = parse_target(spec, "--import")
    if kind == "parquet":
        from shmbuffer.offline.parquet import ParquetDataset

        return ParquetDataset(where)
    from shmbuffer.offline.minari import MinariSource

    return MinariSource(where)


def load_into(service: BufferService, dataset: Dataset, label: str) -> dict[str, Any]:
    """Write every episode of ``dataset`` into ``service`` (not serving yet); what was done."""
    t0 = time.perf_counter()
    now = time.monotonic()
    service.handle(
        IDENTITY,
        "hello",
        {"role": "writer", "pid": os.getpid(), "host": socket.gethostname(), "remote": True},
        [],
        now,
    )
    fields = [key_str(f.key) for f in dataset.schema]
    update, close = bars.copy_progress("import", dataset.nbytes)
    episodes = rows = 0
    try:
        for batch in dataset.batches():
            for ep in batch:
                header: dict[str, Any] = {
                    "v": PROTOCOL_VERSION,
                    "op": "write",
                    "seq": episodes,
                    "rows": ep.length,
                }
                meta = {k: v for k, v in ep.meta.items() if k not in BUILTIN and v is not None}
                if meta:
                    header["meta"] = meta
                frames: list[bytes | memoryview] = [
                    np.ascontiguousarray(ep.columns[k]).reshape(-1).view(np.uint8).data
                    for k in fields
                ]
                try:
                    service.handle(IDENTITY, "write", validate_request(header), frames, now)
                except Deferred as exc:
                    raise ConfigError(
                        f"{label}: episode {episodes} could not be written at start: {exc}; "
                        "start without a rate limiter or a consume-once sampler, or with room "
                        "for the whole dataset"
                    ) from None
                episodes += 1
                rows += ep.length
            update(rows * dataset.schema.row_nbytes)
    finally:
        close()
        service.handle(IDENTITY, "bye", {}, [], now)
    return {"episodes": episodes, "rows": rows, "seconds": time.perf_counter() - t0}
