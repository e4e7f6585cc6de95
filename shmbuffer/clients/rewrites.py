"""Committed rows changed in place, through the daemon (``Writer.rewrite``).

The new bytes travel in the request, whatever the transport, and the daemon copies them in
(``daemon/rewrites.py`` says why, and how readers copying those rows stay safe): rewrites are
corrections of a few rows (a relabelled reward, a patched field), not the write path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from shmbuffer.clients.connection import Connection
from shmbuffer.errors import SchemaError
from shmbuffer.storage import rows as row_bytes
from shmbuffer.storage.fields import key_str
from shmbuffer.storage.indices import to_host
from shmbuffer.storage.schema import Schema, iter_leaves
from shmbuffer.wire.protocol import decode_i64, encode_i64


def rewrite(
    conn: Connection,
    schema: Schema | None,
    index: Any,
    data: Mapping[str, Any],
    generation: Any = None,
    timeout: float = 30.0,
) -> np.ndarray:
    """Set rows ``index`` of the keys ``data`` holds (one value per row, leading dimension
    ``len(index)``; some of the schema's stored keys or all) to ``data``; which rows were
    written, as a boolean mask. With ``generation`` (the stamps the rows had when read), a
    row whose stamp moved since, or that holds no committed data, is skipped; without it
    such rows are refused, nothing written. SchemaError names a key, dtype or shape that does
    not fit; nothing is sent then."""
    if schema is None:
        raise SchemaError("the buffer has no schema yet: nothing to rewrite")
    rows = np.asarray(to_host(index))
    if rows.dtype.kind not in "iu" and rows.size:
        raise TypeError(f"rewrite takes row numbers, got an index of dtype {rows.dtype}")
    rows = rows.astype(np.int64).reshape(-1)
    given = [key for key, _ in iter_leaves(data)]
    for key in given:
        if key not in schema:
            stored = [key_str(f.key) for f in schema.fields]
            raise SchemaError(f"key {key_str(key)!r} is not in the schema (keys: {stored})")
    part = Schema([schema[k] for k in given])
    shape, leaves = part.validate(data)
    if shape != (rows.size,):
        raise SchemaError(
            f"rewrite of {rows.size} rows given values of batch shape {list(shape)}: one "
            "value per row expected"
        )
    conn.check_payload("rewrite", rows.size * part.row_nbytes)
    frames = [row_bytes.to_bytes(leaves[f.key], f.dtype) for f in part.fields]
    fields: dict[str, Any] = {
        "rows": encode_i64(rows),
        "keys": [key_str(f.key) for f in part.fields],
        "timeout_ms": int(timeout * 1000),
    }
    if generation is not None:
        stamps = np.asarray(to_host(generation), dtype=np.int64).reshape(-1)
        if stamps.size != rows.size:
            raise ValueError(
                f"generation holds {stamps.size} stamps for {rows.size} rows: one per row"
            )
        fields["generation"] = encode_i64(stamps)
    reply = conn.call("rewrite", frames, timeout=timeout + conn.timeout, **fields)
    written = np.ones(rows.size, dtype=bool)
    written[decode_i64(reply["skipped"])] = False
    return written
