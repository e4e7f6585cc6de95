"""The in-process Buffer, the daemon's Reader and the cluster's ClusterReader check a read's
arguments by the same rules (shmbuffer/api/reads.py): the same class and words for each bad
argument, before anything is drawn or sent. The ClusterReader here reads one shard, the fake
daemon, on this host (outside Ray: no cluster is started)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from shmbuffer import Buffer
from shmbuffer.clients.reader import Reader
from shmbuffer.wire.protocol import MAX_SAMPLE
from tests.clients.conftest import MakeDaemon

CAPACITY = 16


def refusal(call: Callable[[], object]) -> tuple[type[BaseException], str]:
    """The class and words of what ``call`` raises (the parity tests compare them), up to the
    rule a bad priority broke: a Buffer states its sampler's largest priority there, which a
    reader leaves to the daemon."""
    try:
        call()
    except Exception as exc:
        return type(exc), str(exc).split(": priorities must")[0]
    raise AssertionError("nothing was refused")


def episodes(api: Any, n: int) -> None:
    """``sample_episodes(n)`` as each API hands them out (the readers' is a block)."""
    if isinstance(api, Buffer):
        api.sample_episodes(n)
    else:
        with api.sample_episodes(n):
            pass


@dataclass
class OneShard:
    """The part of a ShardedBuffer a ClusterReader reads: one shard, the fake daemon."""

    capacity: int
    name: str = "fake"
    unit: str = "transition"
    shards: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        from shmbuffer.cluster.placement import Shard

        host = socket.gethostname()  # this host: the shard's Reader is a local one
        self.shards = [Shard(0, "node-0", None, "fake", host, "fake", None)]

    @property
    def nodes(self) -> list[str]:
        return ["node-0"]

    def shard_list(self) -> list[Any]:
        return self.shards

    def local_shard(self, node_id: str | None = None) -> Any:
        return self.shards[0]

    def refresh(self, shard: Any, timeout: float = 1.0) -> Any:
        return shard


def open_reader(kind: str) -> Any:
    if kind == "reader":
        return Reader("fake", prefetch=False)
    pytest.importorskip("ray")  # the cluster package imports it
    from shmbuffer.cluster.reader import ClusterReader

    return ClusterReader(OneShard(CAPACITY))  # type: ignore[arg-type]


CALLS: dict[str, Callable[[Any], object]] = {
    "strict not a bool": lambda api: api.sample_slices(2, 3, strict=1),
    "n=0 slices": lambda api: api.sample_slices(0, 3),
    "length=0": lambda api: api.sample_slices(2, 0),
    "n a float": lambda api: api.sample_slices(2.0, 3),
    "too many slices": lambda api: api.sample_slices(MAX_SAMPLE + 1, 1),
    "too many rows": lambda api: api.sample(MAX_SAMPLE + 1),
    "beta < 0": lambda api: api.sample(4, beta=-1.0),
    "n=0 episodes": lambda api: episodes(api, 0),
    "too many episodes": lambda api: episodes(api, MAX_SAMPLE + 1),
    "batch_size=0": lambda api: api.iterate(0),
    "rank < 0": lambda api: api.iterate(2, rank=-1, world_size=2),
    "rank = world_size": lambda api: api.iterate(2, rank=2, world_size=2),
    "world_size=0": lambda api: api.iterate(2, rank=0, world_size=0),
    "index out of range": lambda api: api.update_priorities([CAPACITY], [1.0]),
    "index negative": lambda api: api.update_priorities([-1], [1.0]),
    "priority count": lambda api: api.update_priorities([1, 2], [1.0, 2.0, 3.0]),
    "priority NaN": lambda api: api.update_priorities([1, 2], [1.0, float("nan")]),
    "generation count": lambda api: api.update_priorities([1, 2], [1.0, 2.0], [7]),
}


#: The calls a ClusterReader has (it has no ``iterate``).
CLUSTER_CALLS = sorted(name for name in CALLS if not name.startswith(("batch", "rank", "world")))


@pytest.mark.parametrize(
    ("kind", "call"),
    [("reader", call) for call in sorted(CALLS)] + [("cluster", call) for call in CLUSTER_CALLS],
)
def test_a_bad_read_argument_is_refused_alike(fake: MakeDaemon, kind: str, call: str) -> None:
    daemon = fake(capacity=CAPACITY, sampler="prioritized")
    buf = Buffer(CAPACITY, sampler="prioritized")
    reader = open_reader(kind)
    try:
        expected = refusal(lambda: CALLS[call](buf))
        assert refusal(lambda: CALLS[call](reader)) == expected
    finally:
        reader.close()
    assert [r.op for r in daemon.log if r.op in ("sample", "iterate", "update_priorities")] == []
