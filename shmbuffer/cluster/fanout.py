"""The cluster reader's fan-out: a :class:`~shmbuffer.Reader` per shard, calls made on all of
them at once, shards that drop out and rejoin, and one shard's part of a call.

Each shard is reached through its own Reader (shared memory for the shard on this process's
node, tcp frames for the others), on a thread of a pool with one thread per shard, so a
call's wait is its slowest shard's, not their sum. Every wait is bounded: a Reader's own
deadlines end first, and :meth:`ShardFanout._parallel` has a backstop past them. A shard that
does not answer, or forgot this reader (its daemon restarted), drops out with a
:class:`ShardUnavailableWarning`; a background thread reconnects it every
``rejoin_interval`` seconds. What a call asks each shard for, and how the parts are put
together, is :mod:`shmbuffer.cluster.reader`'s.
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from functools import partial
from typing import Any

import numpy as np

from shmbuffer.clients.reader import Reader
from shmbuffer.cluster.placement import ShardSet, current_node
from shmbuffer.cluster.shard import Piece, ShardLink
from shmbuffer.cluster.split import shard_mass
from shmbuffer.errors import ClosedError, DaemonUnavailableError, ShmBufferError

log = logging.getLogger("shmbuffer.cluster")

#: Errors that mean the shard is gone (dead, restarted, unreachable): it drops out.
DOWN = (DaemonUnavailableError, ClosedError)


class ShardUnavailableWarning(RuntimeWarning):
    """A shard dropped out of sampling (it rejoins by itself once its daemon is back)."""


class ShardFanout:
    """The shards of a :class:`~shmbuffer.cluster.reader.ClusterReader`, the calls that reach
    them, and the state its calls share (the arguments are ClusterReader's, documented
    there)."""

    def __init__(
        self,
        buffer: ShardSet,
        *,
        local: bool = False,
        nodes: list[str] | None = None,
        timeout: float = 5.0,
        sample_timeout: float | None = None,
        size_refresh: float = 0.05,
        rejoin_interval: float = 1.0,
        seed: int | None = None,
        auto_renew: bool = True,
        max_lease_hold: float | None = 600.0,
        table: str | None = None,
    ) -> None:
        self.buffer = buffer
        #: The table each shard's Reader reads (None: the default one).
        self.table = table
        self.name = buffer.name
        self.capacity = buffer.capacity  # per shard
        self.unit = buffer.unit
        self.timeout = float(timeout)
        self.sample_timeout = self.timeout if sample_timeout is None else float(sample_timeout)
        for what, value in (("timeout", self.timeout), ("sample_timeout", self.sample_timeout)):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{what} must be >= 0 seconds, got {value!r}")
        self.size_refresh = float(size_refresh)
        self.rejoin_interval = float(rejoin_interval)
        self.auto_renew, self.max_lease_hold = auto_renew, max_lease_hold
        self._rng = np.random.default_rng(seed)
        self._closed = False
        here = current_node()
        shards = buffer.shard_list()
        if local:
            shards = [buffer.local_shard()]
        elif nodes is not None:
            unknown = sorted(set(nodes) - {s.node_id for s in shards})
            if unknown:
                raise ValueError(f"nodes {unknown} have no shard of {self.name!r}: {buffer.nodes}")
            shards = [s for s in shards if s.node_id in set(nodes)]
        if not shards:
            raise ValueError(f"nodes must name at least one shard of {self.name!r}")
        self._links = [
            ShardLink(
                s,
                remote=(s.host != socket.gethostname()) if here is None else s.node_id != here,
            )
            for s in shards
        ]
        self._pool = ThreadPoolExecutor(len(self._links), thread_name_prefix="shmbuffer-shard")
        self._bg = ThreadPoolExecutor(len(self._links), thread_name_prefix="shmbuffer-rejoin")
        # A consume-once call that timed out keeps what it got for the next call of its kind.
        self._carry: dict[tuple[str, int, bool], list[Piece]] = {}
        jobs = [(link, partial(self._connect, link)) for link in self._links]
        for link, got in self._parallel(jobs):
            if isinstance(got, Reader):
                link.reader = got
            else:
                link.last_try = time.monotonic()
                self._warn(link, got)
        up = self._up()
        if not up:
            self._close_shards()
            raise DaemonUnavailableError(
                f"no shard of {self.name!r} is reachable: "
                + "; ".join(f"{link.where()}: {link.reason}" for link in self._links)
            )
        assert up[0].reader is not None
        #: The shards' sampler, and whether its samples consume what they hand out.
        self.sampler: str = up[0].reader.sampler
        self.consumes: bool = up[0].reader.consumes

    # -- shards -------------------------------------------------------------------------------

    def _connect(self, link: ShardLink) -> Reader:
        """A Reader on the shard's daemon where its host says it is now."""
        shard = link.shard
        if current_node() is not None:
            shard = self.buffer.refresh(shard, timeout=max(self.timeout, 1.0))
        reader = Reader(
            shard.endpoint,
            remote=link.remote,
            timeout=self.timeout,
            # A batch's split changes from call to call: a sample sent ahead would miss, but
            # a reader of one shard asks it for the same every time.
            prefetch=len(self._links) == 1,
            # Every call asks each shard's daemon, so a shard that dies or hangs shows in
            # the call that needs it (its reader's own draws would go on over its last runs
            # until a report went unanswered for the timeout).
            local_draws=False,
            sample_timeout=self.sample_timeout,
            table=self.table,
            curve_server_key=shard.curve_server_key,
            auto_renew=self.auto_renew,
            max_lease_hold=self.max_lease_hold,
        )
        link.shard = shard
        return reader

    def _up(self) -> list[ShardLink]:
        return [link for link in self._links if link.reader is not None]

    @property
    def shards_up(self) -> list[int]:
        """Indices of the shards sampled now."""
        return [link.index for link in self._up()]

    def _warn(self, link: ShardLink, exc: BaseException) -> None:
        link.reason = f"{type(exc).__name__}: {exc}"
        message = (
            f"{link.where()} of {self.name!r} dropped out of sampling ({link.reason}); it "
            f"rejoins once its daemon answers again (tried every {self.rejoin_interval:g}s)"
        )
        log.warning("%s", message)
        warnings.warn(ShardUnavailableWarning(message), stacklevel=4)

    def _drop(self, link: ShardLink, exc: BaseException) -> None:
        reader, link.reader = link.reader, None
        if reader is None:
            return
        link.stats, link.stats_at = None, -math.inf
        link.observed.clear()
        link.last_try = time.monotonic()
        self._warn(link, exc)
        if self._closed:
            _close_quietly(reader)
        else:
            self._bg.submit(_close_quietly, reader)  # its goodbye may wait: not on this thread

    def _rejoin(self) -> None:
        """Take finished reconnections; start one for each shard down long enough."""
        now = time.monotonic()
        for link in self._links:
            if link.reader is not None:
                continue
            attempt = link.attempt
            if attempt is not None:
                if not attempt.done():
                    continue
                link.attempt = None
                try:
                    reader = attempt.result()
                except Exception as exc:
                    link.reason = f"{type(exc).__name__}: {exc}"
                    continue
                link.reader = reader
                log.warning("%s of %r rejoined sampling", link.where(), self.name)
            elif now - link.last_try >= self.rejoin_interval:
                link.last_try = now
                link.attempt = self._bg.submit(self._connect, link)

    def _parallel(
        self, jobs: Sequence[tuple[ShardLink, Callable[[], Any]]]
    ) -> list[tuple[ShardLink, Any]]:
        """Run the jobs at once (the first on this thread); each result, or its exception."""
        if not jobs:
            return []
        futures = [(link, self._pool.submit(fn)) for link, fn in jobs[1:]]
        out = [(jobs[0][0], _outcome(jobs[0][1]))]
        backstop = 3 * self.timeout + self.sample_timeout + 5.0  # the Readers' own waits end first
        finished, _ = wait_futures([future for _, future in futures], timeout=backstop)
        for link, future in futures:
            if future not in finished:  # (WaitTimeoutError is a TimeoutError: not caught here)
                out.append((link, DaemonUnavailableError(f"no answer within {backstop:.0f}s")))
            else:
                out.append((link, future.exception() or future.result()))
        return out

    def _ensure_stats(self, links: list[ShardLink]) -> list[ShardLink]:
        """Fetch the stats of the links that have none; those that answer, still up."""
        todo = [link for link in links if link.stats is None and link.reader is not None]
        jobs = [(link, partial(_fetch_stats, link)) for link in todo]
        for link, got in self._parallel(jobs):
            if isinstance(got, BaseException):
                if isinstance(got, DOWN):
                    self._drop(link, got)
                else:
                    raise got
        return [link for link in links if link.reader is not None and link.stats is not None]

    def _mass(self, link: ShardLink, kind: str, length: int, strict: bool) -> float:
        if kind == "slices" and self.sampler == "uniform":
            seen = link.observed.get((kind, length, strict))
            if seen is not None:
                return seen
        assert link.stats is not None
        stats = link.stats
        if self.table is not None:  # the table's sampler draws: its priorities weigh
            own = (stats.get("tables") or {}).get(self.table) or {}
            stats = {**stats, "sampler": own.get("sampler", stats.get("sampler"))}
        return shard_mass(stats, kind, length, strict)

    # -- one shard's part (on a pool thread) --------------------------------------------------

    def _part(
        self,
        link: ShardLink,
        kind: str,
        k: int,
        length: int,
        strict: bool,
        beta: float | None,
        wait: float,
    ) -> Piece:
        reader = link.reader
        if reader is None:
            raise ClosedError(f"{link.where()} dropped out")
        stats_seq = None
        if time.monotonic() - link.stats_at >= self.size_refresh:
            stats_seq = reader.conn.send("stats")  # its reply is taken after the sample's
        reader.sample_timeout = wait
        try:
            if kind == "episodes":
                release = reader.sample_episodes(k)
                piece = Piece(link, k, release.__enter__(), release=release)
            elif kind == "rows":
                data, info = reader.sample(k, return_info=True, beta=beta)
                piece = Piece(link, k, data, info)
            else:
                data, info = reader.sample_slices(
                    k, length, strict=strict, return_info=True, beta=beta
                )
                piece = Piece(link, k, data, info)
        except DOWN:
            raise  # the stats reply will not come either
        except BaseException:
            if stats_seq is not None:
                _take_stats(link, reader, stats_seq)
            raise
        if stats_seq is not None:
            _take_stats(link, reader, stats_seq)
        if piece.info is not None and self.sampler == "uniform" and k:
            p = float(piece.info["probability"][0])
            if p > 0:
                link.observed[(kind, length, strict)] = 1.0 / p
        return piece

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this ClusterReader is closed (close() was called)")

    def _close_shards(self) -> None:
        """Close every shard's Reader (and those still connecting) and the pools."""
        self._closed = True
        readers = [link.reader for link in self._links if link.reader is not None]
        for link in self._links:
            link.reader = None
            if link.attempt is not None:
                link.attempt.add_done_callback(_close_attempt)
        for reader in readers:
            _close_quietly(reader)
        self._pool.shutdown(wait=False)
        self._bg.shutdown(wait=False)


def _outcome(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:
        return exc


def _fetch_stats(link: ShardLink) -> None:
    assert link.reader is not None
    link.stats = link.reader.stats()
    link.stats_at = time.monotonic()


def _take_stats(link: ShardLink, reader: Reader, seq: int) -> None:
    with contextlib.suppress(ShmBufferError):
        link.stats = reader.conn.wait(seq)[0]["stats"]
        link.stats_at = time.monotonic()


def _close_quietly(reader: Reader) -> None:
    with contextlib.suppress(Exception):
        reader.close()


def _close_attempt(attempt: Any) -> None:
    with contextlib.suppress(Exception):
        _close_quietly(attempt.result())
