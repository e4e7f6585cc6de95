"""Where shards are: the :class:`Shard` record, this process's Ray node, and the small
interface (:class:`ShardSet`) a cluster reader needs from the buffer handle."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import ray


@dataclass(frozen=True)
class Shard:
    """One shard as the handle knows it (its endpoint as of the last look)."""

    index: int
    node_id: str
    actor: Any  # ray ActorHandle of the ShardHost
    endpoint: str
    host: str
    daemon: str
    curve_server_key: str | None


class ShardSet(Protocol):
    """What a :class:`~shmbuffer.cluster.reader.ClusterReader` reads of its buffer handle."""

    name: str
    capacity: int
    unit: str

    @property
    def nodes(self) -> list[str]: ...

    def shard_list(self) -> list[Shard]: ...

    def local_shard(self, node_id: str | None = None) -> Shard: ...

    def refresh(self, shard: Shard, timeout: float = ...) -> Shard: ...


def current_node() -> str | None:
    """The Ray node id of this process, None outside Ray."""
    if not ray.is_initialized():
        return None
    return str(ray.get_runtime_context().get_node_id())


def alive_nodes() -> list[str]:
    nodes = ray.nodes()  # type: ignore[no-untyped-call, unused-ignore]
    return [str(n["NodeID"]) for n in nodes if n.get("Alive")]
