"""What a :class:`~shmbuffer.clients.reader.Reader`'s jobs share, and the round trips they all
make: the connection and the reader's settings, attaching to the segment once the buffer has a
schema, sending a sample (ahead of time with ``prefetch``) and taking its reply, releasing the
leases of consumed copies without waiting, and copying rows named by physical index
(:meth:`ReaderState.read`, and payload frames for a remote reader).

The reader is split by job the way the daemon's service and the container are, each a module
over this shared state: transitions, slices, priorities and ``iterate`` in
:mod:`shmbuffer.clients.reader` (which assembles :class:`Reader`), episodes under leases in
:mod:`shmbuffer.clients.episode_reads`.
"""

from __future__ import annotations

import contextlib
import math
import operator
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from shmbuffer.api.recent import RecentSamples
from shmbuffer.clients.connection import Connection
from shmbuffer.clients.leased import ClientLease
from shmbuffer.clients.local_draws import LocalDraws, open_local_draws
from shmbuffer.clients.ticker import Ticker
from shmbuffer.errors import (
    EmptyBufferError,
    InvalidArgumentError,
    NotFoundError,
    SchemaError,
    UnknownClientError,
)
from shmbuffer.samplers import SAMPLERS
from shmbuffer.storage import streamcopy
from shmbuffer.storage.indices import to_host
from shmbuffer.wire.protocol import MAX_SAMPLE, MAX_SAMPLE_ROWS, encode_i64

if TYPE_CHECKING:
    # Imported by the first call that touches rows, not with the Reader: torch's import is
    # most of a fresh process's start-up (and tensordict's, which loads torch._dynamo, more),
    # and a Reader asked only ``stats()`` or ``len()`` needs neither (``bench/startup.py``).
    import torch
    from tensordict import TensorDict

    from shmbuffer.clients.packed_io import PackedReads
    from shmbuffer.storage.schema import Schema
    from shmbuffer.storage.segment import Segment

#: Samplers whose samples consume what they hand out, as they declare it (``Sampler.consumes``;
#: with any sampler: max_times_sampled): a sample sent ahead would take data the learner never
#: asked for, so none is. A daemon since protocol 1.7 says so itself (``buffer.consumes``).
CONSUMING_SAMPLERS = tuple(name for name, cls in SAMPLERS.items() if cls.consumes)


def table_info(buffer: dict[str, Any], table: str | None) -> dict[str, Any]:
    """What the ``hello`` reply's ``buffer`` says of ``table``: the buffer map itself for the
    default table (None, or the first listed), else its entry in ``buffer.tables`` (name,
    sampler, consumes, max_times_sampled). InvalidArgumentError naming the tables for a name
    the daemon has not, or a daemon before tables (protocol 1.9)."""
    if table is None:
        return buffer
    listed = buffer.get("tables")
    if listed is None:
        raise InvalidArgumentError(
            f"table={table!r}: this daemon has no tables (it predates protocol 1.9); leave "
            "table= out to read its one sampler"
        )
    for index, entry in enumerate(listed):
        if entry.get("name") == table:
            return buffer if index == 0 else dict(entry)
    names = ", ".join(str(entry.get("name")) for entry in listed)
    raise InvalidArgumentError(f"no table named {table!r}; the tables are {names}")


def consumes(buffer: dict[str, Any]) -> bool:
    """Whether the daemon of this ``hello`` reply's ``buffer`` hands out samples that consume:
    its own word, or for a daemon before protocol 1.7 its sampler's declaration by name."""
    said = buffer.get("consumes")
    if said is not None:
        return bool(said)
    name = buffer.get("sampler", "uniform")  # a daemon before 1.2 samples uniformly
    return name in CONSUMING_SAMPLERS or buffer.get("max_times_sampled") is not None


#: The per-item arrays of a sample's reply, which :func:`split_reply` cuts into batches.
_ITEM_ARRAYS = (
    *("rows", "starts", "lengths", "gens", "index", "generation", "probability", "weight"),
    *("before", "left"),  # a sample's context (since 1.10)
)
#: Calls that fetch one batch at a time after a prefetched batch had rows overwritten before
#: its copy (a ring that writers lap within a few batches): those would be redrawn, one round
#: trip each. With a writer lapping an image ring several times a second, learners with
#: prefetch sampled far fewer rows without this (figures in ``docs/architecture.md``).
STALE_BACKOFF = 32


def prefetch_depth(value: Any) -> int:
    """A Reader's ``prefetch`` as the number of batches one request fetches: False 0 (none),
    True 1, an int ``k >= 0`` itself."""
    if isinstance(value, bool):
        return int(value)
    try:
        depth = operator.index(value)
    except TypeError:
        raise TypeError(f"prefetch must be a bool or an int >= 0, got {value!r}") from None
    if depth < 0:
        raise ValueError(f"prefetch must be a bool or an int >= 0, got {depth}")
    return depth


def split_reply(reply: tuple[dict[str, Any], Any], parts: int) -> list[Any]:
    """The reply of one sample of ``parts`` equal batches as one reply per batch: each
    per-item array cut in ``parts`` equal pieces (zero-copy views; ``gens`` of slices holds
    one stamp per row, ``length`` per slice, so it is cut the same way)."""
    header, frames = reply
    if parts == 1:
        return [reply]
    out = []
    for i in range(parts):
        part = dict(header)
        for name in _ITEM_ARRAYS:
            if name in header:
                data = memoryview(header[name])
                size = len(data) // parts
                part[name] = data[i * size : (i + 1) * size]
        out.append((part, frames))
    return out


def _row_numbers(value: Any, name: str, size: int | None = None) -> np.ndarray:
    """``value`` (tensor, array, sequence) as a 1-D int64 array, else InvalidArgumentError."""
    array = np.asarray(to_host(value))
    if array.ndim != 1 or (array.dtype.kind not in "iu" and array.size):
        raise InvalidArgumentError(
            f"read: {name} must be a 1-D sequence of integers, got {array.dtype} "
            f"{list(array.shape)}"
        )
    if size is not None and array.size != size:
        raise InvalidArgumentError(
            f"read: generations needs one stamp per row ({size}), got {array.size}"
        )
    return array.astype(np.int64, copy=False)


class ReaderState:
    """The fields and round trips a Reader's jobs share (the arguments are
    :class:`~shmbuffer.clients.reader.Reader`'s, documented there)."""

    def __init__(
        self,
        target: str = "default",
        *,
        remote: bool | None = None,
        timeout: float = 10.0,
        prefetch: bool = True,
        sample_timeout: float | None = None,
        curve_server_key: str | bytes | os.PathLike[str] | None = None,
        curve_client_cert: str | os.PathLike[str] | None = None,
        auto_renew: bool = True,
        max_lease_hold: float | None = 600.0,
        local_draws: bool = True,
        table: str | None = None,
    ) -> None:
        depth = prefetch_depth(prefetch)  # before connecting: a bad value opens nothing
        if table is not None and not isinstance(table, str):
            raise InvalidArgumentError(f"table must be a table's name (a str), got {table!r}")
        self.auto_renew = auto_renew
        self.max_lease_hold = max_lease_hold
        self._leases: dict[int, ClientLease] = {}  # of the sample_episodes blocks now open
        self._renewer: Ticker | None = None
        self._ahead: tuple[Any, int] | None = None  # (request, seq) of a sample sent ahead
        #: Batches of the last prefetched reply not handed out yet, and the request they fit.
        self._parts: list[tuple[dict[str, Any], Any]] = []
        self._parts_key: Any = None
        self._fresh_only = 0  # calls left that fetch one batch (see STALE_BACKOFF)
        self._recent = RecentSamples()  # stamps for updates sent back without generation=
        self.conn = Connection(
            target,
            "reader",
            timeout=timeout,
            remote=remote,
            curve_server_key=curve_server_key,
            curve_client_cert=curve_client_cert,
        )
        self.remote = self.conn.remote
        self.capacity: int = self.conn.buffer["capacity"]
        self.unit: str = self.conn.buffer["unit"]
        try:
            own = table_info(self.conn.buffer, table)
        except BaseException:
            self.conn.close()
            raise
        #: The table this reader reads (None: the default one), named in every request that
        #: draws, counts or sets priorities.
        self.table = table
        #: Its sampler (a daemon before protocol 1.2 samples uniformly).
        self.sampler: str = own.get("sampler", "uniform")
        self.consumes = consumes(own)
        #: Batches one sample request fetches ahead (0: none); a remote reader's come as
        #: frames, one batch at a time.
        self.prefetch = 0 if self.consumes else min(depth, 1) if self.remote else depth
        #: Seconds a sample may wait in the daemon (may be changed between calls).
        self.sample_timeout = timeout if sample_timeout is None else float(sample_timeout)
        if not math.isfinite(self.sample_timeout) or self.sample_timeout < 0:
            raise ValueError(f"sample_timeout must be >= 0 seconds, got {sample_timeout!r}")
        # A daemon before 1.2 (no sampler in its hello) never holds a sample and does not
        # know the timeout_ms field.
        self._daemon_waits = "sampler" in self.conn.buffer
        self._passes: dict[tuple[int, int], int] = {}  # iterate's pass count per rank
        self._releasing: list[int] = []  # seqs of lease releases whose replies are not taken
        self.schema: Schema | None = None
        self.segment: Segment | None = None
        self.resamples = 0  # rows sampled again because a writer overwrote them mid-copy
        self.local_redraws = 0  # of those, rows this reader drew again itself
        #: Where the daemon publishes its live runs (None: it does not, or not for us).
        self._local_info: dict[str, Any] | None = None
        self._her_rng: Any = None  # relabelled samples' goal draws (her_reads.py)
        # The runs a daemon publishes are the default table's draws (its limiter and use
        # counts): a reader of another table draws through the daemon.
        if local_draws and not self.remote and own is self.conn.buffer:
            self._local_info = self.conn.buffer.get("local_draws")
        self._draws: LocalDraws | None = None  # this reader's own draws, once attached
        #: The compressed columns' chunks (None: the schema has none).
        self.packed: PackedReads | None = None

    # -- attaching ----------------------------------------------------------------------------

    def _ready(self) -> Segment | None:
        """Attach once the buffer has a schema (a lazy schema appears with the first write)."""
        if self.schema is None:
            info = self.conn.call("stats")["stats"]
            if info["schema"] is None:
                return None
            from shmbuffer.clients.packed_io import PackedReads, refuse_remote
            from shmbuffer.storage.cuda_segment import attach_segment
            from shmbuffer.storage.packed import packed_fields
            from shmbuffer.storage.schema import Schema

            schema = Schema.from_spec(info["schema"])
            if self.remote:
                refuse_remote(schema, "reader")
            self.schema = schema
            if not self.remote:
                seg = info["segment"]
                # a CudaSegment for a --device cuda daemon; page-locked for --pin-memory
                self.segment = attach_segment(seg["name"], seg["storage_dir"], pin=True)
                if packed_fields(schema):  # compressed columns: clients/packed_io.py
                    self.packed = PackedReads(schema, Path(seg["path"]))
                if self.segment.device == "cpu":  # large rows: gathers stream (rows.py)
                    streamcopy.warm(self.schema.row_nbytes)
                    if self._local_info is not None:
                        stamps = self.segment.generations
                        folder = Path(seg["path"])
                        self._draws = open_local_draws(self.conn, folder, stamps, self._local_info)
        return self.segment

    @property
    def local_draws(self) -> bool:
        """Whether this reader draws the rows of ``sample`` itself where the daemon says it
        may (:mod:`shmbuffer.clients.local_draws`); known once attached (the first sample)."""
        return self._draws is not None

    def _draw_locally(self, n: int) -> tuple[np.ndarray, np.ndarray, int] | None:
        """``n`` rows drawn by this reader, their stamps and the live rows; None: ask the
        daemon."""
        draws = self._draws
        if draws is None:
            if self.schema is not None or self._local_info is None:
                return None
            self._ready()  # the first sample attaches
            draws = self._draws
            if draws is None:
                return None
        self.conn.check()  # closed, or used in a forked child: refused as by the daemon path
        return draws.draw(n)

    def _report_draws(self) -> None:
        """Send what this reader drew itself, so that its next request sees it counted."""
        if self._draws is not None:
            self._draws.report()

    def attach(self) -> Schema | None:
        """The buffer's schema, asked for (and, locally, its segment mapped) the first time
        it is known; None while a buffer with a lazy schema has had no write yet."""
        self._ready()
        return self.schema

    # -- sample round trips -------------------------------------------------------------------

    def _send_sample(self, fields: dict[str, Any]) -> int:
        self._report_draws()
        if self._daemon_waits:
            fields = {**fields, "timeout_ms": min(int(self.sample_timeout * 1000), 3_600_000)}
        if self.table is not None:
            fields = {**fields, "table": self.table}
        return self.conn.send("sample", payload=self.remote, **fields)

    def _wait_sample(self, seq: int) -> tuple[dict[str, Any], Any]:
        # The daemon may hold the sample for up to sample_timeout (FIFO, rate limiter); the
        # connection pings it meanwhile, so a dead daemon is still reported within timeout.
        reply = self.conn.wait(seq, timeout=self.sample_timeout + self.conn.timeout)
        if self.schema is None:  # the data that let it through came with the first schema
            self._ready()
        return reply

    def _sample(self, **fields: Any) -> tuple[dict[str, Any], Any]:
        self._ready()
        return self._wait_sample(self._send_sample(fields))

    def _sample_ahead(self, **fields: Any) -> tuple[dict[str, Any], Any]:
        """Like :meth:`_sample`, but requested ahead: with ``prefetch=k`` one request draws
        ``k`` batches like this one, handed out one per call, and the next ``k`` are asked for
        when the first of these is: the round trip overlaps the learner's own work, and the
        daemon wakes once per ``k`` batches. A call that asks something else drops what was
        fetched. Indices that went stale meanwhile are caught by the stamps."""
        if not self.prefetch:
            return self._sample(**fields)
        key = tuple(sorted(fields.items()))
        if self._parts and self._parts_key == key:
            return self._parts.pop(0)
        depth = self.prefetch if self._fits(fields, self.prefetch) else 1
        if self._fresh_only:
            self._fresh_only -= 1
            depth = 1
        group = {**fields, "n": fields["n"] * depth}
        reply = self._take_ahead((key, depth))
        if reply is None:
            reply = self._sample(**group)
        self._parts = split_reply(reply, depth)
        self._parts_key = key
        self._ahead = ((key, depth), self._send_sample(group))
        return self._parts.pop(0)

    def _fits(self, fields: dict[str, Any], depth: int) -> bool:
        """Whether ``depth`` batches like ``fields`` fit one request: every limit a single
        batch is held to (items, rows, the daemon's reply of an index and a stamp per row),
        so prefetching never turns a call that is allowed alone into one that is refused."""
        n = int(fields["n"]) * depth
        rows = n * int(fields.get("length", 1))
        payload = int(self.conn.buffer.get("max_payload_bytes", MAX_SAMPLE_ROWS * 16))
        return n <= MAX_SAMPLE and rows <= min(MAX_SAMPLE_ROWS, payload // 16)

    def _went_stale(self) -> None:
        """A batch had rows overwritten before its copy: what else was fetched with it is
        older still, so it is dropped, and the next calls fetch one batch at a time."""
        if self.prefetch > 1:
            self._parts = []
            self._fresh_only = STALE_BACKOFF

    def _take_ahead(self, key: Any) -> tuple[dict[str, Any], Any] | None:
        """The reply of the sample sent ahead if it asked ``key``; None otherwise."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        try:
            reply = self._wait_sample(ahead[1])
        except EmptyBufferError:  # stale: the buffer may have filled since
            return None
        return reply if ahead[0] == key else None

    def _release_soon(self, leases: list[int]) -> None:
        """Release the leases of a copy that is done without waiting for the replies (they
        are taken at a later call); the writer they hold back goes on at once."""
        self._collect_releases()
        for lease in leases:
            self._releasing.append(self.conn.send("release", lease=lease))

    def _collect_releases(self) -> None:
        still = []
        for seq in self._releasing:
            if not self.conn.ready(seq):
                still.append(seq)
                continue
            with contextlib.suppress(NotFoundError, UnknownClientError):  # lapsed, or forgotten
                self.conn.wait(seq)
        self._releasing = still

    # -- rows by physical index ---------------------------------------------------------------

    def read(self, rows: Any, generations: Any) -> tuple[TensorDict, np.ndarray]:
        """A copy of the physical rows ``rows``, checked against the generation stamps
        ``generations`` they were listed with, one per row (``Reader.committed_rows()``, a sample's
        ``info["generation"]``).

        Returns ``(data, moved)``: ``data`` a ``[len(rows)]`` TensorDict, ``moved`` a bool
        array, True where a writer reached the row since its stamp was taken: that row of
        ``data`` may be torn (copy it again, with its new stamp); the others are whole.
        Locally the rows are gathered from shared memory and only those that moved are
        flagged; remotely the daemon refuses a read with any moved row whole
        (TornReadError), so ``moved`` is all False. A row out of range or stamps that do not
        fit raise InvalidArgumentError naming them; a buffer with no schema yet, SchemaError.
        """
        physical = _row_numbers(rows, "rows")
        stamps = _row_numbers(generations, "generations", physical.size)
        outside = (physical < 0) | (physical >= self.capacity)
        if outside.any():
            raise InvalidArgumentError(
                f"read: row {int(physical[outside][0])} of rows is out of range for a buffer "
                f"of capacity {self.capacity}"
            )
        segment = self._ready()
        if self.schema is None:
            raise SchemaError("the buffer has no schema yet: nothing to read")
        if segment is None:  # remote: the daemon copies, and checks the stamps itself
            seq = self.conn.send("read", rows=encode_i64(physical), gens=encode_i64(stamps))
            _, frames = self.conn.wait(seq)
            return self._from_frames(frames, [physical.size]), np.zeros(physical.size, bool)
        from shmbuffer.storage import rows as row_copies  # ``rows`` is the argument here

        data = row_copies.gather(segment.columns, physical, segment.arrays)
        if self.packed is None:
            # A reservation bumps a row's stamp before its writer may touch the row.
            return data, segment.generations[physical] != stamps
        self.packed.begin()
        self.packed.fetch(data)  # the chunks before the stamps, decompressed after
        moved = segment.generations[physical] != stamps
        return self.packed.expand(data, skip=moved), moved

    def _gather(self, physical: np.ndarray, at: np.ndarray | None = None) -> TensorDict:
        """The rows ``physical`` copied (into the read's places ``at``), and the chunks of
        their compressed columns with them (:meth:`_expanded` decompresses them once the
        rows passed their stamp check)."""
        from shmbuffer.storage import rows

        assert self.segment is not None
        data = rows.gather(self.segment.columns, physical, self.segment.arrays)
        if self.packed is not None:
            if at is None:
                self.packed.begin()
            self.packed.fetch(data, at)
        return data

    def _expanded(self, data: TensorDict) -> TensorDict:
        return data if self.packed is None else self.packed.expand(data)

    def _from_frames(
        self,
        frames: list[Any],
        batch_size: list[int],
        out: tuple[dict[Any, np.ndarray], dict[Any, torch.Tensor]] | None = None,
    ) -> TensorDict:
        """The rows of payload frames, copied into fresh tensors, or into ``out`` (the arrays
        and tensors :func:`rows.out_arrays` made of the caller's ``out``)."""
        import torch

        from shmbuffer.storage.rows import from_bytes, nest

        assert self.schema is not None
        n = int(np.prod(batch_size))
        flat: dict[Any, Any] = {}
        for field, frame in zip(self.schema.fields, frames, strict=True):
            array = np.frombuffer(frame.buffer, dtype=np.uint8)
            shape = (n, *field.shape)
            if out is None:
                flat[field.key] = from_bytes(array, field.dtype, shape, copy=True)
                continue
            # bfloat16 travels as raw 16-bit patterns: copied as such into out's uint16 view
            dtype = torch.uint16 if field.dtype == torch.bfloat16 else field.dtype
            np.copyto(out[0][field.key][:n], from_bytes(array, dtype, shape))
            flat[field.key] = out[1][field.key][:n]
        return nest(flat, [n]).reshape(*batch_size)
