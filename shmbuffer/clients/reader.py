"""Readers: learner processes that sample a daemon's buffer.

The daemon picks the rows (one small reply: indices and generation stamps); the reader copies
them straight out of shared memory with one gather, then checks the stamps: rows a writer
started to overwrite in between are sampled again, so a copy is never torn. Episodes are
handed out as zero-copy views under a lease that keeps writers off them until released; the
reader renews it while the block is open (:mod:`shmbuffer.clients.leased`). A remote reader
(``remote=True``) receives the rows as frames instead.

The daemon's sampler decides what a sample gets (``--sampler``: uniform, prioritized,
without-replacement, fifo); ``sample(..., return_info=True)`` returns what prioritized replay
needs (index, generation stamp, probability, importance weight) for ``update_priorities``, and
``iterate`` walks every stored row once per pass, split across ranks. A FIFO or consume-once
sample waits in the daemon (``sample_timeout``) for data; such samples are never prefetched,
and their rows are leased until the copy is checked, since a writer waits to overwrite them.
"""

from __future__ import annotations

import contextlib
import math
import operator
import os
import time
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from shmbuffer import rows
from shmbuffer.clients.connection import Connection
from shmbuffer.clients.leased import ClientLease, EpisodeViews
from shmbuffer.clients.ticker import Ticker
from shmbuffer.cuda_segment import attach_segment
from shmbuffer.errors import (
    EmptyBufferError,
    InvalidArgumentError,
    NotFoundError,
    ShmBufferError,
    TornReadError,
    UnknownClientError,
)
from shmbuffer.protocol import MAX_UPDATES, decode_f64, decode_i64, encode_f64, encode_i64
from shmbuffer.samplers.base import check_beta, check_update
from shmbuffer.schema import Schema
from shmbuffer.segment import Segment

MAX_RESAMPLES = 8
#: The per-item arrays of a sample with ``info``, in the reply and in ``info``.
_INFO = ("index", "generation", "probability", "weight")
#: Samplers whose samples consume what they hand out (with any sampler: max_times_sampled):
#: a sample sent ahead would take data the learner never asked for, so none is.
CONSUMING_SAMPLERS = ("fifo", "without-replacement")


def _count(value: Any, name: str, lo: int = 1) -> int:
    """``value`` as a Python int (msgpack cannot send ``np.int64``); Buffer takes the same."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None
    if number < lo:
        raise InvalidArgumentError(f"{name} must be >= {lo}, got {number}")
    return number


def _beta(value: Any) -> float:
    try:
        return check_beta(value)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(str(exc)) from None


def _decode_item(name: str, data: bytes) -> np.ndarray:
    return decode_f64(data) if name in ("probability", "weight") else decode_i64(data)


def _slice_rows(starts: np.ndarray, length: int, lengths: np.ndarray | None) -> np.ndarray:
    """Physical rows of slices; past a padded slice's real ``lengths`` its first row again
    (what the daemon's stamps and payload hold there)."""
    if lengths is None:
        return rows.slice_rows(starts, length)
    offsets = np.arange(length, dtype=np.int64)
    real = offsets < lengths[:, None]
    return np.where(real, starts[:, None] + offsets, starts[:, None]).reshape(-1)


def _host(value: Any) -> Any:
    """A tensor (on any device, maybe needing grad) as a numpy array; others as given."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return value


def _check_update(
    index: Any, priority: Any, generation: Any, capacity: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``update_priorities``' arguments as int64 rows, float64 priorities and int64 stamps,
    checked as the daemon checks them (InvalidArgumentError naming what is wrong)."""
    try:
        physical, values = check_update(_host(index), _host(priority), capacity)
    except (TypeError, ValueError, IndexError) as exc:
        raise InvalidArgumentError(f"update_priorities: {exc}") from None
    if generation is None:
        return physical, values, None
    stamps = np.asarray(_host(generation))
    if stamps.shape != physical.shape or (stamps.dtype.kind not in "iu" and stamps.size):
        raise InvalidArgumentError(
            f"update_priorities: generation needs {physical.size} integer stamps (one per "
            f"index), got {stamps.dtype} {list(stamps.shape)}"
        )
    return physical, values, stamps.astype(np.int64, copy=False)


class Reader:
    """Samples the buffer served by a daemon.

    Args:
        target: a buffer name (found through its runtime file) or an endpoint.
        remote: receive rows over the socket instead of reading shared memory.
        timeout: seconds any single wait on the daemon may take.
        prefetch: request the indices of the next ``sample``/``sample_slices`` (same size)
            while the caller works on this one; never for a sampler whose samples consume
            what they hand out (``fifo``, ``without-replacement``, ``--max-times-sampled``).
        sample_timeout: seconds a sample may wait in the daemon for data to consume (a FIFO
            or consume-once sampler) or for the rate limiter, then WaitTimeoutError (None:
            ``timeout``).
        auto_renew: while a ``sample_episodes`` block is open, renew its lease from a thread
            every ``lease_ttl / 3`` seconds (the daemon's TTL, 30 s by default).
        max_lease_hold: seconds a lease is renewed automatically (None: as long as the block
            is open); past it the lease lapses after one more TTL, so a hung learner stalls
            writers for at most ``max_lease_hold + lease_ttl``. ``episodes.renew()`` still works.
        curve_server_key, curve_client_cert: CURVE keys for a daemon started with
            ``--curve-secret`` (see :class:`~shmbuffer.clients.connection.Connection`).
    """

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
    ) -> None:
        self.auto_renew = auto_renew
        self.max_lease_hold = max_lease_hold
        self._leases: dict[int, ClientLease] = {}  # of the sample_episodes blocks now open
        self._renewer: Ticker | None = None
        self._ahead: tuple[Any, int] | None = None  # (request, seq) of a sample sent ahead
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
        #: The daemon's sampler (a daemon before protocol 1.2 samples uniformly).
        self.sampler: str = self.conn.buffer.get("sampler", "uniform")
        self.consumes = (
            self.sampler in CONSUMING_SAMPLERS
            or self.conn.buffer.get("max_times_sampled") is not None
        )
        self.prefetch = prefetch and not self.consumes
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

    def _ready(self) -> Segment | None:
        """Attach once the buffer has a schema (a lazy schema appears with the first write)."""
        if self.schema is None:
            info = self.conn.call("stats")["stats"]
            if info["schema"] is None:
                return None
            self.schema = Schema.from_spec(info["schema"])
            if not self.remote:
                seg = info["segment"]
                # a CudaSegment for a --device cuda daemon; page-locked for --pin-memory
                self.segment = attach_segment(seg["name"], seg["storage_dir"], pin=True)
        return self.segment

    def _send_sample(self, fields: dict[str, Any]) -> int:
        if self._daemon_waits:
            fields = {**fields, "timeout_ms": min(int(self.sample_timeout * 1000), 3_600_000)}
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
        """Like :meth:`_sample`, but the reply was requested at the previous call (when it
        asked the same) and the next one is requested now: the round trip overlaps the
        learner's own work. Indices that went stale meanwhile are caught by the stamps."""
        if not self.prefetch:
            return self._sample(**fields)
        key = tuple(sorted(fields.items()))
        ahead, self._ahead = self._ahead, None
        reply = None
        if ahead is not None:
            try:
                got = self._wait_sample(ahead[1])
                reply = got if ahead[0] == key else None
            except EmptyBufferError:  # stale: the buffer may have filled since
                pass
        if reply is None:
            reply = self._sample(**fields)
        self._ahead = (key, self._send_sample(fields))
        return reply

    # -- transitions --------------------------------------------------------------------------

    def sample(
        self, batch_size: int, return_info: bool = False, beta: float | None = None
    ) -> TensorDict | tuple[TensorDict, dict[str, torch.Tensor]]:
        """``batch_size`` transitions drawn by the daemon's sampler (a copy).

        With ``return_info`` returns ``(batch, info)``: ``info["index"]`` (physical rows, for
        :meth:`update_priorities`), ``info["generation"]`` (each row's stamp when sampled),
        ``info["probability"]`` (float64) and ``info["weight"]`` (float32, the PER importance
        weight ``(N * P) ** -beta`` over its largest value; 1 unless prioritized), each
        ``[batch_size]``. ``beta`` overrides the importance exponent for this call. A FIFO or
        consume-once sampler (and the rate limiter) may hold the call in the daemon for up to
        ``sample_timeout`` seconds, then WaitTimeoutError."""
        fields = self._fields("rows", _count(batch_size, "batch_size"), return_info, beta)
        reply, frames = self._sample_ahead(**fields)
        items = self._items(reply, return_info, ())
        if self.remote:
            data = self._from_frames(frames, [fields["n"]])
        else:
            physical = decode_i64(reply["rows"])
            leases = [reply["lease"]] if "lease" in reply else []
            try:
                gens = decode_i64(reply["gens"])
                data = self._checked_gather(physical, gens, fields, 1, items, leases)
            finally:
                self._release_soon(leases)
        return (data, self._info(items)) if return_info else data

    def sample_slices(
        self,
        n: int,
        length: int,
        strict: bool = True,
        return_info: bool = False,
        beta: float | None = None,
    ) -> TensorDict | tuple[TensorDict, dict[str, torch.Tensor]]:
        """``[n, length]`` runs of consecutive rows, each inside one episode (a copy).

        ``strict=False`` admits episodes shorter than ``length`` too: their slice starts at
        their first row and is zero-padded, and a bool ``"mask"`` entry ``[n, length]`` is
        True on real rows (a prefix). ``return_info`` and ``beta`` as for :meth:`sample`, per
        slice (``index`` is its first row, whose priority it carries)."""
        if type(strict) is not bool:
            raise TypeError(f"strict must be True or False, got {strict!r}")
        self._ready()
        if not strict and self.schema is not None and any(f.key[0] == "mask" for f in self.schema):
            raise InvalidArgumentError(
                "sample_slices(strict=False) adds a 'mask' entry, but the schema has a key "
                "'mask' already"
            )
        fields = self._fields("slices", _count(n, "n"), return_info, beta)
        fields["length"] = length = _count(length, "length")
        if not strict:
            fields["strict"] = False
        reply, frames = self._sample_ahead(**fields)
        items = self._items(reply, return_info, () if strict else ("lengths",))
        if self.remote:
            data = self._from_frames(frames, [n * length])
        else:
            physical = _slice_rows(decode_i64(reply["starts"]), length, items.get("lengths"))
            leases = [reply["lease"]] if "lease" in reply else []
            try:
                gens = decode_i64(reply["gens"])
                data = self._checked_gather(physical, gens, fields, length, items, leases)
            finally:
                self._release_soon(leases)
        data = data.reshape(n, length)
        if not strict:
            mask = torch.from_numpy(np.arange(length) < items["lengths"][:, None])
            if self.segment is not None and self.segment.device != "cpu":
                mask = mask.to(self.segment.device)  # beside the rows it masks
            padding = ~mask
            if bool(padding.any()):  # padding rows repeat the first row: zero them
                for leaf in data.values(include_nested=True, leaves_only=True):
                    leaf[padding] = 0
            data.set("mask", mask)
        return (data, self._info(items)) if return_info else data

    def _fields(self, kind: str, n: int, info: bool, beta: float | None) -> dict[str, Any]:
        fields: dict[str, Any] = {"kind": kind, "n": n}
        if info:
            fields["info"] = True
        if beta is not None:
            fields["beta"] = _beta(beta)
        if self.consumes and not self.remote:
            # What a consume-once sampler hands out may be overwritten as soon as it is
            # consumed (a writer waits for exactly that): leased until this copy is checked,
            # else it would read as torn and be sampled again, losing the consumed rows.
            fields["lease"] = True
        return fields

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

    @staticmethod
    def _items(reply: dict[str, Any], info: bool, extra: tuple[str, ...]) -> dict[str, Any]:
        """The reply's per-item arrays (info and, for padded slices, lengths), writable: a
        resample patches the items it redoes into them."""
        names = (*(_INFO if info else ()), *extra)
        return {name: _decode_item(name, reply[name]) for name in names}

    @staticmethod
    def _info(items: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {
            "index": torch.from_numpy(items["index"]),
            "generation": torch.from_numpy(items["generation"]),
            "probability": torch.from_numpy(items["probability"]),
            "weight": torch.from_numpy(items["weight"]).to(torch.float32),
        }

    def _checked_gather(
        self,
        physical: np.ndarray,
        gens: np.ndarray,
        fields: dict[str, Any],
        group: int,
        items: dict[str, Any],
        leases: list[int],
    ) -> TensorDict:
        """Gather rows, then redo (with fresh samples) the groups whose stamps moved; the
        per-item ``items`` of the groups redone are patched with the fresh ones (and the
        leases of the fresh samples added to ``leases``).

        A group whose stamps still match after its copy was copied untorn, so only the groups
        just redone are checked again: rechecking all of them would blame rows that were
        overwritten after their (good) copy was taken.
        """
        assert self.segment is not None
        stamps = self.segment.generations
        data = rows.gather(self.segment.columns, physical, self.segment.arrays)
        if not (stamps[physical] != gens).any():  # the usual case, in one comparison
            return data
        todo = np.arange(len(physical) // group)
        for _ in range(MAX_RESAMPLES):
            where = rows.slice_rows(todo * group, group)
            moved = (stamps[physical[where]] != gens[where]).reshape(-1, group).any(axis=1)
            if not moved.any():
                return data
            todo = todo[moved]
            self.resamples += len(todo)
            reply, _ = self._sample(**{**fields, "n": len(todo)})
            if "lease" in reply:
                leases.append(reply["lease"])
            for name, values in items.items():
                values[todo] = _decode_item(name, reply[name])
            if fields["kind"] == "slices":
                lengths = items["lengths"][todo] if "lengths" in items else None
                fresh = _slice_rows(decode_i64(reply["starts"]), group, lengths)
            else:
                fresh = decode_i64(reply["rows"])
            where = rows.slice_rows(todo * group, group)
            physical[where], gens[where] = fresh, decode_i64(reply["gens"])
            data[torch.from_numpy(where)] = rows.gather(
                self.segment.columns, fresh, self.segment.arrays
            )
        raise TornReadError(f"rows kept being overwritten through {MAX_RESAMPLES} resamples")

    # -- priorities ---------------------------------------------------------------------------

    def update_priorities(
        self,
        index: Any,
        priority: Any,
        generation: Any = None,
    ) -> int:
        """Set new priorities for sampled rows (``info["index"]``); returns how many were
        applied. With ``generation`` (``info["generation"]``) rows overwritten since they were
        sampled are skipped and counted in ``stats()["priority_updates_stale"]``, never
        applied to the new data. Tensors (on any device), arrays and sequences are taken; a
        priority may be one number for all. Checked here first and again by the daemon: a bad
        index, priority or length raises InvalidArgumentError and applies nothing."""
        rows_, values, stamps = _check_update(index, priority, generation, self.capacity)
        seqs = []
        for first in range(0, rows_.size, MAX_UPDATES):  # the header bounds one request
            part = slice(first, first + MAX_UPDATES)
            fields: dict[str, Any] = {
                "index": encode_i64(rows_[part]),
                "priority": encode_f64(values[part]),
            }
            if stamps is not None:
                fields["generation"] = encode_i64(stamps[part])
            seqs.append(self.conn.send("update_priorities", **fields))
        updated, error = 0, None
        for seq in seqs:  # every reply taken, so none is left behind for a later call
            try:
                updated += int(self.conn.wait(seq)[0]["updated"])
            except ShmBufferError as exc:
                error = error or exc
        if error is not None:
            raise error
        return updated

    # -- every row, per rank ------------------------------------------------------------------

    def iterate(
        self,
        batch_size: int,
        shuffle: bool = True,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
        *,
        epoch: int | None = None,
    ) -> Iterator[TensorDict]:
        """Minibatches of ``batch_size`` rows covering this rank's share of every stored row
        once, PyTorch ``DistributedSampler``'s convention (as :meth:`Buffer.iterate`): ranks
        split the (shuffled) rows round robin; without ``drop_last`` the list is padded by
        wrapping around so every rank gets the same count (a few rows appear twice across
        ranks) and the last batch may be short; with it the tail is dropped.

        The daemon shuffles with its ``--seed`` and ``epoch`` (default: this reader's count
        of passes with this ``rank``/``world_size``), so every rank's k-th pass agrees. The
        rows are fixed when the call is made; a row a writer reaches before its batch is read
        raises TornReadError (do not write while iterating). Copies; the sampler and the rate
        limiter are not involved."""
        batch_size = _count(batch_size, "batch_size")
        rank, world_size = _count(rank, "rank", 0), _count(world_size, "world_size")
        if rank >= world_size:
            raise InvalidArgumentError(f"rank must be in [0, {world_size}), got {rank}")
        key = (rank, world_size)
        k = self._passes.get(key, 0) if epoch is None else _count(epoch, "epoch", 0)
        self._passes[key] = k + 1
        self._ready()
        reply = self.conn.call(
            "iterate",
            rank=rank,
            world_size=world_size,
            shuffle=bool(shuffle),
            drop_last=bool(drop_last),
            epoch=k,
        )
        physical, gens = decode_i64(reply["rows"]), decode_i64(reply["gens"])
        if self.schema is None and physical.size:
            self._ready()
        return self._batches(physical, gens, batch_size, drop_last)

    def _batches(
        self, physical: np.ndarray, gens: np.ndarray, batch_size: int, drop_last: bool
    ) -> Iterator[TensorDict]:
        stop = len(physical) - len(physical) % batch_size if drop_last else len(physical)
        for first in range(0, stop, batch_size):
            part = slice(first, first + batch_size)
            if self.remote:
                seq = self.conn.send(
                    "read", rows=encode_i64(physical[part]), gens=encode_i64(gens[part])
                )
                _, frames = self.conn.wait(seq)
                yield self._from_frames(frames, [len(physical[part])])
                continue
            assert self.segment is not None
            data = rows.gather(self.segment.columns, physical[part], self.segment.arrays)
            moved = self.segment.generations[physical[part]] != gens[part]
            if moved.any():
                raise TornReadError(
                    f"iterate: {int(moved.sum())} rows of this batch were overwritten since the "
                    f"pass began (row {int(physical[part][moved][0])}); do not write while "
                    "iterating"
                )
            yield data

    def _from_frames(
        self,
        frames: list[Any],
        batch_size: list[int],
        out: tuple[dict[Any, np.ndarray], dict[Any, torch.Tensor]] | None = None,
    ) -> TensorDict:
        """The rows of payload frames, copied into fresh tensors, or into ``out`` (the arrays
        and tensors :func:`rows.out_arrays` made of the caller's ``out``)."""
        assert self.schema is not None
        n = int(np.prod(batch_size))
        flat: dict[Any, Any] = {}
        for field, frame in zip(self.schema.fields, frames, strict=True):
            array = np.frombuffer(frame.buffer, dtype=np.uint8)
            shape = (n, *field.shape)
            if out is None:
                flat[field.key] = rows.from_bytes(array, field.dtype, shape, copy=True)
                continue
            # bfloat16 travels as raw 16-bit patterns: copied as such into out's uint16 view
            dtype = torch.uint16 if field.dtype == torch.bfloat16 else field.dtype
            np.copyto(out[0][field.key][:n], rows.from_bytes(array, dtype, shape))
            flat[field.key] = out[1][field.key][:n]
        return rows.nest(flat, [n]).reshape(*batch_size)

    # -- episodes ---------------------------------------------------------------------------

    @contextmanager
    def sample_episodes(
        self, n: int, out: TensorDict | Mapping[str, Any] | None = None
    ) -> Iterator[EpisodeViews]:
        """``n`` whole episodes drawn by the daemon's sampler, as a sequence of ``[length]``
        TensorDicts (:class:`~shmbuffer.clients.leased.EpisodeViews`: indexable, iterable,
        ``len``).

        Locally: zero-copy views of the shared rows, built when accessed, under a lease that
        keeps writers off them until the block exits, renewed while it is open (see
        ``auto_renew``). ``episodes.valid()`` says whether the lease still certainly holds;
        once it lapsed, building a view and the block's exit raise ``LeaseExpiredError``
        (data read from the views may have changed). Remotely: copies, always valid.

        ``out``: copies instead, into a preallocated TensorDict (or nested dict of tensors)
        reused across calls, as :meth:`Buffer.sample_episodes <shmbuffer.Buffer.sample_episodes>`
        takes it (each schema key a contiguous CPU tensor of the column's dtype, leading dims
        holding at least the rows drawn). Locally the episodes are copied under their lease,
        which is released before the block starts, so writers are never held back by it; the
        views are then of ``out`` and always valid. A key, dtype or shape that does not fit
        raises InvalidArgumentError naming it, before the request when the schema is known.

        At most ``2**20`` episodes a call (the protocol's bound on ``n``), holding at most
        ``max_payload_bytes / 16`` rows (2**27 by default); more is refused by the daemon.
        """
        n = _count(n, "n")
        self._ready()
        target = self._out_target(out)  # checked before anything is drawn, if possible
        if self.remote:
            reply, frames = self._sample(kind="episodes", n=n)
            lengths = decode_i64(reply["lengths"])
            total = int(lengths.sum())
            copy_to = None
            if out is not None:
                target = target or self._out_target(out)
                assert target is not None  # the reply brought the schema
                rows.check_out_rows(target[2], lengths)
                copy_to = target[:2]
            data = self._from_frames(frames, [total], copy_to)
            offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
            columns = {f.key: data[f.key] for f in self.schema.fields} if self.schema else {}
            yield EpisodeViews(columns, decode_i64(reply["ids"]), offsets, lengths)
            return
        sent = time.monotonic()
        reply, _ = self._sample(kind="episodes", n=n, lease=True)
        assert self.segment is not None
        ttl = float(self.conn.buffer.get("lease_ttl", 30.0))
        lease = ClientLease(int(reply["lease"]), n, ttl, sent)
        self._leases[lease.id] = lease
        ids, starts = decode_i64(reply["ids"]), decode_i64(reply["starts"])
        lengths = decode_i64(reply["lengths"])
        if out is not None:
            yield self._copy_episodes(lease, ids, starts, lengths, out, target)
            return
        views = EpisodeViews(self.segment.columns, ids, starts, lengths, lease, self.conn)
        try:
            self._start_renewer(ttl)
            if time.monotonic() - sent > ttl / 3:  # a slow reply: restart the clock now
                lease.renew(self.conn)
            yield views
        except BaseException:  # the block's own error wins; the lease just goes
            self._end_lease(lease, quiet=True)
            raise
        self._end_lease(lease, quiet=False)

    def _out_target(self, out: Any) -> rows.OutArrays | None:
        """``out`` checked against the schema (None when there is no ``out`` or no schema
        yet: then it is checked once the reply brought the schema)."""
        if out is None or self.schema is None:
            return None
        return rows.out_arrays(self.schema, out)

    def _copy_episodes(
        self,
        lease: ClientLease,
        ids: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        out: Any,
        target: rows.OutArrays | None,
    ) -> EpisodeViews:
        """Copy leased episodes into ``out`` and let the lease go: a lease that certainly held
        until the copy ended (:meth:`ClientLease.valid`) is released without waiting; else the
        release's answer decides, and LeaseExpiredError says the copy may be torn."""
        assert self.segment is not None
        try:
            target = target or self._out_target(out)
            assert target is not None  # the reply brought the schema
            arrays, flat, held = target
            rows.check_out_rows(held, lengths)
            physical = rows.episode_rows(starts, lengths)
            rows.gather_columns(self.segment.columns, physical, self.segment.arrays, out=arrays)
        except BaseException:
            self._end_lease(lease, quiet=True)
            raise
        if lease.valid():
            self._leases.pop(lease.id, None)
            lease.released = True
            self._release_soon([lease.id])
        else:
            self._end_lease(lease, quiet=False)
        offsets = (np.cumsum(lengths) - lengths).astype(np.int64)
        return EpisodeViews(flat, ids, offsets, lengths)

    def _end_lease(self, lease: ClientLease, quiet: bool) -> None:
        """Release the lease; unless ``quiet``, raise LeaseExpiredError if it had lapsed."""
        self._leases.pop(lease.id, None)
        if lease.released:
            return
        if self.segment is not None:  # GPU views: kernels queued on them run before it goes
            self.segment.settle()
        # Decided here and by this release only: a renewal racing with it fails because of it.
        lapsed = lease.lapsed
        try:
            self.conn.call("release", lease=lease.id)
        except (NotFoundError, UnknownClientError):  # the daemon dropped it before we released it
            lapsed = lease.lapsed = True
        except ShmBufferError:
            if not quiet:
                raise
        finally:
            lease.released = True
        if lapsed and not quiet:
            raise lease.expired_error()

    def _start_renewer(self, ttl: float) -> None:
        if self.auto_renew and self._renewer is None:
            renew = weakref.WeakMethod(self._renew_leases)
            self._renewer = Ticker(ttl / 3, renew, "shmbuffer-renew")

    def _renew_leases(self) -> None:
        """The renewer's tick: renew every open lease still within ``max_lease_hold``. A lease
        the daemon no longer holds is marked lapsed; a daemon that does not answer is left to
        the lease's own deadline (``valid()`` turns False by itself)."""
        now = time.monotonic()
        for lease in list(self._leases.values()):
            if lease.lapsed or lease.released:
                continue
            if self.max_lease_hold is not None and now - lease.opened >= self.max_lease_hold:
                continue
            try:
                lease.renew(self.conn)
            except ShmBufferError:  # lapsed (marked so), closed, or no answer: nothing to add
                if self.conn.closed:
                    return

    # -- info ---------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = self.conn.call("stats")["stats"]
        return stats

    def __len__(self) -> int:
        stats = self.stats()
        return int(stats["rows"] if stats["unit"] == "transition" else stats["episodes"])

    def close(self) -> None:
        """Disconnect (the daemon releases this reader's leases). Safe to call twice."""
        if self._renewer is not None:
            self._renewer.stop(timeout=self.conn.timeout)
            self._renewer = None
        for lease in self._leases.values():  # their views are no longer protected
            lease.released = True
        if self.segment is not None:
            self.segment.close()
            self.segment = None
        self.conn.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
