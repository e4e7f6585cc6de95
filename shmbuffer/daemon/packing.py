"""The daemon's side of compressed columns: where each reservation's chunks go in the byte
store (``bytes.bin`` beside the rows), and nothing else.

The daemon stays a control plane: a writer compresses its episodes, sends each chunk's size
with its ``reserve`` (``chunks``), and copies the chunks into ``bytes.bin`` at the offsets the
reply gives (``offsets``), then the rows' chunk references, then commits; a reader copies the
chunks its rows name and decompresses them. What the daemon keeps is the byte ring
(:class:`~shmbuffer.ring.packing.ByteRing`, a listener of the ring, as in process): a
reserve's bytes are planned before its rows (:meth:`DaemonBytes.plan`), the live episodes
whose chunks the bytes overwrite are evicted by the ring with the rows it evicts anyway
(``Ring.plan(evict_too=)``, so leases hold them and readers' stamps cover them), and a run
that would overwrite the chunks of a reservation still copying waits for it, as rows do.

The rows of an episode evicted for its bytes get their stamps moved before the reply hands
out the offsets (:meth:`DaemonBytes.reserve`): a reader that copied such a chunk while the new
writer overwrote it fails its stamp check. An aborted reservation publishes nothing it
evicted again (the writer may have copied chunks over their bytes before it failed).

Called with the daemon loop's state, like every op; never blocks.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from shmbuffer.errors import InvalidArgumentError, SchemaError
from shmbuffer.ring.container import Container, Plan, Reservation
from shmbuffer.ring.packing import ByteRing
from shmbuffer.storage import packed
from shmbuffer.storage.schema import Schema, key_str
from shmbuffer.wire.protocol import decode_i64

#: What a reserve's byte plan hands to its reservation: the run's first byte, each chunk's
#: size (``[episodes, columns]``) and the rows evicted for the bytes.
BytePlan = tuple[int, np.ndarray, list[tuple[int, int]]]


def packed_names(schema: Schema) -> str:
    return ", ".join(repr(key_str(f.key)) for f in packed.packed_fields(schema))


class DaemonBytes:
    """A daemon's byte store (its file) and byte ring for ``schema``'s compressed columns."""

    def __init__(self, schema: Schema, container: Container, folder: Any, nbytes: int | None):
        self.fields = packed.packed_fields(schema)
        self.names = names = packed_names(schema)
        if container.unit != "episode":
            raise SchemaError(
                f"column {names} is stored compressed, one chunk per episode, which needs "
                f"--unit episode (this buffer's unit is {container.unit!r})"
            )
        if nbytes is None:
            raise SchemaError(
                f"column {names} is stored compressed: start the daemon with "
                "--compressed-bytes N (the size of the byte store its chunks live in)"
            )
        path = folder / packed.STORE_FILE
        with open(path, "wb") as f:  # sparse: pages are taken as writers fill them
            f.truncate(nbytes)
        os.chmod(path, os.stat(folder / "data.bin").st_mode & 0o777)
        self.nbytes = nbytes
        self.raw_row = sum(f.raw_nbytes for f in self.fields)
        self.ring = ByteRing(nbytes)
        container.ring.listen(self.ring)

    def check(self, fields: dict[str, Any], lengths: list[int]) -> np.ndarray:
        """A reserve's ``chunks``: one size per episode and compressed column, episode-major;
        InvalidArgumentError naming the field where it is missing or does not fit."""
        names = self.names
        if fields.get("ahead") or fields.get("count", 1) > 1:
            raise InvalidArgumentError(
                f"field 'ahead': column {names} is stored compressed; its rows are reserved "
                "once the write's chunks are known, never ahead"
            )
        if "chunks" not in fields:
            raise InvalidArgumentError(
                f"field 'chunks': column {names} is stored compressed, so a reserve carries "
                "each episode's chunk sizes (a Writer of protocol 1.10 sends them)"
            )
        sizes = decode_i64(fields["chunks"])
        want = len(lengths) * len(self.fields)
        if sizes.size != want or (sizes.size and int(sizes.min()) < 1):
            raise InvalidArgumentError(
                f"field 'chunks': {sizes.size} sizes, expected {want} positive ones (one per "
                f"episode and compressed column {names}, episode-major)"
            )
        return sizes.reshape(len(lengths), len(self.fields))

    def plan(self, sizes: np.ndarray) -> tuple[BytePlan, list[object]]:
        """Where the chunks go, the rows evicted for them, and the reservations still copying
        chunks the run overwrites (CapacityError for a run larger than the store)."""
        start, evict, busy = self.ring.plan_run(int(sizes.sum()))
        return (start, sizes, evict), busy

    def with_busy(self, plan: Plan, busy: list[object], container: Container) -> Plan:
        """``plan`` with the reservations whose chunks its bytes would lap among its busy."""
        more = [container.reservations[r] for r in busy if r in container.reservations]
        more = [r for r in more if r not in plan.busy]
        return plan._replace(busy=[*plan.busy, *more]) if more else plan

    def reserve(
        self, reservation: Reservation, byte_plan: BytePlan, generations: np.ndarray
    ) -> list[int]:
        """Hand the run to ``reservation``; the stamps of the rows evicted for its bytes
        moved (before the reply, so before any byte is copied). Returns each chunk's
        offset, episode-major."""
        start, sizes, evict = byte_plan
        for first, end in evict:
            generations[first:end] += 1  # a stamp only grows (storage/stamps.py)
        offsets: list[int] = []
        chunks = {}
        offset = start
        for (ep_start, ep_end), row in zip(reservation.episodes, sizes, strict=True):
            begin = offset
            for size in row:
                offsets.append(offset)
                offset += int(size)
            chunks[ep_start] = (begin, offset, self.raw_row * (ep_end - ep_start), ep_end)
        self.ring.reserve(start, chunks, reservation.id)
        return offsets

    def abort(self, reservation_id: int) -> None:
        self.ring.abort(reservation_id)

    def stats(self) -> dict[str, Any]:
        """The byte store's size, the bytes its live chunks use, its fill and the ratio (raw
        bytes of the live episodes' compressed columns over their chunks' bytes)."""
        return {
            **self.ring.stats(),
            "columns": {key_str(f.key): f.compress for f in self.fields},
        }
