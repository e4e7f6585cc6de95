"""The byte store of compressed columns as a second ring beside the rows, and the one rule
that keeps the two in step: an episode is live only while both its rows and its chunk are.

Capacity is counted twice: in rows (the ring) and in the byte store's bytes
(:class:`ByteRing`). Both are written first-in first-out in the same order (episode unit:
each reservation's episodes follow the previous ones in the rows and in the bytes), so the
episodes whose chunks a new write needs are the oldest live ones. The byte ring names their
rows before the reservation is planned (:meth:`ByteRing.plan`), and the ring evicts them with
the rows it evicts anyway (``Ring.plan(evict_too=)``): one eviction, heard by every table,
sampler and the byte ring itself (a :class:`RingListener`, which drops an episode's chunk when
its rows go). A reader's stamp check then covers the bytes too. Bytes can be reused before
the rows are (a run of long or badly compressing episodes), so :meth:`Packer.write` also moves
the stamps of the rows of every episode evicted for its bytes before it copies a byte: a copy
of a chunk that was being overwritten fails its rows' stamp check.

Called from the ring's owner only (the in-process Buffer), like every listener.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from shmbuffer.api.writeplan import WritePlan
from shmbuffer.errors import CapacityError, InvalidArgumentError
from shmbuffer.registry.intervals import Episode
from shmbuffer.ring.listeners import F64, Range, RingListener
from shmbuffer.ring.members import Members
from shmbuffer.ring.ring import Reservation, Ring, episode_lengths
from shmbuffer.storage import packed
from shmbuffer.storage.rows import numpy_dtype
from shmbuffer.storage.schema import Field, Key, Schema, key_str

if TYPE_CHECKING:  # the daemon plans bytes with ByteRing and never imports tensordict
    from tensordict import TensorDict

#: An episode's chunks in the store: (first byte, end byte, raw bytes, end row).
Chunk = tuple[int, int, int, int]


class ByteRing(RingListener):
    """``capacity`` bytes handed out in order, a chunk run per reservation, wrapping early
    to byte 0 when a run does not fit before the end (the skipped tail's chunks are evicted
    too, as the rows' early wrap in episode unit). Knows each live episode's chunks by its
    first row."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.pointer = 0
        self._live: dict[int, Chunk] = {}
        #: Reserved, not committed yet, by first row.
        self._pending: dict[int, Chunk] = {}
        #: The reservation each pending chunk run belongs to (a daemon's writers copy at once).
        self._owner: dict[int, object] = {}
        #: Evicted by a reservation still open: what an abort may publish again.
        self._gone: dict[int, Chunk] = {}
        self.stored = 0  # bytes of live chunks
        self.raw = 0  # the same rows' bytes uncompressed

    def plan(self, nbytes: int) -> tuple[int, list[Range]]:
        """Where a run of ``nbytes`` would go and the rows of the live episodes whose chunks
        it would overwrite (oldest first), changing nothing. CapacityError if it can never
        fit."""
        start, rows, _ = self.plan_run(nbytes)
        return start, rows

    def plan_run(self, nbytes: int) -> tuple[int, list[Range], list[object]]:
        """:meth:`plan`, and the owners of the reservations whose chunks, reserved and not
        committed yet, the run would overwrite: writers still copying, which it must wait
        for (as the rows' ``Plan.busy``)."""
        if nbytes > self.capacity:
            raise CapacityError(
                f"{nbytes} compressed bytes do not fit a byte store of {self.capacity} "
                "(compressed_bytes): raise it, or write shorter episodes"
            )
        start = self.pointer if self.pointer + nbytes <= self.capacity else 0
        taken = [(start, start + nbytes)]
        if start == 0 and self.pointer:
            taken.append((self.pointer, self.capacity))
        rows = [
            (first, chunk[3])
            for first, chunk in self._live.items()
            if any(chunk[0] < e and s < chunk[1] for s, e in taken)
        ]
        busy = {
            self._owner.get(first)
            for first, chunk in self._pending.items()
            if any(chunk[0] < e and s < chunk[1] for s, e in taken)
        }
        return start, rows, list(busy)

    def abort(self, owner: object) -> None:
        """Forget the chunks reserved for ``owner`` (its reservation was aborted)."""
        for first in [f for f, o in self._owner.items() if o == owner]:
            self._pending.pop(first, None)
            self._owner.pop(first)

    def reserve(self, start: int, chunks: Mapping[int, Chunk], owner: object = None) -> None:
        """Hand out the run from ``start`` to the episodes ``chunks`` (by first row), for
        the reservation ``owner``."""
        self._pending.update(chunks)
        self._owner.update(dict.fromkeys(chunks, owner))
        self.pointer = max((c[1] for c in chunks.values()), default=start)

    def on_commit(
        self,
        episodes: Sequence[Episode],
        ranges: Sequence[Range],
        priority: F64 | None,
        members: Members = None,
    ) -> None:
        for ep in episodes:
            chunk = self._pending.pop(ep.start, None)
            self._owner.pop(ep.start, None)
            if chunk is not None:
                self._live[ep.start] = chunk
                self.stored += chunk[1] - chunk[0]
                self.raw += chunk[2]
        if not self._pending:  # no open reservation left whose abort could restore them
            self._gone.clear()

    def on_evict(self, start: int, stop: int, evicted: Sequence[Episode], rows: int) -> None:
        for ep in evicted:
            chunk = self._live.pop(ep.start, None)
            if chunk is not None:
                self._gone[ep.start] = chunk
                self.stored -= chunk[1] - chunk[0]
                self.raw -= chunk[2]

    def on_restore(self, episodes: Sequence[Episode], rows: int) -> None:
        for ep in episodes:
            chunk = self._gone.pop(ep.start, None)
            if chunk is not None:
                self._live[ep.start] = chunk
                self.stored += chunk[1] - chunk[0]
                self.raw += chunk[2]

    def on_clear(self, rows: int) -> None:
        self._live.clear()
        self._gone.clear()
        self.stored = self.raw = 0
        if not self._pending:
            self.pointer = 0

    def on_load(self) -> None:
        # A saved ring state does not say where chunks lie: nothing is known live.
        self.on_clear(0)

    def stats(self) -> dict[str, Any]:
        return {
            "bytes": self.capacity,
            "used": self.stored,
            "fill": self.stored / self.capacity,
            "ratio": self.raw / self.stored if self.stored else None,
        }


@dataclass(frozen=True, slots=True)
class PackPlan:
    """A write's chunks, decided before its rows are planned (:meth:`Packer.plan`)."""

    packer: Packer
    #: Per episode, per compressed column (in :attr:`Packer.fields` order): its chunk.
    chunks: list[list[bytes]]
    lengths: list[int]
    start: int
    #: Rows of the live episodes whose chunks the run overwrites: the ring evicts them too.
    evict: list[Range]

    def write(
        self,
        reservation: Reservation,
        leaves: Mapping[Key, Any],
        generations: np.ndarray,
    ) -> dict[Key, Any]:
        """Copy the chunks into the store and return ``leaves`` with each compressed
        column replaced by its rows' chunk references. The rows of the episodes evicted for
        their bytes get their stamps moved first (up by one: a stamp only grows), so a reader
        copying one of their chunks while it is overwritten fails its stamp check."""
        packer = self.packer
        for first, end in self.evict:
            generations[first:end] += 1
        total = sum(self.lengths)
        first_row = len(next(iter(leaves.values()))) - total
        refs = {f.key: np.zeros((first_row + total, 3), np.int64) for f in packer.fields}
        offset, row, chunks = self.start, first_row, {}
        raw_row = sum(f.raw_nbytes for f in packer.fields)
        for (ep_start, _), length, per_field in zip(
            reservation.episodes, self.lengths, self.chunks, strict=False
        ):
            begin = offset
            for f, chunk in zip(packer.fields, per_field, strict=True):
                packer.store.write(offset, [chunk])
                ref = refs[f.key][row : row + length]
                ref[:, packed.OFFSET], ref[:, packed.LENGTH] = offset, len(chunk)
                ref[:, packed.ROW] = np.arange(length)
                offset += len(chunk)
            chunks[ep_start] = (begin, offset, raw_row * length, ep_start + length)
            row += length
        packer.bytes.reserve(self.start, chunks)
        return {**leaves, **refs}


class Packer:
    """A Buffer's compressed columns: compresses a write's episodes, places the chunks,
    turns the columns into chunk references for the rows, and expands them at reads."""

    def __init__(self, fields: list[Field], ring: Ring, store: packed.ByteStore) -> None:
        self.fields = fields
        self.codecs = {f.key: packed.codec(f) for f in fields}
        self.dtypes = {f.key: numpy_dtype(f.dtype) for f in fields}
        self.store = store
        self.bytes = ByteRing(store.nbytes)
        ring.listen(self.bytes)
        self.decompress_s = 0.0
        self.decompressed = 0  # bytes

    def plan(self, write: WritePlan) -> PackPlan:
        """``write``'s episodes compressed, and where their chunks go: before the ring plans
        its rows, which must evict what the chunks overwrite too (``PackPlan.evict``)."""
        _, leaves, first, num_rows, kept, _ = write
        lengths = episode_lengths(num_rows, kept)
        compressors = {key: codec[0] for key, codec in self.codecs.items()}
        chunks = packed.write_chunks(self.fields, compressors, leaves, first, lengths)
        start, evict = self.bytes.plan(sum(len(c) for cs in chunks for c in cs))
        return PackPlan(self, chunks, lengths, start, evict)

    def expand(self, data: TensorDict) -> TensorDict:
        """``data`` (gathered rows, any batch shape) with each compressed column's chunk
        references replaced by its rows, decompressed."""
        began = time.perf_counter()
        for f in self.fields:
            refs = data.get(f.key).numpy().reshape(-1, 3)
            fetched = packed.fetch(refs, self.store.array)
            _, decompress = self.codecs[f.key]
            values = packed.expand(f, decompress, refs, fetched, self.dtypes[f.key])
            self.decompressed += values.nbytes
            data.set(f.key, torch.from_numpy(values.reshape(*data.batch_size, *f.shape)))
        self.decompress_s += time.perf_counter() - began
        return data

    def stats(self) -> dict[str, Any]:
        return {
            **self.bytes.stats(),
            "columns": {key_str(f.key): f.compress for f in self.fields},
            "decompress_s": self.decompress_s,
            "decompressed_bytes": self.decompressed,
        }


def expanded(packer: Packer | None, data: Any) -> Any:
    """``data`` (a TensorDict or a list of them, as a read returns them) with the compressed
    columns expanded (:meth:`Packer.expand`); as it is without a packer."""
    if packer is None:
        return data
    return [packer.expand(d) for d in data] if type(data) is list else packer.expand(data)


def packer_for(
    schema: Schema, ring: Ring, nbytes: int | None, segment: object = None
) -> Packer | None:
    """The Packer a buffer of ``schema`` over ``ring`` needs (None: no compressed column),
    its byte store beside ``segment``'s rows (a file in its folder where it has one);
    InvalidArgumentError naming the column for what cannot be stored compressed."""
    fields = packed.packed_fields(schema)
    if not fields:
        if nbytes is not None:
            raise InvalidArgumentError(
                "compressed_bytes is the byte store of compressed columns, and the schema "
                "declares none (compress = 'zstd' on a column)"
            )
        return None
    names = ", ".join(repr(key_str(f.key)) for f in fields)
    if ring.unit != "episode":
        raise InvalidArgumentError(
            f"column {names} is stored compressed, one chunk per episode, which needs "
            f"unit='episode' (this buffer's unit is {ring.unit!r})"
        )
    if nbytes is None:
        raise InvalidArgumentError(
            f"column {names} is stored compressed: give compressed_bytes, the size of the "
            "byte store its chunks live in"
        )
    if any(f.dtype == torch.bfloat16 for f in fields):
        raise InvalidArgumentError(f"column {names}: bfloat16 columns are not compressed")
    folder = getattr(segment, "path", None)  # a named segment's folder; private: None
    return Packer(fields, ring, packed.ByteStore(nbytes, folder))
