"""The daemon's ``rewrite``: committed rows changed in place, at rows the client names.

Rows are otherwise only ever written whole, into a reservation the daemon placed. A rewrite
changes rows that readers may be copying at that moment, so the daemon does it itself, inside
one request (the new bytes come as payload frames, as a remote writer's): a writer that stalls
or dies part way cannot leave a committed row half changed, and no other request runs between
the first byte and the last. In that request, in this order:

1. everything is checked first (the rows, the keys, each frame's size; which rows are
   committed, and with ``generation`` which still carry the stamp the client saw): a refusal
   changes nothing;
2. it waits (``Deferred``) while readers lease any episode it touches, as a reserve does, and
   while a running checkpoint cannot save those rows yet (``_save_for_checkpoint``: the rows of
   its cut are saved before they change);
3. readers that draw rows themselves are held off (``SpansFile.hold``: its sequence number
   stays odd), the whole episodes of the rows get one new stamp (``stamp_reservation``, a
   reservation's rule), and only then are the bytes copied: a reader that copied any of
   those rows before sees their stamp moved and copies them again; one the daemon answers
   next gets the new stamp and the new bytes.

The ring, the registry, the samplers and priorities do not change: the rows keep their places
and their episodes; only what they hold does. The copy is bracketed in the journal (REWRITE
before the stamps move, REWRITTEN after the last byte): a daemon killed in between resumes
without those episodes, whose rows may be half changed (``records.py``).

Refused where it cannot be done so: compressed columns (a chunk holds a whole episode) and
columns that store nothing (``next_of``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from shmbuffer.daemon.clients import Client
from shmbuffer.daemon.records import record_bytes
from shmbuffer.daemon.state import DaemonState, Deferred, Frames, Reply
from shmbuffer.errors import InvalidArgumentError, LimitExceededError, SchemaError
from shmbuffer.storage import rows
from shmbuffer.storage.schema import Field
from shmbuffer.storage.stamps import stamp_reservation
from shmbuffer.wire.protocol import decode_i64, encode_i64, payload_sizes


class RewriteOps(DaemonState):
    def op_rewrite(
        self, client: Client, fields: dict[str, Any], frames: Frames, now: float
    ) -> Reply:
        """Rows ``rows`` (i64) of columns ``keys`` (all: every stored column) set to the
        payload frames' rows, one frame per key; with ``generation`` (i64, one per row) a row
        whose stamp differs, or that holds no committed data, is skipped, not refused. The
        reply: ``written`` rows and the positions (in ``rows``) of those ``skipped``."""
        targets = decode_i64(fields["rows"])
        columns = self._rewritable(fields.get("keys"))
        self._check_payload(targets.size, columns, frames)
        capacity = self.container.capacity
        outside = (targets < 0) | (targets >= capacity)
        if outside.any():
            raise InvalidArgumentError(
                f"field 'rows': row {int(targets[outside][0])} is outside the buffer "
                f"(capacity {capacity})"
            )
        where = self.container.rows_index()
        keep = where.live(targets)
        if "generation" in fields:
            keep &= self.generations[targets] == decode_i64(fields["generation"])
        elif not keep.all():
            missing = targets[~keep]
            raise InvalidArgumentError(
                f"rows {missing[:8].tolist()} hold no committed data (never written, being "
                "written, or overwritten): only committed rows are rewritten"
            )
        skipped = np.flatnonzero(~keep)
        kept = targets[keep]
        if kept.size:
            self._rewrite(kept, keep, columns, frames, where, fields, now)
        return {"written": int(kept.size), "skipped": encode_i64(skipped)}, []

    def _rewrite(
        self,
        kept: np.ndarray,
        keep: np.ndarray,
        columns: list[Field],
        frames: Frames,
        where: Any,
        fields: dict[str, Any],
        now: float,
    ) -> None:
        deadline = now + fields.get("timeout_ms", 30_000) / 1000
        spans = where.episode_spans(kept, self.container.ring.tail)
        leased = len(self.leases) and self.leases.pinned(self._entries(where, kept, spans))
        if leased:
            raise Deferred(f"rows are leased by readers (episodes {leased[:5]})", deadline)
        self._save_for_checkpoint(_runs(np.unique(kept)), deadline)
        # A row named twice gets its last value (a device column's scatter would pick any).
        _, last = np.unique(kept[::-1], return_index=True)
        once = np.sort(kept.size - 1 - last)
        pick = np.flatnonzero(keep)[once]  # positions in the request's rows
        leaves = {}
        for f, frame in zip(columns, frames, strict=True):
            array = np.frombuffer(frame, dtype=np.uint8)
            leaves[f.key] = rows.from_bytes(array, f.dtype, (keep.size, *f.shape))[pick]
        kept = kept[once]
        assert self.segment is not None
        journal = self.journal
        self._journal_room(record_bytes(1 + 2 * len(spans)) + record_bytes(0))
        hold = self.spans.out.hold() if self.spans is not None else contextlib.nullcontext()
        with hold:
            if journal is not None:  # a crash before REWRITTEN: a resume evicts them
                journal.append_rewrite(spans)
            stamp_reservation(self.generations, spans)  # before a byte changes
            rows.scatter(self.segment.columns, self.segment.arrays, kept, leaves)
            if journal is not None:
                journal.append_rewrite(None)
        self.counters.rows_rewritten += int(kept.size)  # distinct rows

    @staticmethod
    def _entries(where: Any, kept: np.ndarray, spans: list[tuple[int, int]]) -> list[int]:
        """The registry ids of the episodes the rows lie in: each row's entry, and where the
        ring's end split an episode in two, the other part (it holds a span's first row or
        its last)."""
        ends = np.array([[s, e - 1] for s, e in spans], dtype=np.int64).reshape(-1)
        rows = np.concatenate([kept, ends[where.live(ends)]])
        return [int(i) for i in np.unique(where.ids(rows))]

    def _rewritable(self, keys: list[str] | None) -> list[Field]:
        """The stored columns ``keys`` names (all of them if None), SchemaError naming any
        that is unknown, repeated, compressed or stores nothing."""
        schema = self.schema
        if schema is None:
            raise SchemaError("the buffer has no schema yet: nothing to rewrite")
        stored = {".".join(f.key): f for f in schema.fields}
        names = list(stored) if keys is None else keys
        if len(set(names)) != len(names):
            raise SchemaError(f"field 'keys' names a key twice: {names}")
        out = []
        for name in names:
            if not isinstance(name, str) or name not in stored:
                nexts = {".".join(k) for k in schema.next_of}
                why = "stores nothing (a next_of column)" if name in nexts else "is not stored"
                raise SchemaError(f"key {name!r} {why}: rewritable keys are {list(stored)}")
            field = stored[name]
            if field.compress is not None:
                raise SchemaError(
                    f"key {name!r} is stored compressed (one chunk per episode): its rows "
                    "cannot be rewritten in place"
                )
            out.append(field)
        return out

    def _check_payload(self, num_rows: int, columns: list[Field], frames: Frames) -> None:
        limit = self.config.max_payload_bytes
        size = max(payload_sizes(frames), num_rows * sum(f.row_nbytes for f in columns))
        if size > limit:
            raise LimitExceededError(
                f"op 'rewrite': a payload of {size:,} bytes ({num_rows:,} rows) exceeds the "
                f"limit max_payload_bytes={limit:,}; rewrite fewer rows per call"
            )
        if len(frames) != len(columns):
            raise SchemaError(
                f"expected {len(columns)} payload frames (one per key: "
                f"{['.'.join(f.key) for f in columns]}), got {len(frames)}"
            )
        for f, frame in zip(columns, frames, strict=True):
            if len(frame) != num_rows * f.row_nbytes:
                raise SchemaError(
                    f"key {'.'.join(f.key)!r}: payload of {len(frame)} bytes, expected "
                    f"{num_rows * f.row_nbytes} ({num_rows} rows of {f.dtype} {list(f.shape)})"
                )


def _runs(rows: np.ndarray) -> list[tuple[int, int]]:
    """Sorted distinct ``rows`` as ``[start, stop)`` runs of consecutive rows."""
    if not rows.size:
        return []
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate([rows[:1], rows[breaks]])
    stops = np.concatenate([rows[breaks - 1] + 1, rows[-1:] + 1])
    return list(zip(starts.tolist(), stops.tolist(), strict=True))
