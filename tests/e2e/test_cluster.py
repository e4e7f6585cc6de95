"""shmbuffer.cluster on a simulated Ray cluster (``ray.cluster_utils.Cluster``, 3 nodes on this
machine): a daemon per node, writers on each node, a learner sampling across the nodes.

Opt-in (``pytest -m ray``): the cluster takes tens of seconds and about 1 GB to start. Ray is
kept on loopback (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: Ray's own switch that stops it from
swapping 127.0.0.1 for the host's address), without its dashboard, auth token or usage stats,
with small object stores; every node has 1 CPU and the hosts and tasks take none. The cluster
lives for the module; each test makes its own buffer and shuts it down, and teardown checks
that no daemon, segment or runtime file of it is left.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shmbuffer import runtime
from shmbuffer.errors import EmptyBufferError, WaitTimeoutError
from tests._stats import P_MIN, chi2_p

RAY_ENV = {
    "RAY_AUTH_MODE": "disabled",  # 2.60 writes a token into the home folder otherwise
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # keeps every address on 127.0.0.1
}
# Read when ray is imported (its constants), so set before: they concern Ray alone.
for _key, _value in RAY_ENV.items():
    os.environ.setdefault(_key, _value)

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

from shmbuffer.cluster import ShardedBuffer, ShardUnavailableWarning  # noqa: E402
from tests.e2e import _cluster_workers as work  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
NODES = 3
NODE_ARGS: dict[str, Any] = {
    "num_cpus": 1,
    "object_store_memory": 80 * 2**20,  # Ray's default (30% of memory) competes for /dev/shm
    "include_dashboard": False,
}


@dataclass
class Sim:
    nodes: list[str]
    runtime_dir: Path
    storage_dir: Path


@pytest.fixture(scope="module")
def sim() -> Iterator[Sim]:
    runtime_dir = Path(tempfile.mkdtemp(prefix="sbray-", dir="/tmp"))
    ray_dir = Path(tempfile.mkdtemp(prefix="sbray-ray-", dir="/tmp"))  # Ray's sessions and logs
    storage_dir = Path(f"/dev/shm/shmbuffer-ray-{uuid.uuid4().hex[:10]}")
    node_args = {**NODE_ARGS, "temp_dir": str(ray_dir)}
    # Cluster writes its address file into Ray's default folder whatever temp_dir says
    Path(tempfile.gettempdir(), "ray").mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as env:
        for key, value in RAY_ENV.items():
            env.setenv(key, value)
        # set before the nodes start: their workers (hosts, daemons, tasks) inherit them
        env.setenv(runtime.ENV_RUNTIME_DIR, str(runtime_dir))
        env.setenv("SHMBUFFER_STORAGE_DIR", str(storage_dir))
        env.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        cluster = cluster_utils.Cluster()
        try:
            for _ in range(NODES):  # the first is the head
                cluster.add_node(**node_args)
            ray.init(address=cluster.address, log_to_driver=False)
            cluster.wait_for_nodes()
            nodes = [str(n["NodeID"]) for n in ray.nodes() if n["Alive"]]
            assert len(nodes) == NODES
            yield Sim(nodes, runtime_dir, storage_dir)
        finally:
            ray.shutdown()
            cluster.shutdown()
            for folder in (runtime_dir, ray_dir, storage_dir):
                remove_tree(folder)


@pytest.fixture
def sharded(sim: Sim) -> Iterator[Any]:
    """Factory: ``sharded(capacity, unit, nodes=..., **options)`` creates a ShardedBuffer;
    teardown shuts it down and checks that its daemons, segments and runtime files are gone."""
    made: list[tuple[ShardedBuffer, list[int]]] = []

    def make(capacity: int, unit: str, **kwargs: Any) -> ShardedBuffer:
        name = f"t{uuid.uuid4().hex[:6]}"
        buf = ShardedBuffer.create(name, capacity, unit=unit, ready_timeout=180.0, **kwargs)
        made.append((buf, [s["pid"] for s in buf.shards()]))
        return buf

    try:
        yield make
    finally:
        for buf, pids in made:
            buf.shutdown()
            for pid in pids:
                if runtime.pid_alive(pid):  # a leak must not outlive the test
                    os.kill(pid, signal.SIGKILL)
                    pytest.fail(f"the daemon pid {pid} of {buf.name} survived shutdown()")
            left = [p.name for p in sim.runtime_dir.glob(f"{buf.name}.*")]
            left += [p.name for p in sim.storage_dir.glob(f"{buf.name}.*")]
            assert not left, f"{buf.name} left {left}"


def remove_tree(path: Path) -> None:
    """``rm -r path``, again while Ray's exiting processes still write into it (bounded)."""
    for _ in range(20):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            return
        time.sleep(0.25)


def on(buf: ShardedBuffer, node: str) -> Any:
    return buf.scheduling(node)


def wait_for(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


def check_whole(episode: Any) -> None:
    """One episode as written by ``write_episodes``: every step, in order, of one episode."""
    length = int(episode.batch_size[0])
    assert torch.equal(episode["step"], torch.arange(length))
    assert (episode["episode"] == episode["episode"][0]).all()
    assert (episode["marker"] == episode["marker"][0]).all()
    assert episode["done"].tolist() == [False] * (length - 1) + [True]


# -- writers on each node, a learner across them ------------------------------------------------


def test_writers_on_each_node_and_a_learner_across_them(sim: Sim, sharded: Any) -> None:
    # CURVE on loopback too: the remote shards' frames and the local writes' metadata both
    # go through a CURVE socket, as they would across real nodes.
    buf = sharded(2000, "episode", curve=True, seed=7)
    assert buf.nodes == sim.nodes
    counts = [12, 24, 36]
    done = ray.get(
        [
            work.write_episodes.options(scheduling_strategy=on(buf, node)).remote(buf, i, count)
            for i, (node, count) in enumerate(zip(buf.nodes, counts, strict=True))
        ],
        timeout=300,
    )
    # each writer ran on its own node and wrote through shared memory
    assert [d["node"] for d in done] == buf.nodes
    assert not any(d["remote"] for d in done)
    shards = buf.shards()
    assert [s["episodes"] for s in shards] == counts
    assert [s["node_id"] for s in shards] == buf.nodes
    assert all(s["pid"] and s["endpoint"].startswith("tcp://127.0.0.1:") for s in shards)

    with buf.reader(seed=1) as reader:
        assert len(reader) == sum(counts)
        # the learner's own node is read through shared memory, the others over tcp
        links = {link.index: link for link in reader._links}
        here = ray.get_runtime_context().get_node_id()
        assert [links[i].remote for i in range(NODES)] == [n != here for n in buf.nodes]
        seen: set[tuple[int, int]] = set()
        for _ in range(20):
            with reader.sample_episodes(9) as episodes:
                assert len(episodes) == 9 and episodes.valid()
                for i, episode in enumerate(episodes):
                    check_whole(episode)
                    assert int(episode["marker"][0]) == int(episodes.shards[i])
                    seen.add((int(episodes.shards[i]), int(episode["episode"][0])))
        assert {s for s, _ in seen} == {0, 1, 2}
        batch, info = reader.sample(64, return_info=True)
        assert batch.batch_size == torch.Size([64])
        assert torch.equal(batch["marker"], info["shard"])
        assert ((info["index"] // buf.capacity) == info["shard"]).all()
        slices = reader.sample_slices(16, 4)
        assert slices.batch_size == torch.Size([16, 4])
        assert (slices["step"][:, 1:] - slices["step"][:, :-1] == 1).all()
        assert (slices["marker"] == slices["marker"][:, :1]).all()


def test_placement_least_loaded_and_local_reader(sim: Sim, sharded: Any) -> None:
    here = ray.get_runtime_context().get_node_id()
    other = next(n for n in sim.nodes if n != here)
    buf = sharded(500, "episode", nodes=[here, other])
    assert sorted(buf.least_loaded(4)) == sorted(buf.nodes * 2)
    ray.get(work.write_episodes.options(scheduling_strategy=on(buf, other)).remote(buf, 1, 6))
    assert buf.least_loaded(1) == [here]  # no writer on either now: the emptier shard
    with buf.reader(local=True) as local:  # bound to the shard on this (the driver's) node
        assert local.shards_up == [0]
        with pytest.raises(EmptyBufferError, match="too little"):
            local.sample(4)
    with buf.reader(nodes=[other]) as theirs:
        assert theirs.shards_up == [1] and len(theirs) == 6
        assert theirs.sample(4)["marker"].tolist() == [1, 1, 1, 1]


# -- proportional sampling ----------------------------------------------------------------------


def test_uniform_sampling_is_proportional_to_unequal_shards(sim: Sim, sharded: Any) -> None:
    buf = sharded(1000, "transition")
    sizes = [40, 80, 120]
    firsts = np.cumsum([0, *sizes[:-1]]).tolist()
    ray.get(
        [
            work.write_rows.options(scheduling_strategy=on(buf, node)).remote(buf, i, first, size)
            for i, (node, first, size) in enumerate(zip(buf.nodes, firsts, sizes, strict=True))
        ],
        timeout=300,
    )
    total = sum(sizes)
    with buf.reader(seed=3) as reader:
        per_row = np.zeros(total)
        per_shard = np.zeros(NODES)
        for _ in range(300):
            batch, info = reader.sample(32, return_info=True)
            np.add.at(per_row, batch["row"].numpy(), 1)
            per_shard += np.bincount(info["shard"].numpy(), minlength=NODES)
            np.testing.assert_allclose(info["probability"].numpy(), 1.0 / total)
        draws = per_row.sum()
        shares = np.array(sizes) / total
        assert chi2_p(per_shard, draws * shares) > P_MIN, per_shard
        assert chi2_p(per_row, np.full(total, draws / total)) > P_MIN
        # an equal split would put twice the expected draws on each row of the small shard
        assert per_row[:40].mean() < 1.3 * draws / total


def test_prioritized_sampling_follows_priority_mass(sim: Sim, sharded: Any) -> None:
    buf = sharded(
        500,
        "transition",
        nodes=sim.nodes[:2],
        sampler="prioritized",
        priority_exponent=1.0,
        priority_eps=0.0,
        importance_exponent=0.5,
        seed=11,
    )
    ray.get(
        [
            work.write_rows.options(scheduling_strategy=on(buf, buf.nodes[0])).remote(
                buf, 0, 0, 50, 1.0
            ),
            work.write_rows.options(scheduling_strategy=on(buf, buf.nodes[1])).remote(
                buf, 1, 50, 50, 3.0
            ),
        ],
        timeout=300,
    )
    with buf.reader(seed=5, size_refresh=0.0) as reader:
        per_shard = np.zeros(2)
        for _ in range(200):
            _, info = reader.sample(32, return_info=True)
            shard = info["shard"].numpy()
            per_shard += np.bincount(shard, minlength=2)
            # one sampler over both: P = p / sum(p), weight (P / P_min)^-beta
            want_p = np.where(shard == 0, 1.0, 3.0) / 200.0
            np.testing.assert_allclose(info["probability"].numpy(), want_p, rtol=1e-9)
            want_w = np.where(shard == 0, 1.0, 3.0**-0.5)
            np.testing.assert_allclose(info["weight"].numpy(), want_w, rtol=1e-5)
        assert chi2_p(per_shard, per_shard.sum() * np.array([0.25, 0.75])) > P_MIN, per_shard

        # global indices route back to their shards: shard 1 down to priority 1
        _, info = reader.sample(64, return_info=True)
        assert set(info["index"][info["shard"] == 1].tolist()) <= set(range(500, 550))
        applied = reader.update_priorities(torch.arange(50) + buf.capacity, 1.0)
        assert applied == 50
        per_shard = np.zeros(2)
        for _ in range(200):
            _, info = reader.sample(32, return_info=True)
            per_shard += np.bincount(info["shard"].numpy(), minlength=2)
        assert chi2_p(per_shard, per_shard.sum() * np.array([0.5, 0.5])) > P_MIN, per_shard
        with pytest.raises(ValueError, match="update_priorities"):
            reader.update_priorities([2 * buf.capacity], 1.0)  # past the last shard


# -- FIFO, consume-once -------------------------------------------------------------------------


def test_consume_once_hands_out_every_row_once_across_shards(sim: Sim, sharded: Any) -> None:
    buf = sharded(1000, "transition", nodes=sim.nodes[:2], sampler="fifo", max_times_sampled=1)
    a, b = buf.nodes
    ray.get(
        [
            work.write_rows.options(scheduling_strategy=on(buf, a)).remote(buf, 0, 0, 30),
            work.write_rows.options(scheduling_strategy=on(buf, b)).remote(buf, 1, 100, 50),
        ],
        timeout=300,
    )
    with buf.reader(sample_timeout=3.0, seed=2) as reader:
        assert reader.consumes
        got = [reader.sample(16)["row"] for _ in range(5)]
        rows = torch.cat(got).tolist()
        assert sorted(rows) == list(range(30)) + list(range(100, 150))
        for part in got:  # oldest first within each shard
            for lo, hi in ((0, 30), (100, 150)):
                mine = [r for r in part.tolist() if lo <= r < hi]
                assert mine == sorted(mine)
        with pytest.raises(WaitTimeoutError):
            reader.sample(8)  # nothing left: bounded by sample_timeout
        ray.get(work.write_rows.options(scheduling_strategy=on(buf, a)).remote(buf, 0, 200, 4))
        with pytest.raises(WaitTimeoutError, match="4 of 8"):
            reader.sample(8)  # 4 handed out, kept for the next call
        ray.get(work.write_rows.options(scheduling_strategy=on(buf, b)).remote(buf, 1, 300, 4))
        rows = sorted(reader.sample(8)["row"].tolist())
        assert rows == [200, 201, 202, 203, 300, 301, 302, 303]


# -- failure --------------------------------------------------------------------------------


def test_a_killed_shard_drops_out_and_rejoins_with_nothing_lost(sim: Sim, sharded: Any) -> None:
    buf = sharded(2000, "episode")
    counts = [10, 20, 30]
    ray.get(
        [
            work.write_episodes.options(scheduling_strategy=on(buf, node)).remote(buf, i, count)
            for i, (node, count) in enumerate(zip(buf.nodes, counts, strict=True))
        ],
        timeout=300,
    )
    before = buf.shards()
    victim = 2
    with buf.reader(seed=4, timeout=3.0, rejoin_interval=0.5) as reader:
        reader.sample(32)
        os.kill(before[victim]["pid"], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.warns(ShardUnavailableWarning, match="shard 2"):
            while True:  # the killed daemon's socket may still answer a moment
                batch, info = reader.sample(32, return_info=True)
                if victim not in reader.shards_up:
                    break
        assert time.monotonic() - t0 < 30  # bounded: no learner hangs on a dead shard
        batch, info = reader.sample(32, return_info=True)
        assert batch.batch_size == torch.Size([32]) and not (info["shard"] == victim).any()
        with reader.sample_episodes(12) as episodes:
            for episode in episodes:
                check_whole(episode)

        # the host resumes the daemon: every committed episode is served again
        def back() -> list[dict[str, Any]] | None:
            now = buf.shards()
            return now if now[victim]["alive"] and now[victim]["restarts"] == 1 else None

        after = wait_for(back, 120, "the killed shard's daemon to be resumed")
        assert after[victim]["pid"] != before[victim]["pid"]
        assert [s["episodes"] for s in after] == counts  # surviving shards and the resumed one
        assert [s["rows"] for s in after] == [s["rows"] for s in before]

        def rejoined() -> bool:
            reader.sample(8)
            return victim in reader.shards_up

        wait_for(rejoined, 60, "the shard to rejoin sampling")
        seen = torch.cat([reader.sample(64, return_info=True)[1]["shard"] for _ in range(5)])
        assert (seen == victim).any()
        with reader.sample_episodes(16) as episodes:
            for episode in episodes:
                check_whole(episode)


@pytest.mark.parametrize("victim", [2, 0], ids=["remote-shard", "local-shard"])
def test_no_call_waits_past_its_timeout_when_a_shard_dies_under_it(
    sim: Sim, sharded: Any, victim: int
) -> None:
    """``timeout`` bounds every call, the one in flight when a shard's daemon dies included.
    The daemon is stopped, then killed under a sample whose request it had received, and
    its host resumes a new one on the same endpoint, which answers the reader's liveness
    pings (regression: they were taken for the dead daemon's, and the call waited out
    ``sample_timeout + timeout``). Shard 0 is on this process's node (the lane), shard 2 on
    another (tcp)."""
    timeout = 3.0
    buf = sharded(2000, "episode")
    ray.get(
        [
            work.write_episodes.options(scheduling_strategy=on(buf, node)).remote(buf, i, 10)
            for i, node in enumerate(buf.nodes)
        ],
        timeout=300,
    )
    pid = buf.shards()[victim]["pid"]
    with buf.reader(seed=4, timeout=timeout, rejoin_interval=60.0) as reader:
        reader.sample(32)
        reader.sample(32)  # every shard has answered a sample: its stats are known
        os.kill(pid, signal.SIGSTOP)  # what it is sent now, it will never answer
        killer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))
        killer.start()
        took = []
        try:
            with pytest.warns(ShardUnavailableWarning, match=f"shard {victim}"):
                while victim in reader.shards_up and len(took) < 20:
                    began = time.monotonic()
                    batch = reader.sample(32)
                    took.append(time.monotonic() - began)
                    assert batch.batch_size == torch.Size([32])
        finally:
            killer.join()
        assert victim not in reader.shards_up, took
        # beyond the wait on the dead shard a call's work is milliseconds: the margin is the
        # machine's scheduling
        assert max(took) <= timeout + 1.0, took


def test_shutdown_leaves_no_process_segment_or_file(sim: Sim) -> None:
    buf = ShardedBuffer.create(f"t{uuid.uuid4().hex[:6]}", 500, unit="episode", ready_timeout=180)
    try:
        ray.get(
            [
                work.write_episodes.options(scheduling_strategy=on(buf, n)).remote(buf, 0, 3)
                for n in buf.nodes
            ],
            timeout=300,
        )
        shards = buf.shards()
        pids = [s["pid"] for s in shards]
        assert all(runtime.pid_alive(pid) for pid in pids)
        assert len(list(sim.storage_dir.glob(f"{buf.name}.*"))) == NODES
    finally:
        buf.shutdown()
    assert not any(runtime.pid_alive(pid) for pid in pids)
    assert not list(sim.storage_dir.glob(f"{buf.name}.*"))
    assert not list(sim.runtime_dir.glob(f"{buf.name}.*"))

    def hosts_gone() -> bool:  # ray.kill is asynchronous: a call right after may still run
        for shard in buf.shard_list():
            try:
                ray.get(shard.actor.info.remote(), timeout=30)
            except ray.exceptions.RayActorError:
                continue
            return False
        return True

    wait_for(hosts_gone, 60, "the shard hosts to be gone")
    with contextlib.suppress(Exception):
        buf.shutdown()  # twice is harmless
