"""The episodes of one cross-shard ``sample_episodes``: the shards' parts as one sequence.

Each part is what one shard handed out: an :class:`~shmbuffer.clients.leased.EpisodeViews`
(zero-copy views under that shard's lease on the learner's node, copies from the others) or a
list of copies kept from an earlier call. Episode ``i`` is built when accessed, as the parts
build theirs; :meth:`ShardEpisodes.valid` holds while every part's lease does.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np
from tensordict import TensorDict


class ShardEpisodes(Sequence[TensorDict]):
    """A sequence of ``[length_i]`` TensorDicts over several shards' parts. ``shards``,
    ``ids`` and ``lengths`` are int64 arrays per episode (``ids`` are per shard: two shards
    may both have an episode 7)."""

    def __init__(self, parts: list[tuple[int, Sequence[TensorDict]]]) -> None:
        self._parts = [part for _, part in parts]
        sizes = [len(part) for part in self._parts]
        self._ends = np.cumsum(sizes, dtype=np.int64)
        self.shards = np.repeat(np.array([s for s, _ in parts], dtype=np.int64), sizes)
        self.lengths = np.concatenate(
            [_lengths(part) for part in self._parts] or [np.zeros(0, np.int64)]
        )
        self.ids = np.concatenate([_ids(part) for part in self._parts] or [np.zeros(0, np.int64)])

    def valid(self) -> bool:
        """Whether every part's lease certainly still holds (copies always do)."""
        return all(getattr(part, "valid", _always)() for part in self._parts)

    def renew(self) -> None:
        """Renew every part's lease now (LeaseExpiredError if one lapsed)."""
        for part in self._parts:
            renew = getattr(part, "renew", None)
            if renew is not None:
                renew()

    def __len__(self) -> int:
        return int(self._ends[-1]) if self._ends.size else 0

    @overload
    def __getitem__(self, index: int) -> TensorDict: ...

    @overload
    def __getitem__(self, index: slice) -> list[TensorDict]: ...

    def __getitem__(self, index: int | slice) -> TensorDict | list[TensorDict]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        i = range(len(self))[index]  # IndexError and negative indices, as a list
        part = int(np.searchsorted(self._ends, i, side="right"))
        first = int(self._ends[part - 1]) if part else 0
        return self._parts[part][i - first]

    def __iter__(self) -> Iterator[TensorDict]:
        for part in self._parts:
            yield from part

    def __repr__(self) -> str:
        return (
            f"ShardEpisodes({len(self)} episodes from shards "
            f"{sorted(set(self.shards.tolist()))}, valid={self.valid()})"
        )


class EpisodeCopies(list[TensorDict]):
    """Copies of episodes kept from a call that did not complete (a consume-once sampler's
    episodes are gone from their shard once handed out), with their ``ids`` and ``lengths``."""

    def __init__(self, episodes: Sequence[TensorDict], ids: np.ndarray) -> None:
        super().__init__(episodes)
        self.ids = np.asarray(ids, dtype=np.int64)
        self.lengths = np.array([int(td.batch_size[0]) for td in self], dtype=np.int64)

    @classmethod
    def of(cls, part: Sequence[TensorDict]) -> EpisodeCopies:
        """Copies of every episode of ``part`` (views are read now, while their lease holds)."""
        return cls([td.clone() for td in part], _ids(part))

    def split(self, k: int) -> tuple[EpisodeCopies, EpisodeCopies]:
        """The first ``k`` episodes and the rest."""
        return EpisodeCopies(self[:k], self.ids[:k]), EpisodeCopies(self[k:], self.ids[k:])


def _always() -> bool:
    return True


def _lengths(part: Sequence[TensorDict]) -> np.ndarray:
    lengths = getattr(part, "lengths", None)
    if lengths is not None:
        return np.asarray(lengths, dtype=np.int64)
    return np.array([int(td.batch_size[0]) for td in part], dtype=np.int64)


def _ids(part: Sequence[TensorDict]) -> np.ndarray:
    ids = getattr(part, "ids", None)
    if ids is not None:
        return np.asarray(ids, dtype=np.int64)
    return np.full(len(part), -1, dtype=np.int64)
