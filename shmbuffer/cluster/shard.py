"""What a cluster reader knows about one shard: its Reader while it is up, its last stats,
and its attempt to rejoin while it is down."""

from __future__ import annotations

import math
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict

from shmbuffer.clients.reader import Reader
from shmbuffer.cluster.placement import Shard


@dataclass(eq=False)
class ShardLink:
    """One shard as a :class:`~shmbuffer.cluster.reader.ClusterReader` sees it.

    ``reader`` is None while the shard is down; ``attempt`` is then its reconnection in
    flight (a background thread), made at most every ``rejoin_interval`` seconds.
    ``remote``: the shard is on another node (its rows come as frames over tcp).
    """

    shard: Shard
    remote: bool
    reader: Reader | None = None
    #: The daemon's last ``stats`` and when they were taken (time.monotonic()).
    stats: dict[str, Any] | None = None
    stats_at: float = -math.inf
    #: Exact populations a uniform shard's replies imply (``1 / P``), per (kind, length, strict).
    observed: dict[tuple[str, int, bool], float] = field(default_factory=dict)
    attempt: Future[Reader] | None = None
    last_try: float = -math.inf
    reason: str = ""

    @property
    def index(self) -> int:
        return self.shard.index

    @property
    def up(self) -> bool:
        return self.reader is not None

    def where(self) -> str:
        return f"shard {self.index} (node {self.shard.node_id[:12]}, {self.shard.endpoint})"


@dataclass(eq=False)
class Piece:
    """What one shard handed out for one call: ``count`` items of ``data`` (a TensorDict of
    rows or slices, or a sequence of episodes), their ``info`` (rows and slices), the share of
    the batch's mass the shard had when it was split, and for leased episode views the
    context manager that releases them."""

    link: ShardLink
    count: int
    data: Any
    info: dict[str, torch.Tensor] | None = None
    share: float = 1.0
    release: Any = None

    def head(self, k: int) -> tuple[Piece, Piece]:
        """The first ``k`` items and the rest (copies only: carried pieces)."""
        if isinstance(self.data, TensorDict):
            info_a = None if self.info is None else {n: v[:k] for n, v in self.info.items()}
            info_b = None if self.info is None else {n: v[k:] for n, v in self.info.items()}
            first = Piece(self.link, k, self.data[:k], info_a, self.share)
            return first, Piece(self.link, self.count - k, self.data[k:], info_b, self.share)
        a, b = self.data.split(k)
        return Piece(self.link, k, a), Piece(self.link, self.count - k, b)
