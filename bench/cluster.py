"""Cluster scenario (issue "scale-out on Ray"): insert and sample throughput of a
``ShardedBuffer`` with 1, 2 and 3 simulated Ray nodes, against TorchRL's ``RayReplayBuffer``
on the same cluster, in one run.

A ``ray.cluster_utils.Cluster`` of 3 nodes runs on this machine (1 CPU each, small object
stores, no dashboard, everything on 127.0.0.1). For k = 1, 2, 3 nodes:

* **shmbuffer-cluster**: ``ShardedBuffer.create`` on the first k nodes (schema declared, so
  each daemon makes its segment at start); one writer actor pinned to each of those nodes
  writes its rows through its node's daemon (shared memory); the learner (this process, on the
  head node) samples with a ``ClusterReader``: the head's shard through shared memory, the
  others as tcp frames.
* **torchrl-RayReplayBuffer**: one ``RayReplayBuffer`` (``LazyTensorStorage`` of the same
  total rows, its actor on the head node, ``num_cpus=0``); the same writer actors call
  ``extend`` through its client (each chunk goes through Ray's object store), the learner calls
  ``sample``.

Inserts are timed from the driver: every writer connected beforehand (untimed), all released
at once, to the last one's end (``flush`` for shmbuffer). Two passes: first (a fresh buffer),
steady (a second pass, the rows overwritten). Sampling: ``sample(256)`` repeated. Skipped
(with a note) without ray or torchrl.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from bench.adapters import missing_module
from bench.data import Spec, row_bytes, schema
from bench.harness import bench_dirs
from bench.registry import Context, Row, make_row, scenario

NAME = "cluster"
SHM = "shmbuffer-cluster"
TORCHRL = "torchrl-RayReplayBuffer"
ROOT = Path(__file__).resolve().parents[1]
NODES = 3
CHUNK = 250
BATCH = 256
SPEC: Spec = {
    "obs": ((512,), np.dtype(np.float32)),
    "action": ((), np.dtype(np.int64)),
    "reward": ((), np.dtype(np.float32)),
    "done": ((), np.dtype(np.bool_)),
}
ROW_BYTES = row_bytes(SPEC)
RAY_ENV = {
    "RAY_AUTH_MODE": "disabled",  # Ray 2.60 writes a token into the home folder otherwise
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # keeps every address on 127.0.0.1
}
# Ray reads these when it is imported (maybe by another scenario's peer): set them first.
for _key, _value in RAY_ENV.items():
    os.environ.setdefault(_key, _value)
NODE_ARGS: dict[str, Any] = {
    "num_cpus": 1,
    "object_store_memory": 200 * 2**20,
    "include_dashboard": False,
}


def _chunks(rows: int, seed: int) -> list[dict[str, Any]]:
    import torch

    rng = np.random.default_rng(seed)
    out = []
    for first in range(0, rows, CHUNK):
        n = min(CHUNK, rows - first)
        out.append(
            {
                "obs": torch.from_numpy(rng.standard_normal((n, 512), dtype=np.float32)),
                "action": torch.from_numpy(rng.integers(0, 18, n, dtype=np.int64)),
                "reward": torch.from_numpy(rng.standard_normal(n, dtype=np.float32)),
                "done": torch.zeros(n, dtype=torch.bool),
            }
        )
    return out


class EnvWorker:
    """A writer actor pinned to one node: builds its rows once, connects (untimed), then
    writes them on request through its node's shmbuffer daemon or a RayReplayBuffer client."""

    def __init__(self, rows: int, seed: int) -> None:
        from tensordict import TensorDict

        import shmbuffer.clients.writer  # noqa: F401  (imported before anything is timed)

        self.chunks = _chunks(rows, seed)
        self.tensordicts = [TensorDict(c, batch_size=[len(c["done"])]) for c in self.chunks]
        self.rows = rows
        self.writer: Any = None
        self.client: Any = None

    def connect(self, buffer: Any = None, client: Any = None) -> None:
        if self.writer is not None:
            self.writer.close()
        self.writer = None if buffer is None else buffer.writer()
        self.client = client

    def shm(self) -> int:
        for chunk in self.chunks:
            self.writer.extend(chunk)
        self.writer.flush()
        return self.rows

    def torchrl(self) -> int:
        for td in self.tensordicts:
            self.client.extend(td)
        return self.rows


@contextlib.contextmanager
def simulated_cluster(root: str, nodes: int = NODES) -> Iterator[Any]:
    """A ``ray.cluster_utils.Cluster`` of ``nodes`` nodes with this process connected; its
    workers find ``bench`` (``PYTHONPATH``) and the bench's runtime and storage folders."""
    import ray
    from ray.cluster_utils import Cluster

    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "SHMBUFFER_STORAGE_DIR")}
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), saved["PYTHONPATH"] or ""])
    os.environ["SHMBUFFER_STORAGE_DIR"] = os.path.join(root, "segments")
    ray_dir = tempfile.mkdtemp(prefix="bench-ray-", dir="/tmp")  # Ray's sessions and logs
    node_args = {**NODE_ARGS, "temp_dir": ray_dir}
    # Cluster writes its address file into Ray's default folder whatever temp_dir says
    Path(tempfile.gettempdir(), "ray").mkdir(exist_ok=True)
    cluster = Cluster()
    try:
        for _ in range(nodes):  # the first is the head
            cluster.add_node(**node_args)
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        remove_tree(ray_dir)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def remove_tree(path: str | Path, tries: int = 20) -> None:
    """``rm -r path``, again while Ray's exiting processes still write into it (bounded)."""
    for _ in range(tries):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            return
        time.sleep(0.25)


def _pinned(ray: Any, node: str) -> dict[str, Any]:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node, False)}


def _insert(ray: Any, workers: list[Any], call: Any) -> float:
    t0 = time.perf_counter()
    ray.get([call(w) for w in workers], timeout=900)
    return time.perf_counter() - t0


def _sample(fn: Any, calls: int, budget: float) -> tuple[int, float]:
    fn()  # warm: connections, first attach
    t0 = time.perf_counter()
    n = 0
    while n < calls:
        fn()
        n += 1
        if time.perf_counter() - t0 > budget:
            break
    return n, time.perf_counter() - t0


@scenario("cluster")
def cluster(ctx: Context) -> list[Row]:
    """ShardedBuffer on 1, 2, 3 simulated Ray nodes (a writer actor per node, a learner on the
    head) vs TorchRL RayReplayBuffer on the same cluster: insert and sample(256) rows/s."""
    for module in ("ray", "torchrl"):
        reason = missing_module(module)
        if reason:
            ctx.note(NAME, f"skipped: {reason} (pip install 'shmbuffer[ray]')")
            return []
    import ray

    # --quick: 2 nodes and only k = 2 (the cross-node path); each node start and each
    # shard's daemon costs seconds on 2 cores
    n_nodes, ks = (2, (2,)) if ctx.quick else (NODES, tuple(range(1, NODES + 1)))
    rows_per_node = ctx.size(40_000, minimum=2_000)
    calls = ctx.size(400, minimum=40)
    ctx.note(
        NAME,
        f"{n_nodes} simulated Ray nodes on this machine ({os.cpu_count()} cores shared by all), "
        f"1 CPU each; per node one writer actor writing {rows_per_node} rows of obs f32[512] "
        f"+ action/reward/done ({ROW_BYTES} B/row, {rows_per_node * ROW_BYTES / 1e6:.0f} MB) "
        f"in chunks of {CHUNK}; first = fresh buffer, steady = the same rows again",
    )
    ctx.note(
        NAME,
        f"{SHM}: a daemon per node (capacity {rows_per_node} rows each, schema declared), "
        "writes through the node's shared memory; the learner's ClusterReader reads the head's "
        f"shard through shared memory and the others over tcp. {TORCHRL}: one buffer actor "
        f"on the head (LazyTensorStorage of k x {rows_per_node} rows), extend through its "
        f"client; sample(256) x {calls} calls (capped at {ctx.max_op_seconds:g} s)",
    )
    out: list[Row] = []

    def add(impl: str, op: str, pass_: str, rows: int, seconds: float, **extra: Any) -> None:
        out.append(
            make_row(
                NAME,
                impl,
                op,
                rows=rows,
                nbytes=rows * ROW_BYTES,
                seconds=seconds,
                pass_=pass_,
                **extra,
            )
        )

    with bench_dirs(ctx) as root, simulated_cluster(root, n_nodes):
        nodes = [str(n["NodeID"]) for n in ray.nodes() if n["Alive"]]
        here = ray.get_runtime_context().get_node_id()
        nodes.sort(key=lambda n: n != here)  # the learner's node first: k=1 is all local
        actor = ray.remote(EnvWorker)
        workers = [
            actor.options(**_pinned(ray, n)).remote(rows_per_node, seed=i)
            for i, n in enumerate(nodes)
        ]
        ray.get([w.__ray_ready__.remote() for w in workers], timeout=600)
        schema_path = Path(root) / "schema.json"
        schema_path.write_text(json.dumps(schema(SPEC)))
        for k in ks:
            for impl, run in ((SHM, _run_shm), (TORCHRL, _run_torchrl)):
                try:
                    got = run(ray, nodes[:k], workers[:k], rows_per_node, calls, ctx, schema_path)
                except Exception as exc:
                    ctx.note(NAME, f"{impl} with {k} nodes failed: {type(exc).__name__}: {exc}")
                    continue
                for op, pass_, rows, seconds, extra in got:
                    add(impl, f"{op}-{k}n", pass_, rows, seconds, nodes=k, **extra)
        for w in workers:
            ray.kill(w)
    return out


Result = list[tuple[str, str, int, float, dict[str, Any]]]


def _run_shm(
    ray: Any,
    nodes: list[str],
    workers: list[Any],
    rows_per_node: int,
    calls: int,
    ctx: Context,
    schema_path: Path,
) -> Result:
    from shmbuffer.cluster import ShardedBuffer

    name = f"bench{uuid.uuid4().hex[:6]}"
    buf = ShardedBuffer.create(
        name, rows_per_node, unit="transition", nodes=nodes, schema=str(schema_path)
    )
    out: Result = []
    try:
        ray.get([w.connect.remote(buffer=buf) for w in workers], timeout=300)
        for pass_ in ("first", "steady"):
            seconds = _insert(ray, workers, lambda w: w.shm.remote())
            out.append(("insert", pass_, rows_per_node * len(nodes), seconds, {"chunk": CHUNK}))
        with buf.reader(seed=0) as reader:
            n, seconds = _sample(partial(reader.sample, BATCH), calls, ctx.max_op_seconds)
        out.append(("sample", "steady", n * BATCH, seconds, {"chunk": BATCH, "calls": n}))
    finally:
        with contextlib.suppress(Exception):
            ray.get([w.connect.remote() for w in workers], timeout=60)
        buf.shutdown()
    return out


def _run_torchrl(
    ray: Any,
    nodes: list[str],
    workers: list[Any],
    rows_per_node: int,
    calls: int,
    ctx: Context,
    schema_path: Path,
) -> Result:
    del schema_path
    from torchrl.data import LazyTensorStorage
    from torchrl.data.replay_buffers.ray_buffer import RayReplayBuffer

    here = ray.get_runtime_context().get_node_id()
    rb = RayReplayBuffer(
        storage=partial(LazyTensorStorage, rows_per_node * len(nodes)),
        batch_size=BATCH,
        remote_config=_pinned(ray, here),
    )
    out: Result = []
    try:
        ray.get([w.connect.remote(client=rb.client()) for w in workers], timeout=300)
        for pass_ in ("first", "steady"):
            seconds = _insert(ray, workers, lambda w: w.torchrl.remote())
            out.append(("insert", pass_, rows_per_node * len(nodes), seconds, {"chunk": CHUNK}))
        n, seconds = _sample(rb.sample, calls, ctx.max_op_seconds)
        out.append(("sample", "steady", n * BATCH, seconds, {"chunk": BATCH, "calls": n}))
    finally:
        with contextlib.suppress(Exception):
            ray.get([w.connect.remote() for w in workers], timeout=60)
        rb.close()
    return out
