"""BufferService driven directly (no sockets): every op, ownership, deferral, TTLs, limits."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shmbuffer.daemon.config import DaemonConfig
from shmbuffer.daemon.service import BufferService, Deferred
from shmbuffer.errors import (
    CapacityError,
    EmptyBufferError,
    LimitExceededError,
    NotFoundError,
    PermissionDeniedError,
    ProtocolError,
    SchemaError,
    UnknownClientError,
)
from shmbuffer.storage.schema import Schema
from shmbuffer.storage.segment import Segment
from shmbuffer.wire.protocol import PROTOCOL_VERSION, validate_request
from shmbuffer.wire.protocol import request as make_request

W, W2, R, ADMIN = b"writer-1", b"writer-2", b"reader-1", b"admin-1"
SPEC = {"obs": {"dtype": "float32", "shape": [3]}, "act": {"dtype": "int64", "shape": []}}


def i64(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i8")


@pytest.fixture
def storage() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="shmbuffer-test-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Harness:
    def __init__(self, storage: str, **config: Any) -> None:
        config.setdefault("capacity", 16)
        self.config = DaemonConfig(
            name=f"svc-{uuid.uuid4().hex[:10]}", storage_dir=storage, seed=0, **config
        )
        self.service = BufferService(self.config)
        self.now = 0.0

    def call(
        self, who: bytes, op: str, frames: list[Any] | None = None, **fields: Any
    ) -> tuple[dict[str, Any], list[Any]]:
        # go through validation exactly as the server does
        checked = validate_request(make_request(op, 1, **fields))
        return self.service.handle(who, op, checked, frames or [], self.now)

    def __call__(self, who: bytes, op: str, **fields: Any) -> dict[str, Any]:
        return self.call(who, op, **fields)[0]

    def hello(self, who: bytes, role: str = "writer", **extra: Any) -> int:
        return int(self(who, "hello", role=role, pid=1, host="test-host", **extra)["client"])

    @property
    def segment(self) -> Segment:
        assert self.service.segment is not None
        return self.service.segment

    def fill(self, ranges: list[list[int]], value: float) -> None:
        for start, stop in ranges:
            self.segment.columns[("obs",)][start:stop] = value
            self.segment.columns[("act",)][start:stop] = int(value)

    def write(self, who: bytes, rows: int, value: float, **fields: Any) -> list[int]:
        rep = self(who, "reserve", rows=rows, **fields)
        self.fill(rep["ranges"], value)
        return list(self(who, "commit", reservation=rep["reservation"])["episodes"])

    def close(self) -> None:
        if self.service.segment is not None:
            self.service.segment.close()
        Segment.unlink(self.config.name, self.config.storage_dir)


@pytest.fixture
def h(storage: str) -> Iterator[Harness]:
    harness = Harness(storage)
    harness.hello(W)
    harness(W, "define_schema", schema=SPEC)
    harness.hello(R, "reader")
    yield harness
    harness.close()


@pytest.fixture
def make(storage: str) -> Iterator[Any]:
    made: list[Harness] = []

    def factory(**config: Any) -> Harness:
        harness = Harness(storage, **config)
        made.append(harness)
        return harness

    yield factory
    for harness in made:
        harness.close()


# -- clients ---------------------------------------------------------------------------------


def test_hello_reply_and_idempotence(make: Any) -> None:
    h = make()
    rep = h(W, "hello", role="writer", pid=7, host="x")
    assert rep["client"] == 1
    buf = rep["buffer"]
    assert buf["capacity"] == 16 and buf["unit"] == "transition" and buf["mode"] == "circular"
    assert buf["schema"] is None and buf["segment"] is None
    assert {"name", "lease_ttl", "reservation_ttl"} <= buf.keys()
    assert isinstance(rep["daemon_pid"], int)
    assert h(W, "hello", role="writer", pid=7, host="x")["client"] == 1
    assert h(W2, "hello", role="writer", pid=8, host="x")["client"] == 2


def test_ping_needs_no_hello(make: Any) -> None:
    rep = make()(b"stranger", "ping")
    assert rep["protocol"] == PROTOCOL_VERSION and isinstance(rep["pid"], int)


@pytest.mark.parametrize("op", ["stats", "define_schema", "reserve", "sample", "bye", "clear"])
def test_op_before_hello_is_refused(h: Harness, op: str) -> None:
    by_op: dict[str, dict[str, Any]] = {
        "define_schema": {"schema": SPEC},
        "reserve": {"rows": 1},
        "sample": {"kind": "rows", "n": 1},
    }
    fields = by_op.get(op, {})
    with pytest.raises(UnknownClientError, match="hello"):
        h(b"stranger", op, **fields)


def test_max_clients(make: Any) -> None:
    h = make(max_clients=2)
    h.hello(W)
    h.hello(W2)
    with pytest.raises(LimitExceededError):
        h.hello(R)
    h.hello(W)  # a known identity is not a new client


def test_bye_forgets_client(h: Harness) -> None:
    h(W, "reserve", rows=2)
    h(W, "bye")
    assert W not in h.service.clients
    assert h.service.container.reservations == {}
    with pytest.raises(UnknownClientError):
        h(W, "stats")


# -- schema ----------------------------------------------------------------------------------


def test_define_schema(make: Any) -> None:
    h = make()
    h.hello(W)
    with pytest.raises(SchemaError, match="define_schema"):
        h(W, "reserve", rows=1)
    rep = h(W, "define_schema", schema=SPEC)
    assert rep["buffer"]["schema"] == Schema.from_spec(SPEC).to_spec()
    assert rep["buffer"]["segment"]["name"] == h.config.name
    assert h.service.generations is h.segment.generations
    assert h(W, "define_schema", schema=dict(reversed(SPEC.items())))["buffer"] == rep["buffer"]
    with pytest.raises(SchemaError):
        h(W, "define_schema", schema={"obs": {"dtype": "float64", "shape": [3]}})
    with pytest.raises(SchemaError):
        h(W, "define_schema", schema={"obs": {"dtype": "nope"}})


def test_define_schema_non_string_dtype_is_a_schema_error(make: Any) -> None:
    h = make()
    h.hello(W)
    with pytest.raises(SchemaError):
        h(W, "define_schema", schema={"obs": {"dtype": 5, "shape": []}})


# -- writing ---------------------------------------------------------------------------------


def test_reserve_write_commit_sample_rows(h: Harness) -> None:
    rep = h(W, "reserve", rows=4)
    assert rep["reservation"] >= 1 and rep["ranges"] == [[0, 4]]
    assert "committed" not in rep
    # nothing is visible before the commit
    with pytest.raises(EmptyBufferError):
        h(R, "sample", kind="rows", n=1)
    h.fill(rep["ranges"], 5.0)
    assert h(W, "commit", reservation=rep["reservation"]) == {"episodes": [0]}
    out = h(R, "sample", kind="rows", n=32)
    rows = i64(out["rows"])
    assert rows.shape == (32,) and set(rows.tolist()) <= {0, 1, 2, 3}
    assert i64(out["gens"]).tolist() == [1] * 32
    assert (h.segment.columns[("obs",)][torch.from_numpy(rows.copy())] == 5.0).all()
    # use counters count every sampled row
    assert int(h.service.container.use_counts[:4].sum()) == 32


def test_reserve_with_commit_piggyback(h: Harness) -> None:
    first = h(W, "reserve", rows=3)
    h.fill(first["ranges"], 1.0)
    second = h(W, "reserve", rows=3, commit=first["reservation"])
    assert second["committed"] == [0]
    assert second["ranges"] == [[3, 6]]
    assert h.service.container.num_rows == 3
    assert h(W, "commit", reservation=second["reservation"]) == {"episodes": [1]}
    with pytest.raises(NotFoundError):  # already committed
        h(W, "reserve", rows=1, commit=first["reservation"])


def test_episodes_of_unequal_lengths_in_one_reservation(h: Harness) -> None:
    assert h.write(W, 6, 1.0, lengths=[1, 3, 2]) == [0, 1, 2]
    assert [(e.start, e.end) for e in h.service.container.registry] == [(0, 1), (1, 4), (4, 6)]
    for bad, match in [
        ({"lengths": [2, 2]}, "adds up to 4"),
        ({"lengths": [0, 6]}, "positive ints"),
        ({"lengths": []}, "positive ints"),
        ({"lengths": [3, 3], "episodes": 2}, "exclusive"),
        ({"lengths": ["3", 3]}, "positive ints"),
    ]:
        with pytest.raises(ProtocolError, match=match):
            h(W, "reserve", rows=6, **bad)
    assert h.service.container.reservations == {}  # nothing reserved by a refused request


def test_sub_episodes(h: Harness) -> None:
    assert h.write(W, 6, 1.0, episodes=3) == [0, 1, 2]
    out = h(R, "sample", kind="episodes", n=20)
    assert set(i64(out["lengths"]).tolist()) == {2}
    assert set(i64(out["starts"]).tolist()) <= {0, 2, 4}


def test_indivisible_sub_episodes_is_a_typed_error(h: Harness) -> None:
    from shmbuffer.errors import ShmBufferError

    with pytest.raises(ShmBufferError):
        h(W, "reserve", rows=5, episodes=2)


def test_reserve_too_large(h: Harness) -> None:
    with pytest.raises(CapacityError):
        h(W, "reserve", rows=17)


def test_ownership(h: Harness) -> None:
    h.hello(W2)
    rep = h(W, "reserve", rows=2)
    rid = rep["reservation"]
    with pytest.raises(PermissionDeniedError):
        h(W2, "commit", reservation=rid)
    with pytest.raises(PermissionDeniedError):
        h(W2, "abort", reservation=rid)
    with pytest.raises(PermissionDeniedError):
        h(W2, "reserve", rows=1, commit=rid)
    assert rid in h.service.container.reservations
    assert h(W, "commit", reservation=rid) == {"episodes": [0]}


def test_unknown_reservation(h: Harness) -> None:
    with pytest.raises(NotFoundError):
        h(W, "commit", reservation=999)
    with pytest.raises(NotFoundError):
        h(W, "abort", reservation=999)


def test_abort_leaves_rows_unpublished(h: Harness) -> None:
    rep = h(W, "reserve", rows=4)
    assert h(W, "abort", reservation=rep["reservation"]) == {}
    assert h.service.container.num_rows == 0
    with pytest.raises(NotFoundError):
        h(W, "commit", reservation=rep["reservation"])
    assert h.service.clients[W].reservations == set()


def test_generations_bump_on_every_reservation(h: Harness) -> None:
    gens = h.service.generations
    assert gens.tolist() == [0] * 16
    first = h(W, "reserve", rows=10)
    assert gens[:10].tolist() == [1] * 10 and gens[10:].tolist() == [0] * 6
    h(W, "commit", reservation=first["reservation"])
    second = h(W, "reserve", rows=10)  # wraps: [10, 16) + [0, 4)
    assert second["ranges"] == [[10, 16], [0, 4]]
    # one stamp for the whole reservation, above every old one (storage/stamps.py)
    assert gens.tolist() == [2] * 4 + [1] * 6 + [2] * 6
    h(W, "abort", reservation=second["reservation"])  # abort does not roll stamps back
    assert gens.tolist() == [2] * 4 + [1] * 6 + [2] * 6
    # the stamps live in the shared segment, where readers see them
    assert h.segment.generations[:4].tolist() == [2] * 4


def test_reader_detects_overwrite_by_stamps(h: Harness) -> None:
    h.write(W, 16, 1.0)
    out = h(R, "sample", kind="rows", n=64)
    rows, gens = i64(out["rows"]), i64(out["gens"])
    h(W, "reserve", rows=4)  # rows 0..3 are being overwritten
    moved = h.segment.generations[rows] != gens
    assert moved.tolist() == (rows < 4).tolist()


def test_max_reservations_per_client(make: Any) -> None:
    h = make(max_reservations_per_client=2)
    h.hello(W)
    h(W, "define_schema", schema=SPEC)
    a = h(W, "reserve", rows=1)
    h(W, "reserve", rows=1)
    with pytest.raises(LimitExceededError, match="limit 2"):
        h(W, "reserve", rows=1)
    h(W, "commit", reservation=a["reservation"])
    h(W, "reserve", rows=1)


def test_reservation_in_flight_is_never_overlapped(h: Harness) -> None:
    """A ring that laps a writer still copying waits for it (deferred), never overlaps it."""
    first = h(W, "reserve", rows=10)
    with pytest.raises(Deferred, match="still being written"):
        h(W, "reserve", rows=10)
    h(W, "commit", reservation=first["reservation"])
    assert h(W, "reserve", rows=10)["ranges"] == [[10, 16], [0, 4]]


# -- remote write ----------------------------------------------------------------------------


def payload(rows: int, value: float) -> list[bytes]:
    """Frames in schema order: act (int64) sorts before obs (float32)."""
    act = np.full(rows, int(value), dtype="<i8")
    obs = np.full((rows, 3), value, dtype="<f4")
    return [act.tobytes(), obs.tobytes()]


def test_schema_order_is_sorted(h: Harness) -> None:
    assert [f.key for f in h.segment.schema.fields] == [("act",), ("obs",)]


def test_remote_write(h: Harness) -> None:
    rep, out = h.call(W, "write", frames=payload(5, 7.0), rows=5, episodes=1)
    assert rep == {"episodes": [0]} and out == []
    assert (h.segment.columns[("obs",)][:5] == 7.0).all()
    assert (h.segment.columns[("act",)][:5] == 7).all()
    assert h.service.container.num_rows == 5
    assert h.service.clients[W].reservations == set()
    mv = [memoryview(f) for f in payload(2, 1.0)]  # zmq hands over memoryviews
    assert h.call(W, "write", frames=list(mv), rows=2)[0] == {"episodes": [1]}


@pytest.mark.parametrize(
    ("frames", "words"),
    [
        (payload(5, 1.0)[:1], ["expected 2 payload frames", "act", "obs"]),
        ([*payload(5, 1.0), b""], ["expected 2 payload frames"]),
        ([], ["expected 2 payload frames"]),
        ([payload(5, 1.0)[0], payload(4, 1.0)[1]], ["'obs'", "expected 60"]),
        ([payload(6, 1.0)[0], payload(5, 1.0)[1]], ["'act'", "expected 40"]),
    ],
)
def test_remote_write_bad_frames(h: Harness, frames: list[bytes], words: list[str]) -> None:
    with pytest.raises(SchemaError) as info:
        h.call(W, "write", frames=frames, rows=5)
    for word in words:
        assert word in str(info.value)
    assert h.service.container.reservations == {}
    assert h.service.container.pointer == 0
    assert h.service.generations.tolist() == [0] * 16


def test_sample_payload_frames(h: Harness) -> None:
    h.call(W, "write", frames=payload(4, 3.0), rows=4)
    h.call(W, "write", frames=payload(4, 9.0), rows=4)
    rep, frames = h.call(R, "sample", kind="rows", n=10, payload=True)
    assert "gens" not in rep
    rows = i64(rep["rows"])
    act = np.frombuffer(bytes(frames[0]), dtype="<i8")
    obs = np.frombuffer(bytes(frames[1]), dtype="<f4").reshape(10, 3)
    assert len(frames) == 2
    assert act.tolist() == [3 if r < 4 else 9 for r in rows]
    assert (obs == act[:, None].astype(np.float32)).all()
    rep, frames = h.call(R, "sample", kind="slices", n=3, length=4, payload=True)
    assert len(bytes(frames[0])) == 3 * 4 * 8
    rep, frames = h.call(R, "sample", kind="episodes", n=2, payload=True, lease=True)
    assert "lease" not in rep  # payload copies need no lease
    assert len(bytes(frames[1])) == int(i64(rep["lengths"]).sum()) * 12


def test_bfloat16_remote_round_trip(make: Any) -> None:
    h = make()
    h.hello(W)
    h(W, "define_schema", schema={"x": {"dtype": "bfloat16", "shape": [2]}})
    x = torch.arange(8, dtype=torch.bfloat16).reshape(4, 2)
    h.call(W, "write", frames=[x.view(torch.int16).numpy().tobytes()], rows=4)
    _, frames = h.call(W, "sample", kind="episodes", n=1, payload=True)
    got = torch.frombuffer(bytearray(bytes(frames[0])), dtype=torch.bfloat16).reshape(4, 2)
    assert torch.equal(got, x)


# -- sampling --------------------------------------------------------------------------------


def test_sample_episodes_and_slices(h: Harness) -> None:
    h.write(W, 3, 1.0)
    h.write(W, 6, 2.0)
    out = h(R, "sample", kind="episodes", n=50)
    ids, starts, lengths = i64(out["ids"]), i64(out["starts"]), i64(out["lengths"])
    assert set(zip(ids.tolist(), starts.tolist(), lengths.tolist(), strict=True)) == {
        (0, 0, 3),
        (1, 3, 6),
    }
    assert "gens" not in out  # episodes are protected by leases, not stamps
    assert "lease" not in out
    out = h(R, "sample", kind="slices", n=40, length=4)
    starts = i64(out["starts"])
    assert set(starts.tolist()) <= {3, 4, 5}  # only episode 1 is long enough
    assert len(i64(out["gens"])) == 40 * 4
    with pytest.raises(ProtocolError, match="length"):
        h(R, "sample", kind="slices", n=1)
    with pytest.raises(EmptyBufferError):
        h(R, "sample", kind="slices", n=1, length=7)


def test_sample_empty(h: Harness) -> None:
    for kind in ("rows", "episodes"):
        with pytest.raises(EmptyBufferError):
            h(R, "sample", kind=kind, n=1)


# -- leases and deferral ---------------------------------------------------------------------


def test_lease_defers_eviction_until_release(h: Harness) -> None:
    h.write(W, 16, 1.0)
    out = h(R, "sample", kind="episodes", n=1, lease=True)
    lease = out["lease"]
    h.now = 2.0
    with pytest.raises(Deferred) as info:
        h(W, "reserve", rows=4, timeout_ms=500)
    assert info.value.deadline == pytest.approx(2.5)
    assert h.service.container.reservations == {}
    assert h.service.container.num_rows == 16  # nothing was evicted
    assert h.service.generations.tolist() == [1] * 16  # nor stamped
    with pytest.raises(Deferred) as info:
        h(W, "reserve", rows=4)
    assert info.value.deadline == pytest.approx(32.0)  # default timeout_ms 30000
    with pytest.raises(PermissionDeniedError):
        h(W, "release", lease=lease)
    assert h(R, "release", lease=lease) == {}
    rep = h(W, "reserve", rows=4)
    assert rep["ranges"] == [[0, 4]]
    with pytest.raises(NotFoundError):
        h(R, "release", lease=lease)


def test_deferred_piggyback_commits_once(h: Harness) -> None:
    h.hello(W2)
    h.write(W2, 12, 1.0)
    lease = h(R, "sample", kind="episodes", n=1, lease=True)["lease"]
    first = h(W, "reserve", rows=4)  # [12, 16): evicts nothing
    fields = validate_request(
        make_request("reserve", 1, rows=4, commit=first["reservation"], timeout_ms=1000)
    )
    sent = dict(fields)
    with pytest.raises(Deferred) as waited:
        h.service.handle(W, "reserve", fields, [], h.now)
    assert h.service.container.num_episodes == 2  # the commit happened
    assert fields == sent  # the request is never changed: the retry is a new one
    retry = waited.value.retry
    assert retry is not None and "commit" not in retry
    with pytest.raises(Deferred) as again:  # the server retries what the Deferred named
        h.service.handle(W, "reserve", retry, [], h.now)
    assert again.value.retry is None  # nothing more done: that same request stays parked
    h(R, "release", lease=lease)
    rep, _ = h.service.handle(W, "reserve", retry, [], h.now)
    assert rep["committed"] == [1]
    assert h.service.counters.episodes_committed == 2


def test_sample_release_piggyback(h: Harness) -> None:
    h.write(W, 8, 1.0)
    lease = h(R, "sample", kind="episodes", n=1, lease=True)["lease"]
    out = h(R, "sample", kind="episodes", n=1, lease=True, release=lease)
    assert out["lease"] != lease
    assert len(h.service.leases) == 1


def test_lease_ttl_expiry(make: Any) -> None:
    h = make(lease_ttl=5.0)
    h.hello(W)
    h.hello(R, "reader")
    h(W, "define_schema", schema=SPEC)
    h.write(W, 16, 1.0)
    h.now = 10.0
    h(R, "sample", kind="episodes", n=1, lease=True)
    with pytest.raises(Deferred):
        h(W, "reserve", rows=1)
    h.service.tick(14.9)
    assert len(h.service.leases) == 1
    h.service.tick(15.0)
    assert len(h.service.leases) == 0
    assert h.service.counters.leases_expired == 1
    assert h(W, "reserve", rows=1)["ranges"] == [[0, 1]]


def test_max_leases_per_client(make: Any) -> None:
    h = make(max_leases_per_client=2)
    h.hello(W)
    h.hello(R, "reader")
    h(W, "define_schema", schema=SPEC)
    h.write(W, 4, 1.0)
    h(R, "sample", kind="episodes", n=1, lease=True)
    h(R, "sample", kind="episodes", n=1, lease=True)
    with pytest.raises(LimitExceededError):
        h(R, "sample", kind="episodes", n=1, lease=True)
    h(R, "sample", kind="episodes", n=1)  # without a lease it is fine


def test_reservation_ttl_expiry(make: Any) -> None:
    h = make(reservation_ttl=3.0)
    h.hello(W)
    h(W, "define_schema", schema=SPEC)
    h.now = 1.0
    rid = h(W, "reserve", rows=4)["reservation"]
    h.fill([[0, 4]], 3.0)
    h.service.tick(3.9)
    assert rid in h.service.container.reservations
    h.service.tick(4.0)
    assert h.service.container.reservations == {}
    assert h.service.clients[W].reservations == set()
    assert h.service.counters.reservations_expired == 1
    with pytest.raises(NotFoundError):
        h(W, "commit", reservation=rid)
    assert h.service.container.num_rows == 0
    with pytest.raises(EmptyBufferError):
        h(W, "sample", kind="rows", n=1)


def test_forget_aborts_and_releases(h: Harness) -> None:
    h.write(W, 8, 1.0)
    h(R, "sample", kind="episodes", n=1, lease=True)
    h(R, "reserve", rows=2)  # a reader may reserve too; it is just a client
    h(W, "reserve", rows=2)
    assert len(h.service.leases) == 1
    h.service.forget(R)
    assert len(h.service.leases) == 0
    assert [r.owner for r in h.service.container.reservations.values()] == [h.service.clients[W].id]
    h.service.forget(R)  # twice is harmless
    h.service.forget(W)
    assert h.service.container.reservations == {}
    assert h.service.container.num_rows == 8


# -- admin -----------------------------------------------------------------------------------


def test_clear_and_shutdown_are_admin_only(h: Harness) -> None:
    h.write(W, 4, 1.0)
    for op in ("clear", "shutdown"):
        with pytest.raises(PermissionDeniedError):
            h(W, op)
    h.hello(ADMIN, "admin")
    assert h(ADMIN, "clear") == {}
    assert h.service.container.num_rows == 0
    assert h(ADMIN, "shutdown", keep=True) == {}


# -- stats -----------------------------------------------------------------------------------


def test_stats(h: Harness) -> None:
    h.write(W, 4, 1.0)
    h(W, "reserve", rows=3)
    h(R, "sample", kind="rows", n=5)
    h(R, "sample", kind="episodes", n=1, lease=True)
    stats = h(R, "stats")["stats"]
    expected = {
        "name": h.config.name,
        "capacity": 16,
        "unit": "transition",
        "mode": "circular",
        "rows": 4,
        "episodes": 1,
        "fill": 0.25,
        "pointer": 7,
        "writers": 1,
        "readers": 1,
        "reservations": 1,
        "reserved_rows": 3,
        "leases": 1,
        "protocol": PROTOCOL_VERSION,
        "rows_committed": 4,
        "episodes_committed": 1,
        "rows_sampled": 9,
        "samples": 2,
        "reservations_expired": 0,
        "leases_expired": 0,
        "errors": 0,
    }
    assert {k: stats[k] for k in expected} == expected
    for key in ("insert_rows_per_s", "sample_rows_per_s", "uptime_s", "pid", "messages"):
        assert key in stats
    assert stats["schema"] == Schema.from_spec(SPEC).to_spec()
    assert Path(stats["segment"]["path"]).is_dir()
    limiter = stats["rate_limiter"]
    assert {k: limiter[k] for k in ("kind", "min_size", "inserted", "sampled")} == {
        "kind": "none",
        "min_size": 1,
        "inserted": 4,
        "sampled": 9,
    }
    assert stats["sampler"]["kind"] == "uniform"


def test_stats_rates(h: Harness) -> None:
    h.service.tick(0.0)
    h.write(W, 10, 1.0)
    h.service.tick(2.0)
    assert h.service.stats(2.0)["insert_rows_per_s"] == pytest.approx(5.0)
    # the window slides: 10 s later, with nothing new committed, the rate is zero
    h.service.tick(12.0)
    assert h.service.stats(12.0)["insert_rows_per_s"] == 0.0


def test_service_with_given_segment_stamps_the_shared_generations(storage: str) -> None:
    name = f"svc-{uuid.uuid4().hex[:10]}"
    segment = Segment.create(name, Schema.from_spec(SPEC), 8, storage_dir=storage)
    try:
        config = DaemonConfig(name=name, storage_dir=storage, capacity=8)
        service = BufferService(config, segment=segment)
        validate = validate_request
        service.handle(
            W, "hello", validate(make_request("hello", 1, role="writer", pid=1, host="h")), [], 0.0
        )
        service.handle(W, "reserve", validate(make_request("reserve", 2, rows=2)), [], 0.0)
        assert segment.generations[:2].tolist() == [1, 1]
    finally:
        segment.close()
        Segment.unlink(name, storage)


def test_renew_keeps_a_lease_past_its_ttl(make: Any) -> None:
    h = make(lease_ttl=5.0)
    h.hello(W)
    h.hello(R, "reader")
    h(W, "define_schema", schema=SPEC)
    h.write(W, 16, 1.0)
    h.now = 10.0
    lease = h(R, "sample", kind="episodes", n=1, lease=True)["lease"]
    h.now = 14.0
    assert h(R, "renew", lease=lease) == {"ttl": 5.0}
    with pytest.raises(PermissionDeniedError):
        h(W, "renew", lease=lease)
    h.service.tick(18.9)  # past the first TTL, within the renewed one
    with pytest.raises(Deferred):
        h(W, "reserve", rows=1)
    h.service.tick(19.0)
    assert h.service.counters.leases_expired == 1
    with pytest.raises(NotFoundError):
        h(R, "renew", lease=lease)
    assert h(W, "reserve", rows=1)["ranges"] == [[0, 1]]


# -- samplers and flow control (protocol 1.2) --------------------------------------------------


def _ready(h: Harness) -> Harness:
    h.hello(W)
    h.hello(R, "reader")
    h.hello(ADMIN, "admin")
    h(W, "define_schema", schema=SPEC)
    return h


def test_fifo_sample_with_nothing_to_consume_is_deferred_but_uniform_is_empty(make: Any) -> None:
    uniform = _ready(make())
    with pytest.raises(EmptyBufferError):
        uniform(R, "sample", kind="rows", n=1)
    fifo = _ready(make(sampler="fifo", max_times_sampled=1))
    with pytest.raises(Deferred) as info:
        fifo(R, "sample", kind="rows", n=2, timeout_ms=500)
    assert info.value.blocked == "sample" and info.value.deadline == pytest.approx(0.5)
    assert "nothing to consume" in str(info.value)
    fifo.write(W, 2, 1.0)
    rows = i64(fifo(R, "sample", kind="rows", n=2)["rows"])
    assert sorted(rows.tolist()) == [0, 1]
    with pytest.raises(Deferred):  # both consumed
        fifo(R, "sample", kind="rows", n=1)


def test_rate_limiter_defers_inserts_and_samples_and_configure_is_admin_only(make: Any) -> None:
    h = _ready(
        make(rate_limiter="sample-to-insert", samples_per_insert=1.0, min_size=2, error_buffer=2)
    )
    with pytest.raises(Deferred) as info:  # fewer than min_size rows: samples wait
        h(R, "sample", kind="rows", n=1)
    assert info.value.blocked == "sample" and "sample-to-insert" in str(info.value)
    h.write(W, 4, 1.0)  # (4 * 1 - 0) <= R N + E = 4
    with pytest.raises(Deferred) as info:
        h(W, "reserve", rows=1)
    assert info.value.blocked == "insert" and "inserted=4" in str(info.value)
    assert h.service.container.reservations == {}  # nothing reserved, nothing evicted
    with pytest.raises(PermissionDeniedError):
        h(R, "configure", samples_per_insert=0.5)
    from shmbuffer.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="error_buffer"):
        h(ADMIN, "configure", error_buffer=0.5)
    limiter = h(ADMIN, "configure", samples_per_insert=0.5)["rate_limiter"]
    assert limiter["settings"]["samples_per_insert"] == 0.5 and limiter["inserted"] == 4
    assert h(W, "reserve", rows=1)["ranges"] == [[4, 5]]
    h.service.record_blocked("insert", 1.5)
    assert h(R, "stats")["stats"]["rate_limiter"]["insert_blocked_s"] == 1.5


def test_a_bad_priority_refuses_a_reserve_whole_piggybacked_commit_included(make: Any) -> None:
    from shmbuffer.errors import InvalidArgumentError
    from shmbuffer.wire.protocol import encode_f64

    h = _ready(make(sampler="prioritized"))
    first = h(W, "reserve", rows=2, priority=encode_f64([1.0, 2.0]))
    with pytest.raises(InvalidArgumentError, match="priority"):
        h(W, "reserve", rows=2, commit=first["reservation"], priority=encode_f64([1.0, -1.0]))
    container = h.service.container
    assert container.num_rows == 0 and first["reservation"] in container.reservations
    assert h(W, "commit", reservation=first["reservation"])["episodes"] == [0]
    sampler = h.service.container.sampler.stats()
    assert sampler["priority_total"] == pytest.approx(1.0 + 2.0**0.6)  # the reserve's priority


def test_a_priority_that_could_overflow_the_sum_is_refused_and_stats_stay_finite(
    make: Any,
) -> None:
    from shmbuffer.errors import InvalidArgumentError
    from shmbuffer.wire.protocol import encode_f64, encode_i64

    h = _ready(make(sampler="prioritized", priority_exponent=1.0))
    h.write(W, 8, 1.0)
    before = h(R, "stats")["stats"]["sampler"]["figures"]["priority_total"]
    with pytest.raises(InvalidArgumentError, match=r"priority\[0\] = 1e\+308"):
        h(R, "update_priorities", index=encode_i64(range(6)), priority=encode_f64([1e308] * 6))
    with pytest.raises(InvalidArgumentError, match="priority"):
        h(W, "reserve", rows=2, priority=1e308)
    stats = h(R, "stats")["stats"]
    assert stats["sampler"]["figures"]["priority_total"] == before == pytest.approx(8.0, rel=1e-5)
    assert stats["priority_updates"] == 0 and stats["reservations"] == 0


def test_configure_refuses_a_min_size_above_the_capacity(make: Any) -> None:
    from shmbuffer.errors import InvalidArgumentError

    h = _ready(make(rate_limiter="min-size", min_size=2))
    with pytest.raises(InvalidArgumentError, match=r"min_size=17 .*capacity of 16"):
        h(ADMIN, "configure", min_size=17)
    assert h(R, "stats")["stats"]["rate_limiter"]["min_size"] == 2
    assert h(ADMIN, "configure", min_size=16)["rate_limiter"]["min_size"] == 16
