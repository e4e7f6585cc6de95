"""The daemon's handler tables against the protocol's tables: one handler per request op, and
the replies a real BufferService sends match ``protocol.REPLIES`` field by field.

Adding an op is its table entries in ``shmbuffer/wire/protocol.py`` (requests) and
``shmbuffer/wire/replies.py`` (replies) and its handler in ``shmbuffer/daemon/service.py``;
these tests fail until they (and ``docs/protocol.md``, see tests/test_protocol.py) agree.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shmbuffer.daemon.service import BufferService
from shmbuffer.wire.protocol import (
    REPLIES,
    REQUESTS,
    VALIDATORS,
    Spec,
    decode,
    encode,
    encode_f64,
    encode_i64,
    ok_reply,
    validate_reply,
)
from tests.test_service import SPEC, Harness, payload, storage  # noqa: F401  (fixture)

W, R, ADMIN = b"writer-1", b"reader-1", b"admin-1"


@pytest.fixture
def h(storage: str) -> Iterator[Harness]:  # noqa: F811  (the fixture imported above)
    # no client, no schema yet; a sampler and a limiter that serve every op and field
    harness = Harness(storage, sampler="prioritized", rate_limiter="min-size")
    yield harness
    harness.close()


# -- requests <-> handlers -------------------------------------------------------------------


def all_handlers(service: BufferService) -> dict[str, Any]:
    return {**service.open_handlers, **service.handlers}


def test_every_request_op_has_exactly_one_handler(h: Harness) -> None:
    service = h.service
    assert not service.open_handlers.keys() & service.handlers.keys(), "an op in both tables"
    handlers = all_handlers(service)
    assert set(handlers) == set(REQUESTS), (
        f"ops without a handler: {sorted(set(REQUESTS) - set(handlers))}; "
        f"handlers without an op: {sorted(set(handlers) - set(REQUESTS))}"
    )
    functions = [handler.__func__ for handler in handlers.values()]
    assert len(set(functions)) == len(functions), "two ops share one handler"
    for op, handler in handlers.items():
        assert handler.__self__ is service  # bound once, to this service
        assert handler.__name__ == f"op_{op}", f"op {op!r} is served by {handler.__name__}"


def test_only_hello_and_ping_are_open_to_unknown_clients(h: Harness) -> None:
    assert set(h.service.open_handlers) == {"hello", "ping"}


def test_protocol_tables_cover_the_same_ops() -> None:
    assert set(REPLIES) == set(REQUESTS)
    assert set(VALIDATORS) <= set(REQUESTS)


# -- real replies <-> REPLIES ----------------------------------------------------------------


def paths(fields: Mapping[str, Any], specs: Mapping[str, Spec], prefix: str = "") -> set[str]:
    """The table's field paths a reply holds (maps looked into where the table lists fields)."""
    found = set()
    for key, value in fields.items():
        path = prefix + key
        found.add(path)
        if isinstance(value, dict) and any(name.startswith(path + ".") for name in specs):
            found |= paths(value, specs, path + ".")
    return found


class Recorder:
    """Every reply of a real service, as a client decodes it off the wire, checked at once."""

    def __init__(self, harness: Harness) -> None:
        self.h = harness
        self.seen: dict[str, set[str]] = {op: set() for op in REPLIES}
        self.ops: set[str] = set()

    def __call__(
        self, who: bytes, op: str, frames: list[Any] | None = None, **fields: Any
    ) -> dict[str, Any]:
        reply, _ = self.h.call(who, op, frames=frames, **fields)
        wire = decode(encode(ok_reply(1, **reply)), max_bytes=None)
        wire = {k: v for k, v in wire.items() if k not in ("v", "seq", "ok")}
        validate_reply(op, wire)
        self.seen[op] |= paths(wire, REPLIES[op])
        self.ops.add(op)
        return wire


def test_real_replies_match_the_reply_table(h: Harness, tmp_path: Path) -> None:
    call = Recorder(h)
    hello = {"pid": 1, "host": "test-host"}
    assert call(W, "hello", role="writer", **hello)["buffer"]["segment"] is None
    call(R, "hello", role="reader", **hello)
    call(ADMIN, "hello", role="admin", **hello)
    call(b"stranger", "ping")
    call(W, "stats")  # before a schema: nil schema and segment
    assert call(W, "define_schema", schema=SPEC)["buffer"]["segment"] is not None
    assert call(b"writer-2", "hello", role="writer", **hello)["buffer"]["segment"] is not None

    first = call(W, "reserve", rows=4, episodes=2, priority=encode_f64([1.0, 2.0, 3.0, 4.0]))
    h.fill(first["ranges"], 1.0)
    second = call(W, "reserve", rows=2, commit=first["reservation"])
    assert "committed" in second
    h.fill(second["ranges"], 2.0)
    call(W, "commit", reservation=second["reservation"], priority=2.0)
    third = call(W, "reserve", rows=1)
    call(W, "abort", reservation=third["reservation"], written=0)
    batch = call(W, "reserve", rows=1, ahead=True, count=3)  # a batch ahead (1.5)
    granted = [(batch["reservation"], batch["ranges"]), *batch["more"]]
    assert len(granted) == 3
    for _, ranges in granted:
        h.fill(ranges, 4.0)
    fourth = call(W, "reserve", rows=1, commits=[r for r, _ in granted])
    assert len(fourth["committed"]) == 3
    call(W, "abort", reservation=fourth["reservation"], written=0)
    call(W, "write", frames=payload(3, 3.0), rows=3, episodes=3, priority=0.5, meta={"ret": 1})

    call(R, "sample", kind="rows", n=4)
    drawn = call(R, "sample", kind="rows", n=4, info=True, beta=0.5, timeout_ms=0)
    assert set(drawn) >= {"index", "generation", "probability", "weight"}
    update = dict(index=drawn["index"], priority=encode_f64([5.0] * 4))
    assert call(R, "update_priorities", **update, generation=drawn["generation"]) == {
        "updated": 4,
        "stale": 0,
    }
    reported = [drawn["index"], drawn["generation"]]  # a reader's own draws, as frames
    assert call(R, "drawn", frames=reported, rows=4, samples=1) == {"counted": 4}
    call(R, "sample", kind="slices", n=2, length=2)
    call(R, "sample", kind="rows", n=2, where="ret >= 1")  # by priority among them
    found = call(R, "episodes", where="ret > 0", order_by="-ret", limit=5)
    assert found["columns"]["ret"] == [1, 1, 1] and found["kinds"]["ret"] == "int"
    call(R, "sample", kind="slices", n=2, length=3, strict=False, info=True)
    listed = call(R, "iterate", rank=0, world_size=2, shuffle=False, drop_last=True, epoch=1)
    call(R, "read", rows=listed["rows"], gens=listed["gens"])
    first_rows = listed["rows"][:16]  # two committed rows, changed in place
    call(W, "rewrite", frames=[np.full(2, 9, "<i8").tobytes()], rows=first_rows, keys=["act"])
    stale = call(W, "rewrite", frames=payload(2, 8.0), rows=first_rows, generation=bytes(16))
    assert stale["written"] == 0 and len(stale["skipped"]) == 16
    call(R, "sample", kind="rows", n=2, payload=True)
    call(R, "sample", kind="episodes", n=2, payload=True)
    leased = call(R, "sample", kind="episodes", n=2, lease=True)
    call(R, "renew", lease=leased["lease"])
    again = call(R, "sample", kind="episodes", n=1, lease=True, release=leased["lease"])
    call(R, "release", lease=again["lease"])
    h.service.tick(1.0)  # rates and a client sweep behind the counters
    stats = call(R, "stats")["stats"]
    assert stats["rows"] == 12 and stats["segment"] is not None

    call(ADMIN, "configure", min_size=2)
    call(ADMIN, "checkpoint", to=str(tmp_path))
    call(ADMIN, "clear")
    call(R, "bye")
    call(ADMIN, "shutdown")
    context = Recorder(Harness(h.config.storage_dir))  # where drawn rows lie in their episodes
    context(W, "hello", role="writer", **hello)
    context(W, "define_schema", schema=SPEC)
    context.h.fill(context(W, "reserve", rows=4, episodes=2)["ranges"], 1.0)
    context(R, "hello", role="reader", **hello)
    context(W, "commit", reservation=1)
    assert set(context(R, "sample", kind="rows", n=3, context=True)) >= {"before", "left"}
    context.h.close()
    packed = Recorder(_compressed_harness(h.config.storage_dir))  # a byte store's fields
    packed(W, "hello", role="writer", **hello)
    packed(
        W,
        "define_schema",
        schema={**SPEC, "pix": {"dtype": "uint8", "shape": [4], "compress": "zstd"}},
    )
    assert "offsets" in packed(W, "reserve", rows=2, chunks=encode_i64(np.array([5], np.int64)))
    assert "compressed" in packed(W, "stats")["stats"]
    packed.h.close()
    for other in (context, packed):
        for op, seen in other.seen.items():
            call.seen[op] |= seen

    assert call.ops == set(REQUESTS), f"ops not exercised: {sorted(set(REQUESTS) - call.ops)}"
    for op, specs in REPLIES.items():
        never = set(specs) - call.seen[op]
        assert not never, f"op {op!r}: REPLIES lists fields no real reply carried: {never}"


def test_validate_reply_names_what_is_wrong() -> None:
    from shmbuffer.errors import ProtocolError

    good = {"pid": 7, "protocol": "1.2"}
    validate_reply("ping", good)
    for bad, words in [
        ({**good, "extra": 1}, ["'extra'", "not in REPLIES"]),
        ({"pid": 7}, ["'protocol'", "missing"]),
        ({**good, "pid": True}, ["'pid'", "must be int"]),
    ]:
        with pytest.raises(ProtocolError) as info:
            validate_reply("ping", bad)
        for word in words:
            assert word in str(info.value)
    buffer = {"name": "b", "capacity": 1, "unit": "transition", "mode": "circular"}
    buffer |= {"schema": None, "segment": None, "lease_ttl": 30, "reservation_ttl": 60.0}
    buffer |= {"sampler": "uniform", "max_times_sampled": None}
    hello = {"client": 1, "daemon_pid": 2, "buffer": {**buffer, "max_payload_bytes": 8}}
    validate_reply("hello", hello)  # a nil map has no fields to check
    with pytest.raises(ProtocolError, match=r"'buffer\.max_payload_bytes'"):
        validate_reply("hello", {**hello, "buffer": buffer})
    with pytest.raises(ProtocolError, match=r"'buffer\.segment\.path'"):
        segment = {"name": "b", "storage_dir": "/dev/shm"}
        validate_reply("hello", {**hello, "buffer": {**hello["buffer"], "segment": segment}})
    validate_reply("sample", {"rows": np.arange(2, dtype="<i8").tobytes()})


def _compressed_harness(storage_dir: str) -> Harness:
    pytest.importorskip("zstandard", reason="compressed columns need the [compress] extra")
    return Harness(storage_dir, unit="episode", capacity=16, compressed_bytes=4096)
