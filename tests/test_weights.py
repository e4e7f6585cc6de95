"""The weights channel (``shmbuffer/weights.py``): layout checks, versions, the seqlock, and a
second process that publishes while this one reads and must never see a torn state."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from shmbuffer.errors import SchemaError, SegmentError, SegmentNotFoundError, WaitTimeoutError
from shmbuffer.storage.schema import Schema
from shmbuffer.storage.segment import Segment
from shmbuffer.weights import WeightsPublisher, WeightsSubscriber

CHILD_TIMEOUT_S = 30.0


@pytest.fixture
def storage(tmp_path: Path) -> Iterator[Path]:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        root = shm / f"shmbuffer-test-{uuid.uuid4().hex}"
    else:
        root = tmp_path / "shm"
    try:
        yield root / "shmbuffer"
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def name() -> str:
    return f"w-{uuid.uuid4().hex[:12]}.weights"


def mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 2)
    )


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_module_round_trip_and_versions(storage: Path, name: str) -> None:
    learner, worker = mlp(0), mlp(1)
    with (
        WeightsPublisher(name, learner, storage_dir=storage) as pub,
        WeightsSubscriber(name, storage_dir=storage) as sub,
    ):
        assert pub.version == sub.version == 1  # the constructor publishes once
        assert sub.seen == 0 and sub.changed()
        assert sub.poll(worker) and sub.seen == 1 and same(learner, worker)
        assert not sub.poll(worker) and not sub.changed()  # nothing new: nothing copied
        with torch.no_grad():
            for p in learner.parameters():
                p.add_(1.0)
        assert not same(learner, worker)
        assert pub.publish(learner) == 2 and sub.version == 2
        assert sub.poll(worker) and same(learner, worker)  # parameters and buffers (BN stats)
        version, copy = sub.read()
        assert version == 2 and set(copy) == set(learner.state_dict())
        assert torch.equal(copy["3.weight"], learner.state_dict()["3.weight"])


def test_poll_into_a_state_dict(storage: Path, name: str) -> None:
    state = {"w": torch.arange(6.0).reshape(2, 3), "step": torch.tensor(7, dtype=torch.int64)}
    with (
        WeightsPublisher(name, state, storage_dir=storage),
        WeightsSubscriber(name, storage_dir=storage) as sub,
    ):
        target = {"w": torch.zeros(2, 3), "step": torch.tensor(0, dtype=torch.int64)}
        assert sub.poll(target)
        assert torch.equal(target["w"], state["w"]) and int(target["step"]) == 7


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"w": torch.zeros(3, 2)}, "entry 'w' is float32[3, 2], the channel holds float32[2, 3]"),
        ({"w": torch.zeros(2, 3, dtype=torch.float64)}, "entry 'w' is float64[2, 3]"),
        ({}, "missing ['w']"),
        ({"w": torch.zeros(2, 3), "extra": torch.zeros(1)}, "not in the channel ['extra']"),
    ],
)
def test_layout_mismatch_is_refused_naming_the_entry(
    storage: Path, name: str, bad: dict[str, torch.Tensor], message: str
) -> None:
    with (
        WeightsPublisher(name, {"w": torch.ones(2, 3)}, storage_dir=storage) as pub,
        WeightsSubscriber(name, storage_dir=storage) as sub,
    ):
        with pytest.raises(SchemaError) as err:
            pub.publish(bad)
        assert message in str(err.value) and name in str(err.value)
        assert pub.version == 1  # nothing was written
        with pytest.raises(SchemaError, match="the target"):
            sub.poll(bad)
        assert sub.seen == 0  # a refused poll copies nothing and does not count


def test_bad_states_are_refused(storage: Path, name: str) -> None:
    with pytest.raises(SchemaError, match="no tensors"):
        WeightsPublisher(name, {}, storage_dir=storage)
    with pytest.raises(TypeError, match=r"entry 'w': expected a torch\.Tensor, got list"):
        WeightsPublisher(name, {"w": [1.0, 2.0]}, storage_dir=storage)  # type: ignore[dict-item]
    with pytest.raises(SchemaError, match=r"entry 'n' is torch\.uint32, which a segment cannot"):
        WeightsPublisher(name, {"n": torch.zeros(2, dtype=torch.uint32)}, storage_dir=storage)
    assert not Segment.exists(name, storage)


def test_close_unlinks_and_subscribers_keep_their_copy(storage: Path, name: str) -> None:
    target = {"w": torch.zeros(4)}
    pub = WeightsPublisher(name, {"w": torch.ones(4)}, storage_dir=storage)
    sub = WeightsSubscriber(name, storage_dir=storage)
    assert sub.poll(target)
    pub.close()
    pub.close()  # safe twice
    assert not Segment.exists(name, storage)
    with pytest.raises(SegmentError, match="closed"):
        pub.publish({"w": torch.zeros(4)})
    assert torch.equal(target["w"], torch.ones(4)) and not sub.poll(target)
    sub.close()
    sub.close()


def test_name_taken_and_exist_ok(storage: Path, name: str) -> None:
    with WeightsPublisher(name, {"w": torch.ones(1)}, storage_dir=storage):
        with pytest.raises(SegmentError, match="already exists"):
            WeightsPublisher(name, {"w": torch.ones(1)}, storage_dir=storage)
        # a publisher that died leaves its channel; exist_ok replaces it
        with (
            WeightsPublisher(name, {"v": torch.zeros(2)}, storage_dir=storage, exist_ok=True),
            WeightsSubscriber(name, storage_dir=storage) as sub,
        ):
            assert sub.names == ["v"]


def test_subscriber_waits_then_fails_clearly(storage: Path, name: str) -> None:
    start = time.monotonic()
    with pytest.raises(SegmentNotFoundError, match=f"weights channel {name!r}: not available"):
        WeightsSubscriber(name, timeout=0.2, storage_dir=storage)
    assert time.monotonic() - start < 5.0


def test_a_buffer_segment_is_not_a_weights_channel(storage: Path, name: str) -> None:
    schema = Schema.from_batch({"obs": torch.zeros(1, 3)})
    with (
        Segment.create(name, schema, 4, storage_dir=storage),
        pytest.raises(SegmentError, match="is not a weights channel"),
    ):
        WeightsSubscriber(name, timeout=0.0, storage_dir=storage)


def test_a_publication_in_progress_is_never_offered(storage: Path, name: str) -> None:
    """An odd seq is what a publisher that died mid-copy leaves: ``poll`` returns at once
    without touching the target, ``read`` times out, and the next publication recovers."""
    target = {"w": torch.zeros(3)}
    with (
        WeightsPublisher(name, {"w": torch.ones(3)}, storage_dir=storage) as pub,
        WeightsSubscriber(name, storage_dir=storage) as sub,
    ):
        pub._seq[0] += 1  # odd: "being written"
        pub.views["w"].fill_(5.0)  # half-written data that must not be offered
        start = time.monotonic()
        assert not sub.poll(target) and sub.seen == 0
        assert torch.equal(target["w"], torch.zeros(3))
        with pytest.raises(WaitTimeoutError, match="no clean copy"):
            sub.read(timeout=0.05)
        assert time.monotonic() - start < 5.0
        assert pub.publish({"w": torch.full((3,), 2.0)}) == 2
        assert sub.poll(target) and torch.equal(target["w"], torch.full((3,), 2.0))


# -- two processes --------------------------------------------------------------------------

PATTERN = {"big": (256, 1024), "small": (1000,), "scalar": ()}  # 1 MiB: copies overlap


def _publisher(name: str, storage: str, ready: Any, stop: Any, errors: Any) -> None:
    """Child: publish version k with every element of every tensor equal to k until told to
    stop; back to back, with a short pause every third one (as a learner between updates), so
    that copies overlap publications often and still finish cleanly often."""
    try:
        torch.set_num_threads(1)  # intra-op threads on a busy 2-core machine: 70x slower copies
        state = {k: torch.full(s, 1.0) for k, s in PATTERN.items()}
        with WeightsPublisher(name, state, storage_dir=storage) as pub:
            ready.set()
            k = 1
            deadline = time.monotonic() + CHILD_TIMEOUT_S
            while not stop.is_set() and time.monotonic() < deadline:
                k += 1
                for t in state.values():
                    t.fill_(float(k))
                got = pub.publish(state)
                if got != k:
                    errors.put(f"publish returned version {got}, expected {k}")
                    return
                if k % 3 == 0:
                    time.sleep(0.001)
            stop.wait(CHILD_TIMEOUT_S)  # keep the channel until the reader is done
    except BaseException as e:
        errors.put(repr(e))
        raise


def test_reader_in_another_process_never_sees_a_torn_state(storage: Path, name: str) -> None:
    ctx = mp.get_context("spawn")
    ready, stop, errors = ctx.Event(), ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_publisher, args=(name, str(storage), ready, stop, errors))
    child.start()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert ready.wait(CHILD_TIMEOUT_S), "publisher did not start"
        target = {k: torch.zeros(s) for k, s in PATTERN.items()}
        copies, raw_torn, last = 0, 0, 0
        with WeightsSubscriber(name, storage_dir=storage) as sub:
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline or copies < 20:
                assert time.monotonic() < deadline + CHILD_TIMEOUT_S, "too few copies"
                if sub.poll(target):
                    copies += 1
                    values = torch.cat([t.reshape(-1) for t in target.values()])
                    lo, hi = float(values.min()), float(values.max())
                    assert lo == hi == sub.seen, f"torn: values {lo}..{hi} as version {sub.seen}"
                    assert sub.seen > last  # versions only go forward
                    last = sub.seen
                # The same copy without the seqlock, to show the test can see tearing.
                raw = torch.cat([v.reshape(-1) for v in sub.views.values()])
                raw_torn += int(raw.min() != raw.max())
                time.sleep(0.0002)  # a worker steps between polls; leave the publisher a core
        stop.set()
        child.join(CHILD_TIMEOUT_S)
        assert errors.empty(), errors.get()
        assert child.exitcode == 0
        assert last > copies // 2  # the publisher really moved on between copies
        print(f"{copies} clean copies up to version {last}; {raw_torn} unprotected copies torn")
    finally:
        torch.set_num_threads(threads)
        stop.set()
        child.join(5.0)
        if child.is_alive():
            child.kill()
            child.join(5.0)
