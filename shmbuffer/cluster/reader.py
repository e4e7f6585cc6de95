"""The cluster reader: one daemon's ``Reader`` API over every shard of a ``ShardedBuffer``.

A call is split across the shards that are up in proportion to their masses
(:mod:`shmbuffer.cluster.split`: rows, episodes or slice starts; the total priority weight for
``prioritized``), and the shards' requests go out in parallel, one thread per shard, each
through that shard's own :class:`~shmbuffer.Reader`: through shared memory for the shard on
this process's node, as tcp frames (``remote=True``) for the others. The parts come back in
shard order, concatenated (``info["shard"]`` says whose each item is).

* ``sample``/``sample_slices(..., return_info=True)``: ``index`` is global
  (``shard * capacity + row``, what :meth:`ClusterReader.update_priorities` takes back),
  ``probability`` is over the union (the shard's share times its own) and ``weight`` is
  normalised over the union (for ``prioritized``, by the smallest item weight of all shards).
* ``sample_episodes`` yields a :class:`~shmbuffer.cluster.episodes.ShardEpisodes`: whole
  episodes, zero-copy views under a lease from this node's shard, copies from the others.
* **FIFO and consume-once** samplers (``fifo``, ``without-replacement``,
  ``max_times_sampled``) keep their order within each shard (there is no order across
  nodes). A shard that cannot serve its share within a short round (``sample_timeout / 10``,
  0.05 to 1 s) gets a smaller share next round and the others take the rest; what was
  handed out by the time ``sample_timeout`` passes is kept (as copies) and returned first by
  the next call of the same kind, and WaitTimeoutError is raised: nothing consumed is lost.
* **Sizes** come from each shard's ``stats``, asked for alongside a sample (no extra wait)
  when older than ``size_refresh`` seconds; a uniform shard's slice starts from its replies.
* **A lost shard** (its daemon does not answer within ``timeout``, or restarted and forgot
  this reader) drops out with a :class:`ShardUnavailableWarning`; the call is completed by
  the others. Every ``rejoin_interval`` seconds a background thread asks the shard's host
  where its daemon is and reconnects; the next call includes it again. Every wait is bounded:
  no call hangs on a dead node.

The shards, their Readers and the parallel calls are :mod:`shmbuffer.cluster.fanout`'s; this
module is the split of a call across them, consume-once rounds, the merge and the Reader API.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from shmbuffer.api.reads import (
    check_episode_args,
    check_sample_args,
    check_slice_args,
    check_update_args,
)
from shmbuffer.cluster.episodes import EpisodeCopies, ShardEpisodes
from shmbuffer.cluster.fanout import DOWN, ShardFanout, ShardUnavailableWarning
from shmbuffer.cluster.shard import Piece
from shmbuffer.cluster.split import apportion, rescale_weights, smallest_weight
from shmbuffer.errors import (
    DaemonUnavailableError,
    EmptyBufferError,
    ShmBufferError,
    WaitTimeoutError,
)

__all__ = ["DOWN", "MAX_ROUNDS", "ClusterReader", "ShardUnavailableWarning"]

#: Rounds a call re-splits the items shards could not give (empty, or gone) over the others.
MAX_ROUNDS = 4


class ClusterReader(ShardFanout):
    """Samples every shard of a :class:`~shmbuffer.cluster.handle.ShardedBuffer` as one
    buffer; see the module docstring. Made by ``buffer.reader(...)``.

    Args:
        local: only this node's shard (a train worker bound to its node).
        nodes: only the shards on these node ids.
        timeout: seconds any single wait on a shard may take before it drops out.
        sample_timeout: seconds a sample may wait for data (FIFO, consume-once, the rate
            limiter); None: ``timeout``.
        size_refresh: seconds a shard's size is reused before it is asked again.
        rejoin_interval: seconds between attempts to reconnect a shard that dropped out.
        seed: seeds the split of batches across shards.
        auto_renew, max_lease_hold: as for :class:`~shmbuffer.Reader` (episode leases).
        table: the shards' table to read (every shard started with the same ``--table``s;
            None: the default one), passed to each shard's Reader; a shard's share of a
            batch goes by that table's sampler (its priorities, for a prioritized one).
    """

    # -- the split ------------------------------------------------------------------------------

    def _draw(
        self, kind: str, n: int, length: int = 1, strict: bool = True, beta: float | None = None
    ) -> list[Piece]:
        """``n`` items from the shards up, in proportion to their masses; the items a shard
        could not give (empty, gone) are split again over the others."""
        self._check_open()
        if self.consumes:
            return self._consume(kind, n, length, strict, beta)
        self._rejoin()
        pieces: list[Piece] = []
        need, excluded = n, set()
        try:
            for _ in range(MAX_ROUNDS):
                live = [lk for lk in self._up() if lk.index not in excluded]
                live = self._ensure_stats(live)
                masses = np.array([self._mass(lk, kind, length, strict) for lk in live])
                if not live or masses.sum() <= 0:
                    break
                counts = apportion(need, masses.tolist(), self._rng)
                shares = masses / masses.sum()
                jobs = [
                    (
                        lk,
                        partial(
                            self._part, lk, kind, int(k), length, strict, beta, self.sample_timeout
                        ),
                    )
                    for lk, k in zip(live, counts, strict=True)
                    if k
                ]
                share_of = {lk.index: float(s) for lk, s in zip(live, shares, strict=True)}
                error: BaseException | None = None
                for link, got in self._parallel(jobs):
                    if isinstance(got, Piece):
                        got.share = share_of[link.index]
                        pieces.append(got)
                        need -= got.count
                    elif isinstance(got, DOWN):
                        self._drop(link, got)
                    elif isinstance(got, EmptyBufferError):  # its size was stale: ask again
                        excluded.add(link.index)
                        link.stats, link.stats_at = None, -math.inf
                    else:
                        error = error or got
                if error is not None:
                    raise error
                if need == 0:
                    return pieces
        except BaseException:
            self._release(pieces)
            raise
        self._release(pieces)
        if not self._up():
            raise DaemonUnavailableError(
                f"no shard of {self.name!r} is reachable now: "
                + "; ".join(f"{lk.where()}: {lk.reason}" for lk in self._links)
            )
        raise EmptyBufferError(
            f"the shards of {self.name!r} up now ({self.shards_up}) hold too little to sample "
            f"{n} {kind}" + (f" of length {length}" if kind == "slices" else "")
        )

    def _consume(
        self, kind: str, n: int, length: int, strict: bool, beta: float | None
    ) -> list[Piece]:
        """``n`` items from a consuming sampler: rounds of short waits in which shards that
        came up dry are asked for less; on timeout what was taken is kept for the next call."""
        key = (kind, length, strict)
        pieces, have = [], 0
        for carried in self._carry.pop(key, []):
            piece = carried
            if have + piece.count > n:
                piece, rest = carried.head(n - have)
                self._carry.setdefault(key, []).append(rest)
            if piece.count:
                pieces.append(piece)
                have += piece.count
        deadline = time.monotonic() + self.sample_timeout
        round_wait = min(1.0, max(0.05, self.sample_timeout / 10))
        # A shard that came up dry is asked for at most half as much next time (it may hold
        # a few items, and a call takes all it asks or nothing) and weighs less in the split.
        cap: dict[int, int] = {}
        weight: dict[int, float] = {}
        try:
            while have < n:
                self._rejoin()
                live = self._ensure_stats(self._up())
                left = deadline - time.monotonic()
                if not live or left <= 0:
                    self._keep(key, pieces)
                    pieces = []
                    if not live:
                        raise DaemonUnavailableError(
                            f"no shard of {self.name!r} is reachable now; {have} of {n} "
                            f"{kind} taken are kept for the next call"
                        )
                    raise WaitTimeoutError(
                        f"{have} of {n} {kind} handed out by the shards of {self.name!r} "
                        f"within sample_timeout={self.sample_timeout:g}s; they are kept and "
                        "returned first by the next call"
                    )
                masses = [
                    max(self._mass(lk, kind, length, strict), 1.0) * weight.get(lk.index, 1.0)
                    for lk in live
                ]
                counts = apportion(n - have, masses, self._rng)
                asks = {
                    lk.index: min(int(k), cap.get(lk.index, n))
                    for lk, k in zip(live, counts, strict=True)
                }
                wait = min(left, round_wait)
                jobs = [
                    (lk, partial(self._part, lk, kind, asks[lk.index], length, strict, beta, wait))
                    for lk in live
                    if asks[lk.index]
                ]
                error: BaseException | None = None
                for link, got in self._parallel(jobs):
                    if isinstance(got, Piece):
                        pieces.append(got)
                        have += got.count
                        cap.pop(link.index, None)
                        weight.pop(link.index, None)
                    elif isinstance(got, WaitTimeoutError | EmptyBufferError):
                        cap[link.index] = max(1, asks[link.index] // 2)
                        weight[link.index] = weight.get(link.index, 1.0) * 0.5
                    elif isinstance(got, DOWN):
                        self._drop(link, got)
                    else:
                        error = error or got
                if error is not None:
                    self._keep(key, pieces)
                    pieces = []
                    raise error
        except BaseException:
            self._release(pieces)
            raise
        return pieces

    def _keep(self, key: tuple[str, int, bool], pieces: list[Piece]) -> None:
        """Carry consumed pieces to the next call: episode views become copies (and their
        leases go)."""
        kept = self._carry.setdefault(key, [])
        for piece in pieces:
            if piece.release is None:
                kept.append(piece)
                continue
            copies = EpisodeCopies.of(piece.data)
            self._end(piece, None, None, None)
            kept.append(Piece(piece.link, piece.count, copies))

    def _end(self, piece: Piece, *exc: Any) -> bool:
        """Release a piece's lease (episode views); a shard gone meanwhile just drops out."""
        release, piece.release = piece.release, None
        if release is None:
            return False
        try:
            release.__exit__(*exc)
        except DOWN as err:  # nobody can write there while its daemon is gone
            self._drop(piece.link, err)
        return False

    def _release(self, pieces: list[Piece]) -> None:
        for piece in pieces:
            with contextlib.suppress(ShmBufferError):
                self._end(piece, None, None, None)

    # -- the merge ----------------------------------------------------------------------------

    def _merge(self, pieces: list[Piece], return_info: bool, beta: float | None) -> Any:
        parts = [p.data for p in pieces]
        data = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if not return_info:
            return data
        mins = [smallest_weight(p.link.stats) for p in pieces if p.link.stats is not None]
        mins += [smallest_weight(lk.stats) for lk in self._up() if lk.stats is not None]
        known = [m for m in mins if m is not None]
        union_min = min(known) if known else None
        index, gens, probs, weights, shards = [], [], [], [], []
        for p in pieces:
            assert p.info is not None
            stats = p.link.stats or {}
            settings = (stats.get("sampler") or {}).get("settings") or {}
            b = float(beta if beta is not None else settings.get("importance_exponent", 0.0))
            shard_min = smallest_weight(stats) if stats else None
            index.append(p.info["index"] + p.link.index * self.capacity)
            gens.append(p.info["generation"])
            probs.append(p.info["probability"] * p.share)
            w = rescale_weights(p.info["weight"].double().numpy(), shard_min, union_min, b)
            weights.append(torch.from_numpy(np.asarray(w, dtype=np.float32)))
            shards.append(torch.full((p.count,), p.link.index, dtype=torch.int64))
        info = {
            "index": torch.cat(index),
            "generation": torch.cat(gens),
            "probability": torch.cat(probs),
            "weight": torch.cat(weights),
            "shard": torch.cat(shards),
        }
        return data, info

    # -- the Reader API -----------------------------------------------------------------------

    def sample(
        self, batch_size: int, return_info: bool = False, beta: float | None = None
    ) -> TensorDict | tuple[TensorDict, dict[str, torch.Tensor]]:
        """``batch_size`` transitions across the shards (a copy), as ``Reader.sample``;
        ``info`` as described in the module docstring, plus ``info["shard"]``."""
        n = check_sample_args(batch_size, beta)  # the whole call's, not each shard's part
        pieces = self._draw("rows", n, beta=beta)
        merged: Any = self._merge(pieces, return_info, beta)
        return merged

    def sample_slices(
        self,
        n: int,
        length: int,
        strict: bool = True,
        return_info: bool = False,
        beta: float | None = None,
    ) -> TensorDict | tuple[TensorDict, dict[str, torch.Tensor]]:
        """``[n, length]`` runs of rows, each inside one episode of one shard, as
        ``Reader.sample_slices`` (``strict=False``: padded, with a ``"mask"``)."""
        n, length = check_slice_args(n, length, strict, beta)
        pieces = self._draw("slices", n, length, strict, beta)
        merged: Any = self._merge(pieces, return_info, beta)
        return merged

    @contextmanager
    def sample_episodes(self, n: int) -> Iterator[ShardEpisodes]:
        """``n`` whole episodes across the shards, as ``Reader.sample_episodes``: views under
        a lease from this node's shard (released when the block exits), copies from the
        others."""
        n = check_episode_args(n)
        pieces = self._draw("episodes", n)
        with ExitStack() as stack:
            for piece in pieces:
                stack.push(partial(self._end, piece))
            yield ShardEpisodes([(p.link.index, p.data) for p in pieces])

    def update_priorities(self, index: Any, priority: Any, generation: Any = None) -> int:
        """Set priorities of sampled items by their global ``info["index"]`` (and, to skip
        rows overwritten since, ``info["generation"]``); returns how many were applied.
        Checked here first (InvalidArgumentError, nothing applied); the items of a shard that
        is down are skipped."""
        self._check_open()
        self._rejoin()
        total = self.capacity * len(self.buffer.shard_list())
        rows, values, stamps = check_update_args(index, priority, generation, total)
        shard_of = rows // self.capacity
        by_index = {link.index: link for link in self._links}
        jobs = []
        for s in np.unique(shard_of).tolist():
            link = by_index.get(int(s))
            if link is None or link.reader is None:
                continue
            mask = shard_of == s
            local = rows[mask] - s * self.capacity
            gen = None if stamps is None else stamps[mask]
            jobs.append((link, partial(link.reader.update_priorities, local, values[mask], gen)))
        updated, error = 0, None
        for link, got in self._parallel(jobs):
            if isinstance(got, BaseException):
                if isinstance(got, DOWN):
                    self._drop(link, got)
                else:
                    error = error or got
            else:
                updated += int(got)
        if error is not None:
            raise error
        return updated

    def stats(self) -> dict[int, dict[str, Any]]:
        """Each shard up's daemon ``stats``, by shard index."""
        self._check_open()
        self._rejoin()
        up = self._up()
        for link in up:
            link.stats = None
        self._ensure_stats(up)
        return {link.index: link.stats for link in self._up() if link.stats is not None}

    def __len__(self) -> int:
        field = "rows" if self.unit == "transition" else "episodes"
        return sum(int(stats[field]) for stats in self.stats().values())

    def close(self) -> None:
        """Close every shard's Reader. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for pieces in self._carry.values():
            self._release(pieces)
        self._carry.clear()
        self._close_shards()

    def __enter__(self) -> ClusterReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"ClusterReader({self.name!r}, shards up {self.shards_up} of "
            f"{[lk.index for lk in self._links]}, sampler={self.sampler})"
        )
