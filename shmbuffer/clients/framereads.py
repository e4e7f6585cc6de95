"""A Reader's sample of rows with frame stacks (``api/framegather.py``): drawn by the daemon
with where each row lies in its episode (``context``), the stacks built here from the shared
rows, and every row a stack read checked against the drawn row's stamp after the copy.

One reservation gives all its rows one stamp (``storage/stamps.py``), so a frame read for a
drawn row still carries that row's stamp exactly when it was written with it and has not been
overwritten since; an item with a row that moved is torn and drawn again (leased, as the
Reader's other redraws), its stacks rebuilt. The stacks are built only in a process that maps
the rows: a remote reader's sample is refused by the daemon.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shmbuffer.errors import InvalidArgumentError, TornReadError
from shmbuffer.wire.protocol import decode_f64, decode_i64

#: Redraws of the torn items of one sample before it gives up (as the Reader's own).
MAX_RESAMPLES = 8


def sample_frames(reader: Any, fields: dict[str, Any], info: bool) -> Any:
    """``fields``' rows (a ``sample`` of kind rows) with their stacks, for ``reader`` (the
    Reader calling, typed loosely: it imports this): a TensorDict, or with ``info`` the
    batch and its info, as ``Reader.sample`` returns them."""
    # here, not at module level: a Reader's modules import no torch until it attaches
    from shmbuffer.api.framegather import gather_frames, nest_frames

    schema, segment = reader.schema, reader.segment
    if reader.remote or schema is None or segment is None or not segment.arrays:
        raise InvalidArgumentError(
            "frame stacks are built by a Reader that maps the rows (a local one, on the host)"
        )
    fields = {**fields, "context": True}
    reply, _ = reader._sample_ahead(**fields)  # the next draw asked for while this one copies
    items = reader._items(reply, info, ())
    physical, gens = decode_i64(reply["rows"]), decode_i64(reply["gens"])
    before = decode_i64(reply["before"])
    leases = [reply["lease"]] if "lease" in reply else []
    stop_at_done = reader.unit == "transition"
    try:
        flat, read = gather_frames(schema, segment.arrays, physical, before, stop_at_done)
        todo = np.arange(len(physical))
        for _ in range(MAX_RESAMPLES + 1):
            stamps = segment.generations[read[todo]]
            todo = todo[(stamps != gens[todo, None]).any(axis=1)]
            if not len(todo):
                break
            reader._went_stale()
            reader.resamples += len(todo)
            again, _ = reader._sample(**{**fields, "n": len(todo), "lease": True})
            if "lease" in again:
                leases.append(again["lease"])
            for name, values in items.items():
                values[todo] = _item(name, again[name])
            fresh, fresh_gens = decode_i64(again["rows"]), decode_i64(again["gens"])
            sub, sub_read = gather_frames(
                schema, segment.arrays, fresh, decode_i64(again["before"]), stop_at_done
            )
            for key, tensor in flat.items():
                tensor[todo] = sub[key]
            read[todo], gens[todo], physical[todo] = sub_read, fresh_gens, fresh
        else:
            raise TornReadError(f"rows kept being overwritten through {MAX_RESAMPLES} resamples")
    finally:
        if leases:
            reader._release_soon(leases)
    data = nest_frames(flat, len(physical))
    return (data, reader._info(items)) if info else data


def _item(name: str, value: bytes) -> np.ndarray:
    return decode_f64(value) if name in ("probability", "weight") else decode_i64(value)
