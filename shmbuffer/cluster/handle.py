"""``ShardedBuffer``: one daemon per node of a Ray cluster, and the picklable handle to them.

``ShardedBuffer.create`` starts a :class:`~shmbuffer.cluster.actor.ShardHost` on each chosen
node (node affinity, ``num_cpus=0``, a named actor ``shmbuffer:<name>:<node>``) and returns
once every daemon serves. The handle holds the actors' handles and where their daemons
listen; it pickles into Ray tasks and actors, where

* :meth:`ShardedBuffer.writer` gives a :class:`~shmbuffer.Writer` on the caller's own node's
  daemon, writing through shared memory (nothing crosses the network on the insert path);
* :meth:`ShardedBuffer.reader` gives a :class:`~shmbuffer.cluster.reader.ClusterReader`
  sampling across every shard (or, ``local=True``, its node's only);
* :meth:`ShardedBuffer.least_loaded` and :meth:`ShardedBuffer.scheduling` place env workers on
  the shards with the fewest writers.

``capacity`` is per shard: every shard's daemon holds ``capacity`` rows.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from dataclasses import replace
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from shmbuffer.clients.writer import Writer
from shmbuffer.cluster.actor import ShardHost
from shmbuffer.cluster.options import check_capacity, check_name, check_options
from shmbuffer.cluster.placement import Shard, alive_nodes, current_node
from shmbuffer.errors import DaemonUnavailableError, ShmBufferError

log = logging.getLogger("shmbuffer.cluster")

#: Seconds a call to a shard host may take (they answer from memory).
HOST_TIMEOUT_S = 30.0


class ShardedBuffer:
    """A buffer sharded over Ray nodes; see the module docstring. Build it with
    :meth:`create`; copies (pickled into tasks) share the same daemons."""

    def __init__(self, name: str, capacity: int, unit: str, shards: list[Shard]) -> None:
        self.name = name
        self.capacity = capacity
        self.unit = unit
        self._shards = shards

    @classmethod
    def create(
        cls,
        name: str,
        capacity: int,
        unit: str = "transition",
        nodes: list[str] | None = None,
        *,
        curve: bool | None = None,
        runtime_dir: str | None = None,
        ready_timeout: float = 120.0,
        actor_restarts: int = 3,
        **daemon_options: Any,
    ) -> ShardedBuffer:
        """Start one daemon of ``capacity`` rows (``unit``) on each of ``nodes`` (Ray node
        ids; None: every alive node) and return the handle once all of them serve.

        Args:
            curve: CURVE on the daemons' tcp sockets (None: on non-loopback addresses).
            runtime_dir: ``$SHMBUFFER_RUNTIME_DIR`` for the daemons (None: the hosts').
            ready_timeout: seconds each daemon may take to start.
            actor_restarts: how often Ray restarts a host whose process died (it then
                starts an empty daemon; a daemon that died alone is resumed by its host).
            daemon_options: ``shmbuffer-daemon start`` flags as keywords (``sampler=``,
                ``seed=`` (shard i gets ``seed + i``), ``lease_ttl=``, ``storage_dir=``, ...).
        """
        check_name(name)
        capacity, unit = check_capacity(capacity, unit)
        options = check_options(daemon_options)
        if not ray.is_initialized():
            raise ShmBufferError("ShardedBuffer.create needs Ray: call ray.init() first")
        alive = alive_nodes()
        chosen = list(alive if nodes is None else nodes)
        unknown = [n for n in chosen if n not in alive]
        if unknown:
            raise ValueError(f"nodes {unknown} are not alive Ray nodes; alive: {alive}")
        if len(set(chosen)) != len(chosen) or not chosen:
            raise ValueError(f"nodes must be distinct and not empty, got {chosen}")
        remote_host: Any = ray.remote(ShardHost)
        actors = []
        for index, node in enumerate(chosen):
            actors.append(
                remote_host.options(
                    name=f"shmbuffer:{name}:{node[:12]}",
                    num_cpus=0,
                    max_concurrency=4,
                    max_restarts=actor_restarts,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                ).remote(name, index, capacity, unit, options, curve, runtime_dir, ready_timeout)
            )
        refs = [actor.info.remote() for actor in actors]
        infos: list[dict[str, Any] | None] = []
        errors: list[str] = []
        for node, ref in zip(chosen, refs, strict=True):
            try:
                infos.append(ray.get(ref, timeout=ready_timeout + HOST_TIMEOUT_S))
            except Exception as exc:
                infos.append(None)
                errors.append(f"node {node[:12]}: {type(exc).__name__}: {exc}")
        if errors:
            _stop_all(actors)
            raise ShmBufferError(f"ShardedBuffer {name!r} did not start: " + "; ".join(errors))
        shards = [
            Shard(
                index=i,
                node_id=node,
                actor=actor,
                endpoint=str(info["endpoint"]),
                host=str(info["host"]),
                daemon=str(info["daemon"]),
                curve_server_key=info["curve_server_key"],
            )
            for i, (node, actor, info) in enumerate(zip(chosen, actors, infos, strict=True))
            if info is not None
        ]
        return cls(name, capacity, unit, shards)

    # -- where things are ---------------------------------------------------------------------

    @property
    def nodes(self) -> list[str]:
        return [s.node_id for s in self._shards]

    def shard_list(self) -> list[Shard]:
        return list(self._shards)

    def shards(self) -> list[dict[str, Any]]:
        """One dict per shard: ``node_id``, ``endpoint``, ``pid``, ``rows``, ``episodes``
        (and ``index``, ``alive``, ``writers``, ``restarts``); a host that does not answer
        gives ``alive=False`` and None figures."""
        refs = [s.actor.describe.remote() for s in self._shards]
        out = []
        for shard, ref in zip(self._shards, refs, strict=True):
            try:
                info = ray.get(ref, timeout=HOST_TIMEOUT_S)
            except Exception:
                info = {"pid": None, "rows": None, "episodes": None, "writers": None}
                info.update(alive=False, restarts=None, endpoint=shard.endpoint)
            out.append(
                {
                    "index": shard.index,
                    "node_id": shard.node_id,
                    "endpoint": info["endpoint"],
                    "pid": info["pid"],
                    "rows": info["rows"],
                    "episodes": info["episodes"],
                    "writers": info["writers"],
                    "alive": info["alive"],
                    "restarts": info["restarts"],
                }
            )
        return out

    def refresh(self, shard: Shard, timeout: float = HOST_TIMEOUT_S) -> Shard:
        """``shard`` with the endpoint its host publishes now (a restart may have moved it).
        DaemonUnavailableError when the host does not answer or its daemon is down."""
        try:
            info = ray.get(shard.actor.info.remote(), timeout=timeout)
        except Exception as exc:
            raise DaemonUnavailableError(
                f"the shard host on node {shard.node_id[:12]} did not answer: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        if not info["alive"]:
            raise DaemonUnavailableError(
                f"the daemon of shard {shard.index} on node {shard.node_id[:12]} is down "
                f"(restarts so far: {info['restarts']})"
            )
        fresh = replace(
            shard, endpoint=str(info["endpoint"]), curve_server_key=info["curve_server_key"]
        )
        self._shards[shard.index] = fresh
        return fresh

    def local_shard(self, node_id: str | None = None) -> Shard:
        """The shard on ``node_id`` (default: this process's node; outside Ray, the one shard
        on this host). ValueError naming the nodes that have one when there is none."""
        node = node_id or current_node()
        if node is None:
            here = [s for s in self._shards if s.host == socket.gethostname()]
            if len(here) == 1:
                return here[0]
            raise ValueError(
                f"outside Ray, {len(here)} shards of {self.name!r} are on this host: pass "
                f"node_id= (one of {[s.node_id for s in here]})"
            )
        for shard in self._shards:
            if shard.node_id == node:
                return shard
        raise ValueError(
            f"no shard of {self.name!r} on node {node}; nodes with one: {self.nodes} "
            "(pass node_id= to use another node's shard)"
        )

    # -- clients ------------------------------------------------------------------------------

    def writer(self, node_id: str | None = None, **writer_options: Any) -> Writer:
        """A :class:`~shmbuffer.Writer` on this node's shard (or ``node_id``'s), writing
        through shared memory when the shard is on this node and over tcp (payload mode)
        otherwise. ``writer_options`` go to ``Writer`` (``timeout``, ``num_envs``, ...). After
        the shard's daemon restarted, make a new writer (the old one's client is gone)."""
        shard = self.local_shard(node_id)
        here = current_node()
        local = here is None or here == shard.node_id
        if here is not None:
            shard = self.refresh(shard)
        return Writer(
            shard.endpoint,
            remote=not local,
            curve_server_key=shard.curve_server_key,
            **writer_options,
        )

    def reader(self, **reader_options: Any) -> Any:
        """A :class:`~shmbuffer.cluster.reader.ClusterReader` over every shard; with
        ``local=True`` over this node's only (a train worker bound to its node's shard),
        with ``nodes=[...]`` over those."""
        from shmbuffer.cluster.reader import ClusterReader

        return ClusterReader(self, **reader_options)

    # -- placement ----------------------------------------------------------------------------

    def least_loaded(self, count: int = 1) -> list[str]:
        """Node ids for ``count`` new env workers, each on the shard with the fewest writers
        (then rows) counting the ones assigned before it: ``count=4`` over 2 idle shards
        gives each 2. Shards whose host does not answer are skipped."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be a positive int, got {count!r}")
        loads = {s["node_id"]: [s["writers"], s["rows"]] for s in self.shards() if s["alive"]}
        if not loads:
            raise DaemonUnavailableError(f"no shard of {self.name!r} answers")
        out = []
        for _ in range(count):
            node = min(loads, key=lambda n: (loads[n][0], loads[n][1]))
            loads[node][0] += 1
            out.append(node)
        return out

    @staticmethod
    def scheduling(node_id: str) -> NodeAffinitySchedulingStrategy:
        """The Ray scheduling strategy that runs a task or actor on ``node_id``:
        ``task.options(scheduling_strategy=buf.scheduling(node)).remote(buf)``."""
        return NodeAffinitySchedulingStrategy(node_id, soft=False)

    # -- the end ------------------------------------------------------------------------------

    def shutdown(self, timeout: float = HOST_TIMEOUT_S) -> None:
        """Stop every shard's daemon (an explicit stop, waited for), then the hosts."""
        _stop_all([s.actor for s in self._shards], timeout)

    def __repr__(self) -> str:
        nodes = ", ".join(n[:12] for n in self.nodes)
        return f"ShardedBuffer({self.name!r}, {self.capacity} rows x {len(self._shards)}: {nodes})"


def _stop_all(actors: list[Any], timeout: float = HOST_TIMEOUT_S) -> None:
    """Ask every host to stop its daemon, wait (bounded), then kill the hosts."""
    refs = [actor.stop.remote() for actor in actors]
    for ref in refs:
        try:
            ray.get(ref, timeout=timeout)
        except Exception as exc:  # a host already gone took its daemon with it
            log.warning("stopping a shard host: %s: %s", type(exc).__name__, exc)
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
