"""The in-process buffer: the whole engine in one process, no daemon.

``Buffer`` is what a single-process user reaches for, and the reference semantics the daemon's
Writer and Reader share: the same ingestion calls (``extend``, ``add_episode``,
``add_transition``, ``end_episode``) and the same reads (``sample``, ``sample_episodes``,
``sample_slices``, logical indexing).

With ``name=None`` rows live in private memory; with a name they live in a named shared-memory
segment another process can attach to (:meth:`shmbuffer.segment.Segment.attach`).

Reads return copies: a caller can keep them while later writes overwrite the ring. Zero-copy
views with a lease that holds off writers are the daemon Reader's job.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from shmbuffer import rows
from shmbuffer.container import Container
from shmbuffer.episodes import DEFAULT_DONE_KEYS, EpisodeAssembler, FinishedEpisode
from shmbuffer.errors import ClosedError
from shmbuffer.schema import Schema
from shmbuffer.segment import LocalSegment, Segment
from shmbuffer.writeplan import env_major, plan_write

Index = int | np.integer | slice | Sequence[int] | np.ndarray | torch.Tensor


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
        seed: seeds the sampler's random generator.
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
        seed: int | None = None,
    ) -> None:
        self.container = Container(capacity, mode=mode, unit=unit)
        self.assembler = EpisodeAssembler(
            num_envs=num_envs,
            auto_truncate=auto_truncate,
            done_keys=done_keys,
            postprocess_fn=postprocess_fn,
        )
        self.name = name
        self._storage_dir = storage_dir
        self._rng = np.random.default_rng(seed)
        self.segment: Segment | LocalSegment | None = None
        self._closed = False
        if schema is not None:
            self._allocate(schema if isinstance(schema, Schema) else Schema.from_spec(schema))

    # -- properties -------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.container.capacity

    @property
    def unit(self) -> str:
        return self.container.unit

    @property
    def mode(self) -> str:
        return self.container.mode

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
    def use_counts(self) -> np.ndarray:
        """Reads of each physical row since it was written (-1: holds no committed data)."""
        return self.container.use_counts

    def __len__(self) -> int:
        return len(self.container)

    def __repr__(self) -> str:
        return (
            f"Buffer(capacity={self.capacity}, unit={self.unit!r}, mode={self.mode!r}, "
            f"rows={self.num_rows}, episodes={self.num_episodes}, schema={self.schema})"
        )

    # -- writing ----------------------------------------------------------------------------

    def extend(self, batch: Mapping[str, Any]) -> list[int]:
        """Write rows straight in: a chunk of transitions, or one whole episode in episode
        unit. Returns the ids of the (single) registry entry written."""
        self._check_open()
        return self._write(batch)

    def add_episode(self, episode: Mapping[str, Any], num_envs: int = 1) -> list[int]:
        """Write a finished episode; with ``num_envs > 1`` its leaves are ``[L, num_envs, ...]``
        and each sub-env becomes its own episode. Returns the new episode ids."""
        self._check_open()
        if num_envs == 1:
            return self._write(episode)
        return self._write(env_major(episode, num_envs), num_sub_episodes=num_envs)

    def add_transition(self, env_id: str, transition: Mapping[str, Any]) -> list[int]:
        """Append one step of ``env_id``; returns ids of episodes it finished (if any)."""
        self._check_open()
        return self._write_finished(self.assembler.add_transition(env_id, transition))

    def end_episode(self, env_id: str) -> list[int]:
        """End ``env_id``'s pending episode now (a no-op when nothing is pending)."""
        self._check_open()
        return self._write_finished(self.assembler.end_episode(env_id))

    def truncate_episodes(self, env_ids: Iterable[str]) -> list[int]:
        return [i for env_id in env_ids for i in self.end_episode(env_id)]

    def _write_finished(self, episodes: list[FinishedEpisode]) -> list[int]:
        return [
            i for ep in episodes for i in self._write(ep.data, num_sub_episodes=ep.num_sub_episodes)
        ]

    def _write(self, batch: Mapping[str, Any], num_sub_episodes: int = 1) -> list[int]:
        if self.segment is None:
            self._allocate(Schema.from_batch(batch))
        assert self.segment is not None
        plan = plan_write(self.segment.schema, batch, num_sub_episodes, self.capacity, self.mode)
        if plan is None:
            return []
        leaves, first_row, num_rows, num_sub_episodes = plan
        reservation = self.container.reserve(num_rows, num_sub_episodes)
        progress = rows.Progress()
        try:
            rows.write(
                self.segment.columns,
                self.segment.arrays,
                reservation.ranges,
                leaves,
                first_row,
                progress,
            )
        except BaseException:  # validation decided every cast: an interrupt, a device error
            # What the reservation evicted comes back wherever the copy had not reached.
            self.container.abort(reservation.id, written=progress.rows)
            raise
        return self.container.commit(reservation.id)

    def _allocate(self, schema: Schema) -> None:
        if self.name is None:
            self.segment = LocalSegment(schema, self.capacity)
        else:
            self.segment = Segment.create(
                self.name, schema, self.capacity, storage_dir=self._storage_dir
            )

    # -- reading ----------------------------------------------------------------------------

    def __getitem__(self, index: Index) -> TensorDict | list[TensorDict]:
        """Logical (chronological) indexing: 0 is the oldest, -1 the newest row or episode."""
        self._check_open()
        positions, scalar = normalize_index(index, len(self))
        if self.unit == "episode":
            _, starts, ends = self.container.registry.at_many(positions)
            return self._episodes(starts, ends, scalar)
        if isinstance(index, slice) and len(positions) > 1 and self.segment is not None:
            # Fast path: one writer commits in ring order, so a logical range whose ends are
            # n-1 rows apart is one physical range (a gap or a wrap would break the distance).
            first, last = self.container.registry.rows_at(positions[[0, -1]])
            if last - first == len(positions) - 1 and np.all(np.diff(positions) == 1):
                self.container.use_counts[first : last + 1] += 1
                return rows.copy_range(self.segment.columns, int(first), int(last) + 1)
        physical = self.container.registry.rows_at(positions)
        data = self._read(physical)
        return data[0] if scalar else data

    def get_data(self) -> TensorDict | list[TensorDict]:
        """Everything stored, oldest first."""
        return self[:]

    def sample(self, batch_size: int) -> TensorDict:
        """``batch_size`` rows drawn uniformly from all committed rows, with replacement."""
        self._check_open()
        return self._read(self.container.registry.sample_rows(batch_size, self._rng))

    def sample_episodes(self, n: int) -> TensorDict | list[TensorDict]:
        """``n`` whole episodes drawn uniformly: ``[n, L]`` if their lengths agree, else a list."""
        self._check_open()
        _, starts, ends = self.container.registry.sample_episodes(n, self._rng)
        return self._episodes(starts, ends, scalar=False)

    def sample_slices(self, n: int, length: int) -> TensorDict:
        """``[n, length]`` runs of consecutive rows, each inside one episode."""
        self._check_open()
        starts = self.container.registry.sample_slices(n, length, self._rng)
        physical = (starts[:, None] + np.arange(length)).reshape(-1)
        return self._read(physical).reshape(n, length)

    def _read(self, physical: np.ndarray) -> TensorDict:
        if self.segment is None:  # nothing written yet, so nothing can be selected
            return TensorDict({}, batch_size=[0])
        self.container.count_use(physical)
        return rows.read(self.segment.columns, physical)

    def _episodes(
        self, starts: np.ndarray, ends: np.ndarray, scalar: bool
    ) -> TensorDict | list[TensorDict]:
        lengths = ends - starts
        data = self._read(rows.episode_rows(starts, lengths))
        if scalar:
            return data
        if len(lengths) == 0:
            return []
        if np.all(lengths == lengths[0]):
            return data.reshape(len(lengths), int(lengths[0]))
        return list(data.split(lengths.tolist()))

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
        # under the old rows' registry entries (issue 7).
        if self._closed:
            raise ClosedError("this Buffer is closed (close() was called); create a new one")

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def normalize_index(index: Index, size: int) -> tuple[np.ndarray, bool]:
    """Logical positions for ``index`` in ``[0, size)``; negative ones count from the end.
    Raises IndexError for anything out of range (unwritten rows are never read)."""
    if isinstance(index, int | np.integer):
        i = int(index)
        if not -size <= i < size:
            raise IndexError(f"index {i} is out of range for {size} stored items")
        return np.array([i % size], dtype=np.int64), True
    if isinstance(index, slice):
        return np.arange(*index.indices(size), dtype=np.int64), False
    if isinstance(index, torch.Tensor):
        index = index.cpu().numpy()
    positions = np.asarray(index)
    if positions.dtype == np.bool_ or not np.issubdtype(positions.dtype, np.integer):
        if positions.size:
            raise IndexError(f"indices must be integers, got dtype {positions.dtype}")
        positions = positions.astype(np.int64)
    positions = positions.astype(np.int64).reshape(-1)
    bad = (positions < -size) | (positions >= size)
    if bad.any():
        raise IndexError(
            f"indices {positions[bad][:5].tolist()} are out of range for {size} stored items"
        )
    return positions % max(size, 1), False
