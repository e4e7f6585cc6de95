"""The in-process buffer: the whole engine in one process, no daemon.

``Buffer`` is what a single-process user reaches for, and the reference semantics the daemon's
Writer and Reader share (``extend``, ``add_episode``, ``add_transition``, ``end_episode``;
``sample``, ``sample_episodes``, ``sample_slices``, logical indexing).

Rows live in private memory, or with a name in a named shared-memory segment. Reads return
copies a caller can keep while writes go on (zero-copy views under a lease are a Reader's).

Sampling runs the daemon's code (the container's samplers and limiters). One thing differs: in
one process nobody else can insert or sample while a call waits, so what the daemon would hold
back (a request its limiter refuses; a write over rows a FIFO table has not handed out) raises
:class:`~shmbuffer.errors.WaitTimeoutError` at once, naming why; nothing changed then.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from shmbuffer.api.episodes import DEFAULT_DONE_KEYS, EpisodeAssembler, FinishedEpisode
from shmbuffer.api.framegather import read_frames
from shmbuffer.api.her import check_her, her_batch
from shmbuffer.api.nstep import check_n_step, n_step_batch
from shmbuffer.api.passes import Passes, batches
from shmbuffer.api.reads import (
    Index,
    check_iterate_args,
    check_mask_free,
    mask_slices,
    normalize_index,
)
from shmbuffer.api.recent import RecentSamples
from shmbuffer.api.tables import built_tables, table_options
from shmbuffer.api.writeplan import plan_write, priority_for, vector_episode
from shmbuffer.errors import ClosedError
from shmbuffer.ring.container import Container
from shmbuffer.ring.members import Members
from shmbuffer.ring.meta import EpisodeMeta, EpisodeRecords
from shmbuffer.ring.packing import Packer, expanded, packer_for
from shmbuffer.samplers import LIMITER_OPTIONS, OPTIONS, RateLimiter, Sampler
from shmbuffer.samplers.base import Priority
from shmbuffer.storage import rows, streamcopy
from shmbuffer.storage.schema import Schema, to_host
from shmbuffer.storage.segment import LocalSegment, Segment
from shmbuffer.storage.stamps import stamp_reservation
from shmbuffer.wire.protocol import MAX_SAMPLE, check_sample_size

#: Scalars to attach to an episode (``{"return": 12.5, "env_id": "e3"}``), or None.
Meta = Mapping[str, Any] | None


class Buffer:
    """A replay/rollout buffer of ``capacity`` rows in this process.

    Args:
        capacity: rows the buffer holds.
        unit: ``"transition"`` (``len`` counts rows) or ``"episode"`` (``len`` counts episodes;
            whole episodes are evicted first-in first-out).
        mode: ``"circular"`` overwrites the oldest rows; ``"fixed"`` refuses writes once full.
        schema: a :class:`Schema`, a spec mapping (``{"obs": {"dtype": "uint8", "shape": [84]}}``)
            or None to take it from the first batch written.
        name: None for private memory, or the name of a shared-memory segment to create.
        num_envs: sub-envs per env id (an int for all, or a mapping), for vector envs.
        auto_truncate: end an env's episode when a done key is true on a transition.
        done_keys: the keys that end an episode (Gymnasium's by default).
        postprocess_fn: turns one finished episode's ``{key: [per-step values]}`` into rows.
        sampler: a ``--sampler`` name (``"uniform"``, the default; every name in
            ``shmbuffer.samplers.SAMPLERS``), or a :class:`~shmbuffer.samplers.Sampler` (then
            give its options to it).
        seed: seeds the sampler's random generator (and ``iterate``'s shuffles).
        priority_exponent, importance_exponent, priority_eps: prioritized replay's alpha
            (default 0.6), beta (default 0.4; per call too) and eps (default 1e-6).
        max_times_sampled: retire an item (row, or episode in episode unit) after this many
            samples; with ``"fifo"`` writes then refuse to overwrite unconsumed rows.
        rate_limiter: ``"none"`` (default), ``"min-size"`` or ``"sample-to-insert"``, or a
            :class:`~shmbuffer.samplers.RateLimiter`; ``min_size``, ``samples_per_insert``
            and ``error_buffer`` are its settings (counted in rows).
        meta: the metadata names episodes may carry, and their kinds (``{"return": "float",
            "env_id": "str"}``), or None to take them as given (``docs/metadata.md``).
        tables: several tables over the same rows, by name, each with the options above
            (``{"replay": {"sampler": "prioritized"}, "online": {"sampler": "fifo"}}``; the
            first is the default, ``table=`` names another: ``docs/tables.md``).
        compressed_bytes: the byte store's size for compressed columns (docs/compression.md).

    Options left None take the sampler's or limiter's default; one given that the chosen
    sampler or limiter does not take raises InvalidArgumentError naming it.
    """

    def __init__(
        self,
        capacity: int,
        *,
        unit: str = "transition",
        mode: str = "circular",
        schema: Schema | Mapping[str, Any] | None = None,
        name: str | None = None,
        storage_dir: str | Path | None = None,
        num_envs: int | Mapping[str, int] | None = None,
        auto_truncate: bool = True,
        done_keys: Sequence[str] = DEFAULT_DONE_KEYS,
        postprocess_fn: Callable[[dict[str, list[Any]]], Mapping[str, Any]] | None = None,
        sampler: str | Sampler = "uniform",
        seed: int | None = None,
        priority_exponent: float | None = None,
        importance_exponent: float | None = None,
        priority_eps: float | None = None,
        max_times_sampled: int | None = None,
        rate_limiter: str | RateLimiter = "none",
        min_size: int | None = None,
        samples_per_insert: float | None = None,
        error_buffer: float | None = None,
        meta: Mapping[str, str] | None = None,
        tables: Mapping[str, Mapping[str, Any]] | None = None,
        compressed_bytes: int | None = None,
    ) -> None:
        given = locals()  # the keywords of the options the samplers declare, by name
        options = {name: given[name] for name in (*(o.name for o in OPTIONS), *LIMITER_OPTIONS)}
        options = {"sampler": sampler, "rate_limiter": rate_limiter, **options}
        built = built_tables(table_options(tables, options))
        self.container = Container.of_tables(capacity, built, mode=mode, unit=unit, seed=seed)
        # The hot paths address the ring and its default table directly: a write or a sample
        # is a few microseconds of Python, where each delegation through the container shows.
        self._ring = self.container.ring
        self._table = self.container.table
        self.assembler = EpisodeAssembler(
            num_envs=num_envs,
            auto_truncate=auto_truncate,
            done_keys=done_keys,
            postprocess_fn=postprocess_fn,
        )
        self.name = name
        self._storage_dir, self._compressed_bytes = storage_dir, compressed_bytes
        self._packer: Packer | None = None  # compressed columns (ring/packing.py)
        self._passes = Passes(seed)  # iterate()'s shuffles: every rank's k-th pass agrees
        self.segment: Segment | LocalSegment | None = None
        self._closed = False
        self._recent = RecentSamples()  # stamps for updates sent back without generation=
        self._meta = self.container.bound_tables(tables, meta)  # from the start if bounds read it
        if schema is not None:
            self._allocate(schema if isinstance(schema, Schema) else Schema.from_spec(schema))

    # -- properties -------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._ring.capacity

    @property
    def unit(self) -> str:
        return self._ring.unit

    @property
    def mode(self) -> str:
        return self._ring.mode

    @property
    def schema(self) -> Schema | None:
        return None if self.segment is None else self.segment.schema

    @property
    def num_rows(self) -> int:
        return self.container.num_rows

    @property
    def num_episodes(self) -> int:
        return self.container.num_episodes

    @property
    def sampler(self) -> Sampler:
        return self.container.sampler

    @property
    def rate_limiter(self) -> RateLimiter:
        return self.container.rate_limiter

    @property
    def use_counts(self) -> np.ndarray:
        """Reads of each physical row since it was written (-1: holds no committed data)."""
        return self._table.use_counts

    def __len__(self) -> int:
        return len(self._ring)

    def __repr__(self) -> str:
        return (
            f"Buffer(capacity={self.capacity}, unit={self.unit!r}, mode={self.mode!r}, "
            f"rows={self.num_rows}, episodes={self.num_episodes}, schema={self.schema})"
        )

    # -- writing ----------------------------------------------------------------------------

    def extend(
        self,
        batch: Mapping[str, Any],
        priority: Priority = None,
        meta: Meta = None,
        tables: Sequence[str] | None = None,
    ) -> list[int]:
        """Write rows straight in: a chunk of transitions, or one whole episode in episode
        unit. Returns the ids of the (single) registry entry written.

        ``priority`` (prioritized sampler only): a scalar, one value per row (transition
        unit) or one for the episode (episode unit); None gives the largest priority seen so
        far. ``meta``: scalars to attach to the entry written (:meth:`episodes`). ``tables``:
        the tables it goes into (None: every one; ``docs/tables.md``). All checked before
        anything is written."""
        self._check_open()
        into = self.container.members(tables)
        return self._write(batch, priority=priority, meta=self._checked_meta(meta), into=into)

    def add_episode(
        self,
        episode: Mapping[str, Any],
        num_envs: int = 1,
        priority: Priority = None,
        meta: Meta = None,
        tables: Sequence[str] | None = None,
    ) -> list[int]:
        """Write a finished episode; with ``num_envs > 1`` its leaves are ``[L, num_envs, ...]``
        and each sub-env becomes its own episode. Returns the new episode ids.

        ``priority`` as for :meth:`extend`; with ``num_envs > 1`` one value per sub-episode
        (episode unit) or per row, shaped ``[L, num_envs]`` like the data (transition unit).
        ``meta``: scalars to attach to the episode (to each sub-episode), as :meth:`episodes`
        reads them. ``tables`` as for :meth:`extend`."""
        self._check_open()
        into = self.container.members(tables)
        checked = self._checked_meta(meta)
        if num_envs == 1:
            return self._write(episode, priority=priority, meta=checked, into=into)
        batch, priority = vector_episode(episode, num_envs, self.unit, priority)
        return self._write(batch, num_envs, priority, checked, into)

    def add_transition(
        self,
        env_id: str,
        transition: Mapping[str, Any],
        meta: Meta = None,
        tables: Sequence[str] | None = None,
    ) -> list[int]:
        """Append one step of ``env_id``; returns ids of episodes it finished (if any).
        ``meta`` is merged into the metadata of the episode in progress, attached when it
        ends (a later value of a name replaces an earlier one); ``tables``, where given, are
        the tables it goes into (the last given for it wins; never given: every table)."""
        self._check_open()
        self.container.members(tables)  # refused before the step is taken
        step = self.assembler.add_transition(env_id, transition, self._checked_meta(meta), tables)
        return self._write_finished(step)

    def end_episode(self, env_id: str) -> list[int]:
        """End ``env_id``'s pending episode now (a no-op when nothing is pending)."""
        self._check_open()
        return self._write_finished(self.assembler.end_episode(env_id))

    def truncate_episodes(self, env_ids: Iterable[str]) -> list[int]:
        return [i for env_id in env_ids for i in self.end_episode(env_id)]

    def _write_finished(self, finished: list[FinishedEpisode]) -> list[int]:
        into = self.container.members  # the tables last named for each, checked then
        return [
            i
            for e in finished
            for i in self._write(e.data, e.num_sub_episodes, None, e.meta, into(e.tables))
        ]

    def _write(
        self,
        batch: Mapping[str, Any],
        num_sub_episodes: int = 1,
        priority: Priority = None,
        meta: Mapping[str, Any] | None = None,
        into: Members = None,
    ) -> list[int]:
        # A lazy schema is fixed by the first batch accepted, never by one refused (a bad
        # batch, priority, or more rows than a fixed buffer holds): rows are reserved first.
        # ``into``: the tables the rows go into (Container.members; None: every one).
        segment, ring = self.segment, self._ring
        fixed = None if segment is None else segment.schema
        plan = plan_write(fixed, batch, num_sub_episodes, ring.capacity, ring.mode, ring.unit)
        if plan is None:
            return []
        schema, leaves, first_row, num_rows, kept, _ = plan
        container = self.container
        if priority is not None:  # checked before anything is evicted, as its table would
            sampler = container.priority_table(into).sampler
            priority = priority_for(priority, plan, self.unit, sampler)
        packing = None if self._packer is None else self._packer.plan(plan)  # its evictions too
        reservation = ring.reserve(
            ring.plan(num_rows, kept, into, packing.evict if packing else None)
        )
        if segment is None:
            try:
                self._allocate(schema)
            except BaseException:  # out of memory, say: as if the batch had never come
                container.abort(reservation.id, 0)
                raise
            segment = self.segment
            assert segment is not None
        stamp_reservation(segment.generations, reservation.ranges)  # storage/stamps.py
        if packing is not None:  # the compressed columns' rows hold chunk references
            leaves = packing.write(reservation, leaves, segment.generations)
        # Validation decided every cast, so only an interrupt or a device error fails the copy:
        # what the reservation evicted comes back wherever the copy had not reached.
        # (try/except, not rows.Progress's ``with``: an abort bound per write cost ~0.5 us.)
        progress = rows.Progress()
        try:
            rows.write(
                segment.columns, segment.arrays, reservation.ranges, leaves, first_row, progress
            )
        except BaseException:
            container.abort(reservation.id, progress.rows)
            raise
        if priority is None:  # what the container adds is the tables' priority checks
            ids = ring.commit(reservation.id)
        else:
            ids = container.commit(reservation.id, priority)
        if meta:
            assert self._meta is not None  # it checked them
            self._meta.attach(ids, meta)
        return ids

    def _allocate(self, schema: Schema) -> None:
        streamcopy.warm(schema.row_nbytes)  # large rows: writes stream (streamcopy.py)
        self._ring.tail = schema.tail  # a next_of column's tail rows (api/frames.py)
        if self.name is None:
            self.segment = LocalSegment(schema, self.capacity)
        else:
            self.segment = Segment.create(
                self.name, schema, self.capacity, storage_dir=self._storage_dir
            )
        self._packer = packer_for(schema, self._ring, self._compressed_bytes, self.segment)

    # -- reading ----------------------------------------------------------------------------

    def __getitem__(self, index: Index) -> TensorDict | list[TensorDict]:
        """Logical (chronological) indexing: 0 is the oldest, -1 the newest row or episode."""
        self._check_open()
        if isinstance(index, slice) and self.unit == "transition" and self.segment is not None:
            start, stop, step = index.indices(len(self))
            if step == 1 and stop - start > 1:
                # Fast path: one writer commits in ring order, so a logical range whose ends
                # are n-1 rows apart is one physical range (a gap or a wrap would break the
                # distance). Its ends are in range by construction.
                ends = np.array([start, stop - 1], dtype=np.int64)
                first, last = self._ring.registry.rows_at(ends, checked=True)
                if last - first == stop - start - 1:
                    self._table.use_counts[first : last + 1] += 1
                    columns, arrays = self.segment.columns, self.segment.arrays
                    return rows.copy_range(columns, int(first), int(last) + 1, arrays)
        positions, scalar = normalize_index(index, len(self))
        if self.unit == "episode":
            _, starts, ends = self._ring.registry.at_many(positions)
            return self._episodes(starts, ends, scalar)
        physical = self._ring.registry.rows_at(positions, checked=True)  # normalized
        data = self._read(physical)
        return data[0] if scalar else data

    def get_data(self) -> TensorDict | list[TensorDict]:
        """Everything stored, oldest first."""
        return self[:]

    def sample(
        self,
        batch_size: int,
        return_info: bool = False,
        beta: float | None = None,
        where: str | None = None,
        table: str | None = None,
        n_step: int | None = None,
        gamma: float = 0.99,
        n_step_keys: Mapping[str, str | Sequence[str] | None] | None = None,
        her: Mapping[str, Any] | None = None,
    ) -> TensorDict | tuple[TensorDict, dict[str, torch.Tensor]]:
        """``batch_size`` rows drawn by the sampler (uniform: from all committed rows, with
        replacement).

        With ``return_info`` returns ``(batch, info)``: ``info["index"]`` (physical rows, for
        :meth:`update_priorities`), ``info["generation"]`` (each row's stamp now),
        ``info["probability"]`` (float64) and ``info["weight"]`` (float32; the PER importance
        weight ``(N * P) ** -beta`` over its largest value, 1 unless prioritized), each
        ``[batch_size]``. ``beta`` overrides the importance exponent for this call. ``where``:
        only from the episodes this filter selects (:meth:`episodes`), as the table draws.
        ``table``: drawn by that table (``tables=``), not the default one. ``n_step``: n-step
        returns, with ``gamma``, ``n_step_keys``; ``her``: goals relabelled (docs/sampling.md)."""
        self._check_open()
        if type(batch_size) is int and batch_size > MAX_SAMPLE:  # named as the caller knows it
            check_sample_size(batch_size, what="batch_size")
        spec = None if n_step is None else check_n_step(n_step, gamma, n_step_keys, self.schema)
        relabel = None if her is None else check_her(her, self.schema, n_step)
        drawer = self._table if table is None else self.container.table_named(table)
        among = None if where is None else self._metadata().subset(where, drawer)
        drawn = drawer.sample_rows(batch_size, beta=beta, among=among)
        data = self._copy(drawn.rows)
        if spec is not None and self.segment is not None:
            _, left = self.container.extent(drawn.rows)
            n_step_batch(data, drawn.rows, self.segment.columns, left, spec)
        her_batch(data, drawn.rows, self.segment, self.container.extent, relabel, drawer.rng)
        info = self._info(drawn.rows, drawn.probability, drawn.weight) if return_info else None
        return data if info is None else (data, info)

    def update_priorities(
        self,
        index: np.ndarray | torch.Tensor | Sequence[int],
        priority: float | np.ndarray | torch.Tensor | Sequence[float],
        generation: np.ndarray | torch.Tensor | Sequence[int] | None = None,
        table: str | None = None,
    ) -> int:
        """Set new priorities for sampled rows (``info["index"]``) in ``table`` (None: the
        default one); returns how many were applied. Rows overwritten since they were sampled
        are skipped and counted in ``stats()["priority_updates_stale"]``: their stamps are
        ``generation`` (``info["generation"]``) or, left out, those of the one of the last 8
        samples whose ``info["index"]`` is ``index`` (as :meth:`Reader.update_priorities`). A
        bad index, priority or length raises InvalidArgumentError and applies nothing."""
        self._check_open()
        segment = self.segment
        stamps = np.zeros(self.capacity, np.int64) if segment is None else segment.generations
        index = to_host(index)
        seen = self._recent.generations_of(index) if generation is None else generation
        # checked once, by the container (reads.check_update_args, as a Reader checks them)
        return self.container.table_named(table).update_priorities(index, priority, seen, stamps)

    def sample_episodes(
        self,
        n: int,
        out: TensorDict | Mapping[str, Any] | None = None,
        where: str | None = None,
        table: str | None = None,
    ) -> TensorDict | list[TensorDict]:
        """``n`` whole episodes drawn by the sampler: ``[n, L]`` if their lengths agree, else a
        list.

        ``out``: a preallocated TensorDict (or nested dict of tensors) to copy into, reused
        across calls so the copy lands in warm pages (large image batches gain: see
        ``docs/architecture.md``). Each schema key needs a contiguous CPU tensor of the column's
        dtype shaped ``[*lead, *row_shape]`` holding at least the rows drawn (``[n, L]``, or
        ``[n * longest]``); other keys are left alone. The result is then views of ``out``,
        valid until the next call that reuses it. A key, dtype or shape that does not fit
        raises InvalidArgumentError naming it before anything is drawn; too few rows, after
        the draw. Not for compressed columns. ``where`` and ``table`` as for :meth:`sample`."""
        self._check_open()
        target = None
        if out is not None and self.segment is not None:
            target = rows.out_arrays(self.segment.schema, out)
        drawer = self.container.table_named(table)
        among = None if where is None else self._metadata().subset(where, drawer)
        drawn = drawer.sample_episodes(n, among=among)
        if target is None:
            return self._episodes(drawn.starts, drawn.ends, scalar=False, physical=drawn.rows)
        assert self.segment is not None
        columns, arrays = self.segment.columns, self.segment.arrays
        return rows.episodes_into(columns, drawn.rows, arrays, drawn.ends - drawn.starts, target)

    def sample_slices(
        self,
        n: int,
        length: int,
        strict: bool = True,
        return_info: bool = False,
        beta: float | None = None,
        where: str | None = None,
        table: str | None = None,
    ) -> TensorDict | tuple[TensorDict, dict[str, torch.Tensor]]:
        """``[n, length]`` runs of consecutive rows, each inside one episode.

        ``strict=False`` admits episodes shorter than ``length`` too: their slice starts at
        their first row and is zero-padded, and a bool ``"mask"`` entry ``[n, length]`` is
        True on real rows (a prefix). ``return_info`` as for :meth:`sample`, per slice, with
        ``index`` its first row (a prioritized slice carries its first row's priority).
        ``where`` and ``table`` as for :meth:`sample`."""
        self._check_open()
        check_mask_free(self.schema, strict)
        drawer = self.container.table_named(table)
        among = None if where is None else self._metadata().subset(where, drawer)
        drawn = drawer.sample_slices(n, length, strict=strict, beta=beta, among=among)
        data = self._copy(drawn.rows).reshape(n, length)
        if drawn.mask is not None:
            mask_slices(data, drawn.mask)
        info = self._info(drawn.starts, drawn.probability, drawn.weight) if return_info else None
        return data if info is None else (data, info)

    def iterate(
        self,
        batch_size: int,
        shuffle: bool = True,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ) -> Iterator[TensorDict]:
        """Minibatches of ``batch_size`` rows covering this rank's share of every stored row
        once, PyTorch ``DistributedSampler``'s convention: ranks split the (shuffled) rows
        round robin; without ``drop_last`` the list is padded by wrapping around so every rank
        gets the same count (a few rows appear twice across ranks) and the last batch may be
        short; with it the tail is dropped, so every batch is full and no row repeats.

        Every rank's k-th pass uses the same shuffle (seeded by ``seed`` and k: give every
        rank's Buffer the same ``seed``). The rows are fixed when the call is made; do not
        write while iterating. The sampler and the rate limiter are not involved."""
        self._check_open()
        batch_size, rank, world_size = check_iterate_args(batch_size, rank, world_size)
        seed = self._passes.next_seed(rank, world_size)
        physical = self.container.rank_rows(
            rank, world_size, shuffle=shuffle, drop_last=drop_last, seed=seed
        )
        return batches(physical, batch_size, drop_last, self._read)

    def episodes(
        self, where: str | None = None, order_by: str | None = None, limit: int | None = None
    ) -> EpisodeRecords:
        """The live episodes ``where`` selects (``"return > 100 and policy_version >= 7"``;
        None: all), by id or ``order_by`` a name (``"-return"``: descending), at most ``limit``:
        :class:`~shmbuffer.ring.meta.EpisodeRecords` (``docs/metadata.md``)."""
        self._check_open()
        meta = self._metadata()
        return meta.select(None if where is None else meta.parsed(where), order_by, limit)

    def _metadata(self) -> EpisodeMeta:
        # Kept from its first use on (not from the start: its listener costs every write)
        self._meta = self._meta or self.container.keep_meta()
        return self._meta

    def _checked_meta(self, meta: Meta) -> dict[str, Any] | None:
        return None if meta is None else self._metadata().check(meta)

    def stats(self) -> dict[str, Any]:
        """Sizes, the sampler's and limiter's state, and priority update counts (the default
        table's; with several, each table's under ``"tables"``)."""
        sizes = {"capacity": self.capacity, "unit": self.unit, "mode": self.mode}
        counts = {"rows": self.num_rows, "episodes": self.num_episodes}
        packed = {} if self._packer is None else {"compressed": self._packer.stats()}
        return {**sizes, **counts, **self.container.stats(), **packed}

    def _info(self, index: np.ndarray, p: np.ndarray, w: np.ndarray) -> dict[str, torch.Tensor]:
        assert self.segment is not None  # ``p``, ``w``: each row's probability and weight
        return self._recent.info(index, self.segment.generations[index], p, w)

    def _copy(self, physical: np.ndarray) -> TensorDict:
        """The rows, copied out; the container already counted the read."""
        if (segment := self.segment) is None:  # nothing written yet, so nothing is selected
            return TensorDict({}, batch_size=[0])
        if segment.schema.has_frames:  # stacks from one frame a row (api/framegather.py)
            return read_frames(segment.schema, segment.arrays, physical, self.container)
        return expanded(self._packer, rows.read(segment.columns, physical, segment.arrays))

    def _read(self, physical: np.ndarray) -> TensorDict:
        self.container.count_use(physical)  # then the rows copied out, as _copy does
        return self._copy(physical)

    def _episodes(
        self,
        starts: np.ndarray,
        ends: np.ndarray,
        scalar: bool,
        physical: np.ndarray | None = None,
    ) -> TensorDict | list[TensorDict]:
        """Episodes ``[starts, ends)``; ``physical`` given: their rows, already counted."""
        if self.segment is None:  # nothing written yet, so nothing can be selected
            return TensorDict({}, batch_size=[0]) if scalar else []
        lengths = ends - starts
        if physical is None:
            physical = rows.episode_rows(starts, lengths)
            self.container.count_use(physical)
        columns, arrays = self.segment.columns, self.segment.arrays
        read = rows.read_episodes(columns, physical, arrays, lengths, scalar)
        return expanded(self._packer, read)

    # -- lifecycle --------------------------------------------------------------------------

    def clear(self) -> None:
        """Drop every stored row and pending step; keeps the schema and the memory."""
        self._check_open()
        self.container.clear()
        self.assembler.clear()

    def close(self, unlink: bool = True) -> None:
        """Release the memory; a named segment this buffer created is unlinked by default.
        Safe to call twice; any other use afterwards raises :class:`ClosedError`."""
        self._closed = True
        if self.segment is not None:
            self.segment.close()
            if unlink and self.name is not None:
                Segment.unlink(self.name, self._storage_dir)
            self.segment = None

    def _check_open(self) -> None:
        # Without it a closed buffer read as empty and a write allocated fresh, zeroed memory
        # under the old rows' registry entries.
        if self._closed:
            raise ClosedError("this Buffer is closed (close() was called); create a new one")

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
