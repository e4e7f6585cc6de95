"""Readers: learner processes that sample a daemon's buffer.

The daemon picks the rows (one small reply: indices and generation stamps); the reader copies
them straight out of shared memory with one gather, then checks the stamps: rows a writer
started to overwrite in between are sampled again, so a copy is never torn. On a uniform table
the reader picks the rows of ``sample`` itself, over the live rows the daemon publishes, with
no round trip (:mod:`shmbuffer.clients.local_draws`), and checks them the same way. Episodes are
handed out as zero-copy views under a lease that keeps writers off them until released; the
reader renews it while the block is open (:mod:`shmbuffer.clients.leased`). A remote reader
(``remote=True``) receives the rows as frames instead.

The daemon's sampler decides what a sample gets (``--sampler``, any name of
``shmbuffer.samplers.SAMPLERS``); ``sample(..., return_info=True)`` returns what prioritized replay
needs (index, generation stamp, probability, importance weight) for ``update_priorities``, and
``iterate`` walks every stored row once per pass, split across ranks. A FIFO or consume-once
sample waits in the daemon (``sample_timeout``) for data; such samples are never prefetched,
and their rows are leased until the copy is checked, since a writer waits to overwrite them.

:class:`Reader` is its jobs together over one shared state, as the daemon's service and the
container are: :mod:`shmbuffer.clients.readerstate` holds the connection, attaching, the
sample round trips and ``read`` (rows by physical index); this module transitions, slices,
priorities and ``iterate``; :mod:`shmbuffer.clients.episode_reads` whole episodes under
leases. Every name importers used from here is still here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from shmbuffer.api.reads import (
    as_count,
    check_iterate_args,
    check_mask_free,
    check_sample_args,
    check_slice_args,
    check_update_args,
    check_where,
    expand_slices,
    mask_slices,
    slice_mask,
)
from shmbuffer.clients.episode_reads import EpisodeReads
from shmbuffer.clients.framereads import sample_frames
from shmbuffer.clients.her_reads import sample_her
from shmbuffer.clients.leased import ClientLease, EpisodeViews
from shmbuffer.clients.nstep_reads import Follow, n_step_spec, window_follow
from shmbuffer.clients.readerstate import CONSUMING_SAMPLERS
from shmbuffer.errors import InvalidArgumentError, ShmBufferError, TornReadError
from shmbuffer.wire.protocol import (
    MAX_EPISODE_ROWS,
    MAX_UPDATES,
    decode_f64,
    decode_i64,
    encode_f64,
    encode_i64,
)

if TYPE_CHECKING:  # both imported by the first call that touches rows (readerstate.py says why)
    import torch
    from tensordict import TensorDict

    from shmbuffer.api.metadata import EpisodeRecords

__all__ = ["CONSUMING_SAMPLERS", "MAX_RESAMPLES", "ClientLease", "EpisodeViews", "Reader"]

MAX_RESAMPLES = 8
#: Of those, how many a reader that drew a sample's rows itself draws again itself before it
#: asks the daemon for a leased redraw (see ``Reader._checked_gather``).
LOCAL_REDRAWS = 4
#: A reader's own draw of ``n`` rows, counted for its next report: ``(rows, stamps, live
#: rows)``, or None where it cannot draw now.
Redraw = Callable[[int], "tuple[np.ndarray, np.ndarray, int] | None"]
#: The per-item arrays of a sample with ``info``, in the reply and in ``info``.
_INFO = ("index", "generation", "probability", "weight")


#: How a query's columns arrive as numpy arrays, by kind (a missing value filled, masked).
_DTYPE = {"int": np.int64, "float": np.float64, "bool": np.bool_}
_FILL: dict[str | None, Any] = {"int": 0, "float": 0.0, "bool": False, "str": ""}


def _decode_item(name: str, data: bytes) -> np.ndarray:
    return decode_f64(data) if name in ("probability", "weight") else decode_i64(data)


class Reader(EpisodeReads):
    """Samples the buffer served by a daemon.

    Args:
        target: a buffer name (found through its runtime file) or an endpoint.
        remote: receive rows over the socket instead of reading shared memory.
        timeout: seconds any single wait on the daemon may take.
        prefetch: request the indices of the next ``sample``/``sample_slices`` (same size)
            while the caller works on this one; never for a sampler whose samples consume
            what they hand out (``fifo``, ``without-replacement``, ``--max-times-sampled``).
            An int ``k``: one request draws the next ``k`` batches, handed out one per call
            (the daemon wakes once per ``k``: a learner of small batches spends half the CPU
            at ``k=4``); they were drawn up to ``2k - 1`` calls earlier, so priority updates
            reach the draws that late, and a rate limiter counts the ``k`` at once. A batch
            found overwritten before its copy (writers lapping the ring within a few
            batches) drops the rest and fetches one batch at a time for a while. ``True`` is
            ``1``; a remote reader fetches one batch ahead.
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
        local_draws: draw the rows of ``sample`` in this process, without a round trip,
            where the daemon says a reader may (a CPU buffer with the uniform sampler,
            without ``max_times_sampled``, under no rate limiter or a min-size one that is
            met): the same draw, the same stamp checks; the daemon hears what was drawn in
            bulk (:mod:`shmbuffer.clients.local_draws`). ``prefetch`` then does not matter
            for ``sample``. False: every sample asks the daemon.
        table: the daemon's table to read (``start --table``; None: the default one): every
            sample draws from it, :meth:`update_priorities` sets its priorities, and whether
            samples consume (so are never fetched ahead) is its sampler's word. A reader of a
            table other than the default one draws through the daemon (the runs published
            for local draws are the default table's). A name the daemon has not is refused
            (InvalidArgumentError) naming the tables it has.

    Beside sampling, :meth:`read` copies rows named by physical index, checked against their
    stamps, and :meth:`committed_rows` lists every committed row with its stamp (what the
    TorchRL storage reads through).
    """

    # -- transitions --------------------------------------------------------------------------

    def sample(
        self,
        batch_size: int,
        return_info: bool = False,
        beta: float | None = None,
        where: str | None = None,
        her: dict[str, Any] | None = None,
        n_step: int | None = None,
        gamma: float = 0.99,
        n_step_keys: Mapping[str, str | Sequence[str] | None] | None = None,
    ) -> TensorDict | tuple[TensorDict, dict[str, torch.Tensor]]:
        """``batch_size`` transitions drawn by the daemon's sampler (a copy).

        With ``return_info`` returns ``(batch, info)``: ``info["index"]`` (physical rows, for
        :meth:`update_priorities`), ``info["generation"]`` (each row's stamp when sampled),
        ``info["probability"]`` (float64) and ``info["weight"]`` (float32, the PER importance
        weight ``(N * P) ** -beta`` over its largest value; 1 unless prioritized), each
        ``[batch_size]``. ``beta`` overrides the importance exponent for this call. A FIFO or
        consume-once sampler (and the rate limiter) may hold the call in the daemon for up to
        ``sample_timeout`` seconds, then WaitTimeoutError. ``where``: rows only of the
        episodes this metadata filter selects (:meth:`episodes`), drawn by the daemon. ``her``:
        a share of the rows relabelled with goals achieved in their episodes, drawn by the
        daemon (``docs/sampling.md``, :mod:`shmbuffer.clients.her_reads`). ``n_step``: n-step
        returns, with ``gamma`` and ``n_step_keys``, as :meth:`Buffer.sample`
        (``docs/sampling.md``); drawn by the daemon, which says where each row lies in its
        episode, the rows after it checked against its stamp
        (:mod:`shmbuffer.clients.nstep_reads`)."""
        n = check_sample_args(batch_size, beta)
        if her is not None:
            if n_step is not None:  # refused as Buffer.sample refuses it, in its words
                from shmbuffer.api.her import check_her

                check_her(her, None, n_step)
            return sample_her(self, n, her, return_info, beta, where)
        spec = None if n_step is None else n_step_spec(self, n_step, gamma, n_step_keys)
        fields = self._fields("rows", n, return_info, beta, where)
        if self.schema is None:
            self._ready()  # attached once there is a schema: its stacks decide the path
        if self.schema is not None and self.schema.has_frames:
            if n_step is not None:  # not with stacks yet: refused, now that the schema is known
                n_step_spec(self, n_step, gamma, n_step_keys)
            return sample_frames(self, fields, return_info)  # clients/framereads.py
        if spec is not None:
            fields["context"] = True
        drawn = None if where is not None or spec is not None else self._draw_locally(n)
        if drawn is not None:
            return self._sample_drawn(drawn, fields, return_info)
        reply, frames = self._sample_ahead(**fields)
        items = self._items(reply, return_info, ())
        if self.remote:
            data = self._from_frames(frames, [fields["n"]])
        else:
            physical = decode_i64(reply["rows"])
            leases = [reply["lease"]] if "lease" in reply else []
            try:
                gens = decode_i64(reply["gens"])
                follow = None
                if spec is not None:  # the schema is known now, even if it was not at first
                    spec = n_step_spec(self, n_step, gamma, n_step_keys)
                    items["left"] = decode_i64(reply["left"])  # a redraw patches it too
                    assert self.segment is not None
                    follow = window_follow(self.segment, physical, items["left"], spec)
                data = self._checked_gather(physical, gens, fields, 1, items, leases, follow=follow)
            finally:
                self._release_soon(leases)
        return (data, self._info(items)) if return_info else data

    def _sample_drawn(
        self, drawn: tuple[np.ndarray, np.ndarray, int], fields: dict[str, Any], info: bool
    ) -> TensorDict | tuple[TensorDict, dict[str, torch.Tensor]]:
        """The rows this reader drew itself, gathered and checked like the daemon's: rows
        whose stamps moved before the copy was done are redrawn by the daemon, leased."""
        physical, gens, live = drawn
        items: dict[str, Any] = {}
        if info:  # a uniform draw's: P = 1 / live rows, weight 1
            n = physical.size
            items = {
                "index": physical.copy(),
                "generation": gens.copy(),
                "probability": np.full(n, 1.0 / live),
                "weight": np.ones(n),
            }
        assert self._draws is not None
        self._draws.count(physical, gens)  # before the gather: a redraw counts its own
        leases: list[int] = []
        try:
            data = self._checked_gather(
                physical, gens, fields, 1, items, leases, self._draws.redraw
            )
        finally:
            if leases:
                self._release_soon(leases)
        return (data, self._info(items)) if info else data

    def sample_slices(
        self,
        n: int,
        length: int,
        strict: bool = True,
        return_info: bool = False,
        beta: float | None = None,
        where: str | None = None,
    ) -> TensorDict | tuple[TensorDict, dict[str, torch.Tensor]]:
        """``[n, length]`` runs of consecutive rows, each inside one episode (a copy).

        ``strict=False`` admits episodes shorter than ``length`` too: their slice starts at
        their first row and is zero-padded, and a bool ``"mask"`` entry ``[n, length]`` is
        True on real rows (a prefix). ``return_info`` and ``beta`` as for :meth:`sample`, per
        slice (``index`` is its first row, whose priority it carries). ``where`` as for
        :meth:`sample`."""
        n, length = check_slice_args(n, length, strict, beta)
        self._ready()
        check_mask_free(self.schema, strict)
        fields = self._fields("slices", n, return_info, beta, where)
        fields["length"] = length
        if not strict:
            fields["strict"] = False
        reply, frames = self._sample_ahead(**fields)
        items = self._items(reply, return_info, () if strict else ("lengths",))
        if self.remote:
            data = self._from_frames(frames, [n * length])
        else:
            physical, _ = expand_slices(decode_i64(reply["starts"]), length, items.get("lengths"))
            leases = [reply["lease"]] if "lease" in reply else []
            try:
                gens = decode_i64(reply["gens"])
                data = self._checked_gather(physical, gens, fields, length, items, leases)
            finally:
                self._release_soon(leases)
        data = data.reshape(n, length)
        if not strict:  # the lengths of the slices handed out, resampled ones included
            device = None if self.segment is None else self.segment.device
            mask_slices(data, slice_mask(items["lengths"], length), device)
        return (data, self._info(items)) if return_info else data

    def _fields(
        self, kind: str, n: int, info: bool, beta: float | None, where: str | None = None
    ) -> dict[str, Any]:
        fields: dict[str, Any] = {"kind": kind, "n": n}
        if where is not None:
            fields["where"] = check_where(where)
        if info:
            fields["info"] = True
        if beta is not None:
            fields["beta"] = float(beta)  # checked by the caller; a plain float for msgpack
        if self.consumes and not self.remote:
            # What a consume-once sampler hands out may be overwritten as soon as it is
            # consumed (a writer waits for exactly that): leased until this copy is checked,
            # else it would read as torn and be sampled again, losing the consumed rows.
            fields["lease"] = True
        return fields

    @staticmethod
    def _items(reply: dict[str, Any], info: bool, extra: tuple[str, ...]) -> dict[str, Any]:
        """The reply's per-item arrays (info and, for padded slices, lengths), writable: a
        resample patches the items it redoes into them."""
        names = (*(_INFO if info else ()), *extra)
        return {name: _decode_item(name, reply[name]) for name in names}

    def _info(self, items: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The info handed out with a sample; its rows and stamps are remembered for an
        update sent back without them (:mod:`shmbuffer.api.recent`)."""
        import torch

        self._recent.remember(items["index"], items["generation"])
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
        redraw: Redraw | None = None,
        follow: Follow | None = None,
    ) -> TensorDict:
        """Gather rows, then redo (with fresh samples) the groups whose stamps moved; the
        per-item ``items`` of the groups redone are patched with the fresh ones (and the
        leases of the fresh samples added to ``leases``).

        A group whose stamps still match after its copy was copied untorn, so only the groups
        just redone are checked again: rechecking all of them would blame rows that were
        overwritten after their (good) copy was taken. A redraw by the daemon is leased: rows
        lapped once are on a ring that a writer laps faster than this copy, where an unleased
        redraw can be lapped again and again (a fast machine did 8 in a row); a lease holds
        the writer back for one short copy and the redraw cannot be torn. Rows this reader
        drew itself (``redraw``: its own draw of ``n`` rows, or None) are first drawn again
        here, :data:`LOCAL_REDRAWS` times at most: the same uniform draw over the rows live
        now, with no message, and no lease holding writers back. A batch of large rows on a
        small ring that writers lap quickly has a few rows overwritten during nearly every
        gather, and a round trip and a lease for each such batch made the daemon, and the
        writers it held back, the bottleneck (``docs/architecture.md``); a redraw of a few
        rows is copied in a fraction of the batch's time, so it is rarely lapped again.
        ``follow`` (rows only): what the sample reads past each drawn row, copied after it and
        checked with it, so an item is redone where either moved
        (:mod:`shmbuffer.clients.nstep_reads`).
        """
        from shmbuffer.storage import rows  # imported by the attach: a lookup

        assert self.segment is not None
        stamps = self.segment.generations
        data = self._gather(physical)  # with compressed columns' chunks: clients/packed_io
        reach = None if follow is None else follow(data, np.arange(len(physical)))
        if not (stamps[physical] != gens).any() and (
            reach is None or not (stamps[reach] != gens[:, None]).any()
        ):  # the usual case, in one comparison (two with what it follows)
            return self._expanded(data)
        import torch

        self._went_stale()
        todo = np.arange(len(physical) // group)
        for attempt in range(MAX_RESAMPLES):
            where = rows.slice_rows(todo * group, group)
            moved = (stamps[physical[where]] != gens[where]).reshape(-1, group).any(axis=1)
            if reach is not None:
                moved |= (stamps[reach[todo]] != gens[todo, None]).any(axis=1)
            if not moved.any():
                return self._expanded(data)
            todo = todo[moved]
            self.resamples += len(todo)
            mine = redraw(len(todo)) if redraw is not None and attempt < LOCAL_REDRAWS else None
            if mine is not None:  # rows only (group 1): drawn here again, as at first
                fresh, fresh_gens, live = mine
                self.local_redraws += len(todo)
                patch = {"index": fresh, "generation": fresh_gens, "probability": 1.0 / live}
                for name, values in items.items():
                    if name in patch:  # a uniform draw's weight stays 1
                        values[todo] = patch[name]
            else:
                reply, _ = self._sample(**{**fields, "n": len(todo), "lease": True})
                if "lease" in reply:
                    leases.append(reply["lease"])
                for name, values in items.items():
                    values[todo] = _decode_item(name, reply[name])
                if fields["kind"] == "slices":
                    lengths = items["lengths"][todo] if "lengths" in items else None
                    fresh, _ = expand_slices(decode_i64(reply["starts"]), group, lengths)
                else:
                    fresh = decode_i64(reply["rows"])
                fresh_gens = decode_i64(reply["gens"])
            where = rows.slice_rows(todo * group, group)
            physical[where], gens[where] = fresh, fresh_gens
            data[torch.from_numpy(where)] = self._gather(fresh, where)
            if reach is not None and follow is not None:
                reach[todo] = follow(data, todo)
        raise TornReadError(f"rows kept being overwritten through {MAX_RESAMPLES} resamples")

    # -- priorities ---------------------------------------------------------------------------

    def update_priorities(
        self,
        index: Any,
        priority: Any,
        generation: Any = None,
    ) -> int:
        """Set new priorities for sampled rows (``info["index"]``); returns how many were
        applied. Rows overwritten since they were sampled are skipped and counted in
        ``stats()["priority_updates_stale"]``, never applied to the new data: their stamps are
        ``generation`` (``info["generation"]``) or, left out, those of the one of this
        reader's last 8 samples whose ``info["index"]`` is ``index``, element for element
        (:mod:`shmbuffer.api.recent`); any other rows are updated whatever they hold now. Tensors
        (on any device), arrays and sequences are taken; a priority may be one number for
        all. Checked here first and again by the daemon: a bad index, priority or length
        raises InvalidArgumentError and applies nothing."""
        rows_, values, stamps = check_update_args(index, priority, generation, self.capacity)
        if stamps is None:
            stamps = self._recent.generations_of(rows_)
        seqs = []
        for first in range(0, rows_.size, MAX_UPDATES):  # the header bounds one request
            part = slice(first, first + MAX_UPDATES)
            fields: dict[str, Any] = {
                "index": encode_i64(rows_[part]),
                "priority": encode_f64(values[part]),
            }
            if stamps is not None:
                fields["generation"] = encode_i64(stamps[part])
            if self.table is not None:
                fields["table"] = self.table
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
        batch_size, rank, world_size = check_iterate_args(batch_size, rank, world_size)
        key = (rank, world_size)
        k = self._passes.get(key, 0) if epoch is None else as_count(epoch, "epoch", 0)
        self._passes[key] = k + 1
        physical, gens = self._pass_rows(rank, world_size, bool(shuffle), bool(drop_last), k)
        return self._batches(physical, gens, batch_size, drop_last)

    def committed_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Every committed row and its generation stamp, ``(rows, generations)`` as int64
        arrays in physical order: one ``iterate`` request (16 bytes a row), not a pass of
        :meth:`iterate` (it counts for no epoch). :meth:`read` takes them back: a row whose
        stamp moved since was reached by a writer."""
        return self._pass_rows(0, 1, False, False, 0)

    def _pass_rows(
        self, rank: int, world_size: int, shuffle: bool, drop_last: bool, epoch: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """The daemon's list of one pass's rows for ``rank`` and their stamps."""
        self._ready()
        fields: dict[str, Any] = {"rank": rank, "world_size": world_size, "epoch": epoch}
        if self.table is not None:  # whose use counts the pass raises
            fields["table"] = self.table
        reply = self.conn.call("iterate", shuffle=shuffle, drop_last=drop_last, **fields)
        physical, gens = decode_i64(reply["rows"]), decode_i64(reply["gens"])
        if self.schema is None and physical.size:
            self._ready()
        return physical, gens

    def _batches(
        self, physical: np.ndarray, gens: np.ndarray, batch_size: int, drop_last: bool
    ) -> Iterator[TensorDict]:
        stop = len(physical) - len(physical) % batch_size if drop_last else len(physical)
        for first in range(0, stop, batch_size):
            part = slice(first, first + batch_size)
            # remotely the daemon refuses a torn batch itself (TornReadError from read)
            data, moved = self.read(physical[part], gens[part])
            if moved.any():
                raise TornReadError(
                    f"iterate: {int(moved.sum())} rows of this batch were overwritten since the "
                    f"pass began (row {int(physical[part][moved][0])}); do not write while "
                    "iterating"
                )
            yield data

    # -- info ---------------------------------------------------------------------------------

    def episodes(
        self, where: str | None = None, order_by: str | None = None, limit: int | None = None
    ) -> EpisodeRecords:
        """The live episodes ``where`` selects (None: all), ordered by ``order_by`` (a name,
        ``"-name"`` descending; None: oldest first), at most ``limit``, with their metadata:
        ``ids`` and per name a masked array (``docs/metadata.md``). QueryError with the
        position for a filter that does not parse."""
        from shmbuffer.api.metadata import EpisodeRecords

        fields: dict[str, Any] = {}
        if where is not None:
            fields["where"] = check_where(where)
        if order_by is not None:
            fields["order_by"] = check_where(order_by, "order_by")
        if limit is not None:
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
                raise InvalidArgumentError(f"limit must be an int >= 0, got {limit!r}")
            fields["limit"] = min(limit, MAX_EPISODE_ROWS)
        reply = self.conn.call("episodes", **fields)
        ids = decode_i64(reply["ids"])
        columns = {"id": np.ma.MaskedArray(ids, mask=np.zeros(len(ids), dtype=bool))}
        for name, values in reply["columns"].items():
            missing = np.array([v is None for v in values], dtype=bool)
            kind = reply["kinds"].get(name)
            filled = [_FILL.get(kind, 0) if v is None else v for v in values]
            data = np.array(filled, dtype=object if kind == "str" else _DTYPE.get(kind))
            columns[name] = np.ma.MaskedArray(data, mask=missing)
        return EpisodeRecords(ids, columns)

    def stats(self) -> dict[str, Any]:
        self._report_draws()  # what this reader drew itself, counted before the figures
        stats: dict[str, Any] = self.conn.call("stats")["stats"]
        if self.packed is not None and "compressed" in stats:  # this reader's own cost
            stats["compressed"].update(self.packed.stats())
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
        if self._draws is not None:  # counted before the goodbye, if the daemon still answers
            with contextlib.suppress(ShmBufferError, OSError):
                self._draws.report()
            self._draws.close()
            self._draws = None
        if self.segment is not None:
            self.segment.close()
            self.segment = None
        self.conn.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
