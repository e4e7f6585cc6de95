"""TorchRL's own ReplayBuffer over a real daemon (``shmbuffer.torchrl``), in real processes.

Buffer objects are built here and pickled into a spawned child (which opens its own shmbuffer
clients), as a job's processes would get them. One prioritized daemon serves it all (the
client-side samplers do not ask the daemon's sampler; DaemonSampler does):

- the child, an env worker, ``extend``s episodes while this process (the learner) samples;
  then ``len``, ``sample(return_info=True)``, reads by index, and TorchRL's RandomSampler,
  SamplerWithoutReplacement and SliceSampler (by trajectory key and by end key) over a ring
  that has wrapped round;
- the child, now a second learner, ``update_priority``s through DaemonSampler, which changes
  what this learner samples (a priority 10**12 times the others': certain, not likely);
- a forked child writes through this process's already used buffer; bad input gets an error
  naming what to use instead.

One spawned child for all of it: starting one (torch, TorchRL) is most of the test's time.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import pickle
import queue
import sys
import time
import warnings
from typing import Any

import pytest

pytest.importorskip("torchrl", reason="shmbuffer.torchrl needs the [torchrl] extra")

import torch
from tensordict import TensorDict
from torchrl.data import (
    LazyTensorStorage,
    ReplayBuffer,
    RoundRobinWriter,
    SamplerWithoutReplacement,
    SliceSampler,
    TensorDictReplayBuffer,
)

from shmbuffer.errors import SchemaError
from shmbuffer.torchrl import DaemonSampler, DaemonStorage, DaemonWriter
from tests.e2e import _torchrl_workers as workers
from tests.e2e.conftest import Children, Env

pytestmark = pytest.mark.timeout(120)

CAPACITY = 256
EPISODES = 50  # 427 rows: the ring wraps round
HOT = 42  # the row the second learner makes all but certain


def spawn(children: Children, env: Env, tag: str, fn: str, *args: Any) -> Any:
    """Run ``_torchrl_workers.<fn>(*args)`` in a spawned process the fixture cleans up."""
    proc = children.ctx.Process(
        target=workers.entry,
        args=(str(env.runtime_dir), children.results, tag, fn, args),
        daemon=True,
    )
    proc.start()
    children.procs.append(proc)
    return proc


def message(children: Children) -> tuple[str, Any] | None:
    """The child's next ``(status, value)`` if there is one (its error fails the test)."""
    try:
        tag, status, value = children.results.get(timeout=0.001)
    except queue.Empty:
        return None
    if status == "error":
        pytest.fail(f"child {tag} failed:\n{value}")
    return status, value


def check_rows(data: TensorDict) -> None:
    """Every row whole and itself: ``obs`` repeats ``id``."""
    assert data.batch_size[0] > 0
    assert torch.equal(data["obs"], data["id"].to(torch.float32)[:, None].expand(-1, 3))


def check_slices(data: TensorDict, num_slices: int) -> None:
    """Each slice is consecutive steps of one episode."""
    check_rows(data)
    ids = data["id"].view(num_slices, -1)
    episodes = data["episode"].view(num_slices, -1)
    assert (ids[:, 1:] - ids[:, :-1] == 1).all(), ids
    assert (episodes == episodes[:, :1]).all(), episodes


def test_workers_extend_learners_sample_and_share_priorities(
    daemon: Any, e2e_env: Env, children: Children
) -> None:
    d = daemon(
        capacity=CAPACITY,
        unit="transition",
        args=["--sampler", "prioritized", "--seed", "7"],
    )
    storage = DaemonStorage(d.name)
    # The worker's writes gather and commit in the background; TorchRL's RandomSampler.
    rb = ReplayBuffer(storage=storage, writer=DaemonWriter(flush=False), batch_size=32)
    prioritized = ReplayBuffer(
        storage=storage, writer=DaemonWriter(), sampler=DaemonSampler(), batch_size=512
    )
    go = children.ctx.Queue()
    try:
        spawn(children, e2e_env, "job", "worker_then_learner", rb, prioritized, go, EPISODES)

        # Learner: sample while the worker writes; every row checks out, never torn.
        samples, got = 0, None
        while got is None:
            if len(rb):
                check_rows(rb.sample())
                samples += 1
            else:
                time.sleep(0.01)
            got = message(children)
        assert got[0] == "written", got
        written = got[1]
        assert written == sum(workers.lengths(EPISODES)) > CAPACITY
        assert len(rb) == CAPACITY == storage.max_size  # a full ring, as TorchRL's
        assert samples > 0

        everything = storage[:]
        check_rows(everything)
        stored = sorted(everything["id"].tolist())
        assert stored == list(range(written - CAPACITY, written))  # the newest rows

        data, info = rb.sample(return_info=True)
        check_rows(data)
        assert torch.equal(rb[info["index"]]["id"], data["id"])  # indices are storage rows

        # Without replacement: 8 batches of 32 cover the 256 stored rows exactly once.
        rb.set_sampler(SamplerWithoutReplacement(drop_last=True))
        seen = torch.cat([rb.sample()["id"] for _ in range(CAPACITY // 32)])
        assert sorted(seen.tolist()) == stored

        # Slices, by trajectory key and by end key, over a ring that wrapped round.
        for sampler in (
            SliceSampler(slice_len=4, traj_key="episode"),
            SliceSampler(slice_len=4, end_key=("next", "done")),
        ):
            rb.set_sampler(sampler)
            for _ in range(20):
                check_slices(rb.sample(), num_slices=8)

        # The daemon's prioritized sampler: every row at the default priority so far.
        before, info = prioritized.sample(return_info=True)
        check_rows(before)
        assert set(info) >= {"index", "priority_weight", "probability", "generation"}
        assert torch.equal(storage[info["index"]]["id"], before["id"])
        assert (info["index"] == HOT).sum() < 64  # 2 expected of 512

        # The child, now a second learner, updates priorities; this process never does.
        go.put(HOT)
        result = children.collect({"job"}, timeout=60)["job"]
        assert result == {"len": CAPACITY, "sampled": 512, "index_max": CAPACITY - 1}
        after, info = prioritized.sample(return_info=True)
        assert (info["index"] == HOT).sum() >= 500  # ~0.001 of a row expected elsewhere
        assert (after["id"] == storage[HOT]["id"]).sum() >= 500
        weights = info["priority_weight"]
        assert weights.dtype == torch.float32 and bool(((weights > 0) & (weights <= 1)).all())

        # TorchRL's TensorDictReplayBuffer writes the info into the sampled TensorDict.
        td_rb = TensorDictReplayBuffer(
            storage=storage, writer=DaemonWriter(), sampler=DaemonSampler(), batch_size=8
        )
        sample = td_rb.sample()
        assert {"index", "priority_weight", "generation"} <= set(sample.keys())
        assert torch.equal(sample["id"], storage[sample["index"]]["id"])

        # A forked child writes through this process's (already used) buffer. (Python 3.12+
        # warns about forking a process with threads, here ZeroMQ's: the point of the test.)
        child = mp.get_context("fork").Process(target=workers.fork_extend, args=(rb, 999, 10**6, 6))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            child.start()
        child.join(30)
        assert child.exitcode == 0
        assert int((storage[:]["id"] >= 10**6).sum()) == 6

        # TorchRL's own cursor writer, its cursor (0) not the ring's pointer: it changes the
        # rows there in place, as over TorchRL's own storages; the ring's pointer stays.
        pointer = storage.writer.conn.call("stats")["stats"]["pointer"]
        own_cursor = ReplayBuffer(storage=storage, writer=RoundRobinWriter(), batch_size=8)
        own_cursor.extend(TensorDict({"id": torch.arange(3) - 7}, [3]))
        assert storage[:3]["id"].tolist() == [-7, -6, -5]
        assert storage.writer.conn.call("stats")["stats"]["pointer"] == pointer
        rb.empty()  # the whole daemon buffer, for every process (test_torchrl_saving.py)
        assert len(storage) == 0
    finally:
        storage.close()


def test_bad_input_names_what_to_use() -> None:
    with pytest.raises(TypeError, match="DaemonStorage"):
        ReplayBuffer(storage=LazyTensorStorage(10), writer=DaemonWriter())
    rb = ReplayBuffer(storage=LazyTensorStorage(10), sampler=DaemonSampler(), batch_size=2)
    rb.extend(TensorDict({"id": torch.arange(4)}, [4]))
    with pytest.raises(TypeError, match="DaemonStorage"):
        rb.sample()
    with pytest.raises(TypeError, match=r"'prefetc' is not an argument of shmbuffer\.Reader"):
        DaemonStorage("x", reader_options={"prefetc": True})
    with pytest.raises(TypeError, match="flush must be True or False"):
        DaemonWriter(flush=1)  # type: ignore[arg-type]


def test_without_torchrl_the_import_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m.startswith("shmbuffer.torchrl")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchrl", None)  # what an absent package looks like
    with pytest.raises(ImportError, match=r"pip install 'shmbuffer\[torchrl\]'"):
        importlib.import_module("shmbuffer.torchrl")


@pytest.mark.slow
def test_remote_storage_priority_column_bare_tensors_and_episode_unit_refused(
    daemon: Any,
) -> None:
    d = daemon(
        capacity=64,
        unit="transition",
        args=["--endpoint", "tcp://127.0.0.1:0", "--sampler", "prioritized", "--seed", "1"],
    )
    storage = DaemonStorage(d.endpoint, remote=True)
    try:
        rb = ReplayBuffer(storage=storage, writer=DaemonWriter(), batch_size=16)
        rb.extend(workers.episode(0, 0, 40))  # rows travel as frames both ways
        assert storage.reader.remote and len(rb) == 40
        check_rows(rb.sample())
        assert storage[:]["id"].tolist() == list(range(40))
        rb.set_sampler(SliceSampler(slice_len=4, traj_key="episode"))
        check_slices(rb.sample(), num_slices=4)
        rb.set_sampler(DaemonSampler())
        data, info = rb.sample(return_info=True)
        assert torch.equal(data["id"], info["index"])
        # Priorities written with the rows: one row 10**12 times the other new ones, ~4000
        # times the 40 old ones at the default priority 1 (priority ** 0.6).
        fresh = workers.episode(1, 40, 24)
        fresh["td_error"] = torch.full((24,), 1e-6)
        fresh["td_error"][5] = 1e6
        prioritized = ReplayBuffer(
            storage=storage,
            writer=DaemonWriter(priority_key="td_error"),
            sampler=DaemonSampler(),
            batch_size=512,
        )
        prioritized.extend(fresh)
        assert (prioritized.sample()["id"] == 45).sum() >= 450  # 507 expected
    finally:
        storage.close()

    bare = daemon(capacity=16, unit="transition")
    storage = DaemonStorage(bare.name)
    try:
        rb = ReplayBuffer(storage=storage, writer=DaemonWriter(), batch_size=4)
        rb.extend(torch.arange(12.0)[:, None].expand(12, 2))
        rb.add(torch.tensor([12.0, 12.0]))
        assert torch.equal(storage[12], torch.tensor([12.0, 12.0]))
        sample = rb.sample()
        assert isinstance(sample, torch.Tensor) and sample.shape == (4, 2)
    finally:
        storage.close()

    episodic = daemon(capacity=64, unit="episode")
    storage = DaemonStorage(episodic.name)
    try:
        with pytest.raises(ValueError, match="--unit transition"):
            len(storage)
    finally:
        storage.close()


def test_in_place_writes_change_the_daemon_s_rows(daemon: Any) -> None:
    """``rb.set_at_``/``set_``/``update_`` edit a copy of the rows (``storage[:]``), then say
    so: the rows edited are rewritten in the daemon, as is ``rb[i] = x``; nothing is added."""
    storage = DaemonStorage(daemon(capacity=16, unit="transition").name)
    try:
        rb = ReplayBuffer(storage=storage, writer=DaemonWriter(), batch_size=2)
        rb.extend(TensorDict({"a": torch.arange(4.0)[:, None]}, [4]))
        rb.set_at_("a", torch.full((2, 1), 9.0), [0, 1])
        assert storage[:]["a"].flatten().tolist() == [9.0, 9.0, 2.0, 3.0]
        rb.set_("a", torch.full((4, 1), 8.0))
        assert storage[:]["a"].flatten().tolist() == [8.0] * 4
        rb.update_({"a": torch.arange(4.0)[:, None] + 1})
        rb[0] = TensorDict({"a": torch.zeros(1)}, [])
        assert storage[:]["a"].flatten().tolist() == [0.0, 2.0, 3.0, 4.0]
        assert len(rb) == 4
        assert len(pickle.loads(pickle.dumps(rb))) == 4  # picklable (settings only)
    finally:
        storage.close()


def test_tensordict_rows_keep_their_own_batch_size(daemon: Any) -> None:
    """A row that is a TensorDict of batch size ``[2]`` reads back as one, by index, slice
    and through either sampler, in this process and any other (the size is in the schema)."""
    name = daemon(capacity=16, unit="transition", args=["--sampler", "prioritized"]).name
    storage = DaemonStorage(name)
    try:
        rb = ReplayBuffer(storage=storage, writer=DaemonWriter(), batch_size=3)
        rows = TensorDict({"a": torch.arange(6.0).reshape(3, 2), "b": torch.zeros(3, 2, 4)}, [3, 2])
        rb.extend([rows[0]])  # a list of rows is stacked: batch size [1, 2]
        with pytest.warns(UserWarning, match="add"):  # TorchRL's, for a row of batch size [2]
            rb.add(rows[1])
        rb.extend(rows[2:])
        assert storage[0].batch_size == (2,)
        assert storage[:].batch_size == (3, 2)
        assert torch.equal(storage[:]["a"], rows["a"])
        assert rb.sample().batch_size == (3, 2)
        rb.set_sampler(DaemonSampler())
        assert rb.sample().batch_size == (3, 2)
        other = DaemonStorage(name)  # a second client learns the size from the daemon
        try:
            assert other[[2, 1]].batch_size == (2, 2)
        finally:
            other.close()
        with pytest.raises(SchemaError, match=r"batch size \[2\].*\[3\]"):
            rb.extend(TensorDict({"a": torch.zeros(1, 3), "b": torch.zeros(1, 3, 4)}, [1, 3]))
    finally:
        storage.close()


def test_rows_missing_keys_are_refused_naming_them(daemon: Any) -> None:
    storage = DaemonStorage(daemon(capacity=16, unit="transition").name)
    try:
        rb = ReplayBuffer(storage=storage, writer=DaemonWriter(), batch_size=2)
        rb.extend({"a": torch.zeros(2, 1), "next": {"reward": torch.zeros(2, 1)}})
        # A shared schema has no value to fill a missing key with: refused, naming it.
        with pytest.raises(SchemaError, match=r"missing keys: \['next\.reward'\]"):
            rb.extend(TensorDict({"a": torch.zeros(2, 1)}, [2]))
        rb.extend([{"a": torch.ones(1), "next": {"reward": torch.ones(1)}}] * 2)  # stacked
        assert storage[2:]["a"].tolist() == [[1.0], [1.0]]
        assert len(rb) == 4  # nothing of a refused batch was stored
    finally:
        storage.close()
