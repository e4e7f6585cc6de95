"""Fuzz the daemon's wire protocol: a real daemon subprocess gets 100,000 random and mutated
frames from one raw DEALER socket, answers every one with an error, keeps serving, and leaves
the stored data byte-identical.

The frames are generated deterministically (seeded) and none of them is a valid request that
would change state: every generator below produces something the daemon must refuse, from
random bytes and truncated msgpack to well-formed requests on another client's reservation or
lease. A frame that gets an ``ok`` reply fails the test, as does a missing reply.

The default run sends 20,000 frames (about 7 s here); the 100,000-frame run (about 30 s on
2 cores) is marked slow: ``pytest -m slow tests/test_fuzz.py``.
``SHMBUFFER_FUZZ_FRAMES`` overrides the count, ``SHMBUFFER_FUZZ_SEED`` the seed.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from shmbuffer.cli.demo_loops import make_episode
from shmbuffer.clients.connection import Connection
from shmbuffer.errors import all_codes
from shmbuffer.storage.schema import Schema
from shmbuffer.storage.segment import Segment
from shmbuffer.wire.protocol import MAX_HEADER_BYTES, MAX_INT, PROTOCOL_VERSION, REQUESTS
from tests.e2e.conftest import daemon, e2e_env  # noqa: F401  (fixtures)

FRAMES = int(os.environ.get("SHMBUFFER_FUZZ_FRAMES", "0"))  # 0: 20k by default, 100k slow
SEED = int(os.environ.get("SHMBUFFER_FUZZ_SEED", "20240611"))
BURST = 1000  # frames sent before their replies are read
REPLY_TIMEOUT_MS = 10_000
OBS = (4,)
LENGTH = 10
SPEC = Schema.from_batch(make_episode(0, 0, 1, OBS)).to_spec()
ROW_NBYTES = Schema.from_spec(SPEC).row_nbytes
NUM_FIELDS = len(Schema.from_spec(SPEC).fields)
CAPACITY = 2000

#: Fields that must not change while the daemon is fuzzed.
STATE_KEYS = (
    "rows",
    "episodes",
    "pointer",
    "rows_committed",
    "episodes_committed",
    "reservations",
    "reserved_rows",
    "leases",
    "schema",
    "writers",
    "readers",
)


class Fuzzer:
    """Deterministic generators of frames the daemon must refuse.

    ``victim_reservation`` and ``victim_lease`` belong to other clients; the fuzzing client
    itself holds nothing, so every id it names is someone else's or unknown.
    """

    def __init__(self, seed: int, victim_reservation: int, victim_lease: int) -> None:
        self.rng = random.Random(seed)
        self.rid = victim_reservation
        self.lid = victim_lease
        # A valid-looking request per op (before mutation); the fuzzer is a hello'd reader.
        self.templates: dict[str, dict[str, Any]] = {
            "hello": {"role": "reader", "pid": 1, "host": "fuzz", "remote": False},
            "bye": {},
            "ping": {},
            "stats": {},
            "define_schema": {"schema": SPEC},
            "reserve": {"rows": 5, "episodes": 1, "commit": self.rid, "timeout_ms": 0},
            "commit": {"reservation": self.rid},
            "abort": {"reservation": self.rid},
            "write": {"rows": 2, "episodes": 1, "timeout_ms": 0},
            "sample": {"kind": "episodes", "n": 2, "length": 3, "release": self.lid},
            "release": {"lease": self.lid},
            "clear": {},
            "shutdown": {"keep": False},
            "checkpoint": {"to": "/tmp/shmbuffer-fuzz-checkpoint"},  # admin only
            # no payload frames: refused (schema), whatever the fields say
            "rewrite": {"rows": bytes(16), "timeout_ms": 0},
        }
        # Ops added later are fuzzed only once a template (and a reason it fails) is added here.
        self.specs = {op: specs for op, specs in REQUESTS.items() if op in self.templates}
        self.generators: list[tuple[int, Callable[[], list[bytes]]]] = [
            (10, self.random_bytes),
            (10, self.truncated),
            (14, self.wrong_type),
            (12, self.out_of_range),
            (4, self.unknown_op),
            (6, self.missing_field),
            (6, self.extra_field),
            (3, self.bad_header),
            (10, self.not_yours),
            (5, self.absurd_sample),
            (2, self.bad_schema),
            (3, self.not_admin),
            (8, self.bogus_write),
            (2, self.bad_hello),
            (1, self.not_admin_checkpoint),
        ]
        self._weights = [w for w, _ in self.generators]
        self._seq = 0

    # -- helpers ----------------------------------------------------------------------------

    def header(self, op: Any, fields: dict[str, Any], **overrides: Any) -> bytes:
        self._seq += 1
        return msgpack.packb(
            {"v": PROTOCOL_VERSION, "op": op, "seq": self._seq, **fields, **overrides},
            use_bin_type=True,
        )

    def junk(self, depth: int = 0) -> Any:
        r = self.rng
        choice = r.randrange(9 if depth < 2 else 6)
        if choice == 0:
            return r.randint(-(2**63), 2**64 - 1)
        if choice == 1:
            return r.random() * 10 ** r.randint(-5, 30) * r.choice((-1, 1))
        if choice == 2:
            return "".join(chr(r.randint(0, 0x2FF)) for _ in range(r.randint(0, 12)))
        if choice == 3:
            return r.randbytes(r.randint(0, 12))
        if choice == 4:
            return None
        if choice == 5:
            return r.choice((True, False))
        if choice == 6:
            return [self.junk(depth + 1) for _ in range(r.randint(0, 4))]
        return {f"k{i}": self.junk(depth + 1) for i in range(r.randint(0, 3))}

    # -- generators: each returns the frames of one message the daemon must refuse ----------

    def random_bytes(self) -> list[bytes]:
        r = self.rng
        frame = r.randbytes(r.choice((0, 1, 2, 3, 8, 40, 200)))
        if frame[:1] and 0x80 <= frame[0] <= 0x8F:  # a fixmap prefix: keep it a garbage map
            frame = b"\xc1" + frame[1:]  # 0xc1 is never valid msgpack
        extra = [r.randbytes(r.randint(0, 64)) for _ in range(r.choice((0, 0, 0, 1, 3)))]
        return [frame, *extra]

    def truncated(self) -> list[bytes]:
        op = self.rng.choice(sorted(self.templates))
        frame = self.header(op, self.templates[op])
        return [frame[: self.rng.randrange(len(frame))]]

    def wrong_type(self) -> list[bytes]:
        op = self.rng.choice([o for o, specs in self.specs.items() if specs])
        name, spec = self.rng.choice(sorted(self.specs[op].items()))
        pool: list[Any] = [None, 1.5, [1], {"a": 1}, b"x", "7", -0.0]
        if spec.types == (int,):
            pool += [True, False, "5", 5.0]
        elif spec.types == (bool,):
            pool += [1, 0, "true"]
        elif spec.types == (str,):
            pool += [5, True, ["writer"], b"writer"]
        else:  # dict (schema)
            pool += [5, "obs", [SPEC], True]
        pool = [v for v in pool if type(v) not in spec.types]  # "7" is a fine host name
        fields = {**self.templates[op], name: self.rng.choice(pool)}
        return [self.header(op, fields)]

    def out_of_range(self) -> list[bytes]:
        candidates = [
            (op, name, spec)
            for op, specs in self.specs.items()
            for name, spec in specs.items()
            if spec.types == (int,)
        ]
        op, name, spec = self.rng.choice(candidates)
        lo = spec.lo if spec.lo is not None else 0
        hi = spec.hi if spec.hi is not None else MAX_INT
        bad = [lo - 1, -1, -(2**63), hi + 1, 2**63, 2**64 - 1]
        if lo - 1 < -(2**63):
            bad.remove(lo - 1)
        value = self.rng.choice([b for b in bad if not lo <= b <= hi])
        return [self.header(op, {**self.templates[op], name: value})]

    def unknown_op(self) -> list[bytes]:
        r = self.rng
        op = r.choice(
            [
                "".join(r.choice("abcdefghijklmnopqrstuvwxyz_") for _ in range(r.randint(0, 12))),
                "HELLO",
                "op_reserve",
                "__class__",
                "tick",
                "forget",
                "_commit",
                "checkpoint" * 20,
                r.randint(-5, 5),
                None,
                ["reserve"],
            ]
        )
        if isinstance(op, str) and op in REQUESTS:
            op += "!"
        return [self.header(op, {})]

    def missing_field(self) -> list[bytes]:
        candidates = [
            (op, name)
            for op, specs in self.specs.items()
            for name, spec in specs.items()
            if spec.required
        ]
        op, name = self.rng.choice(candidates)
        fields = dict(self.templates[op])
        fields.pop(name, None)
        return [self.header(op, fields)]

    def extra_field(self) -> list[bytes]:
        op = self.rng.choice(sorted(self.templates))
        name = self.rng.choice(["x", "owner", "client", "id", "role", "admin", "_committed", ""])
        if name in self.specs[op]:
            name += "_"
        return [self.header(op, {**self.templates[op], name: self.junk()})]

    def bad_header(self) -> list[bytes]:
        r = self.rng
        op = r.choice(["ping", "stats", "commit"])
        kind = r.randrange(7)
        fields = dict(self.templates[op])
        if kind == 0:  # bad version
            v = r.choice(["2.0", "0.9", "", "x", "1.0.0.0", "1.a", "²", 1, 1.0, None, [1, 0]])
            return [msgpack.packb({"v": v, "op": op, "seq": 1, **fields})]
        if kind == 1:  # bad seq
            seq = r.choice([-1, "1", 1.0, None, MAX_INT, 2**64 - 1, True, [1]])
            return [msgpack.packb({"v": PROTOCOL_VERSION, "op": op, "seq": seq, **fields})]
        if kind == 2:  # not a map / keys not strings
            return [
                msgpack.packb(
                    r.choice([[1, 2], "ping", 5, None, {1: 2}, {b"op": b"ping"}, {(1,): 1}])
                )
            ]
        if kind == 3:  # a header over the size limit
            pad = "x" * (MAX_HEADER_BYTES + r.randint(1, 100))
            return [self.header("ping", {"pad": pad})]
        if kind == 4:  # deeply nested junk (built by hand: msgpack packs 511 levels at most)
            depth = r.choice((50, 500, 990, 1000, 1020, 2000, 20_000))
            head = msgpack.packb({"v": PROTOCOL_VERSION, "op": "define_schema", "seq": 1})
            nested = b"\x81\xa1a" * depth + b"\x01"  # {"a": {"a": ... 1}}
            return [bytes([head[0] + 1]) + head[1:] + msgpack.packb("schema") + nested]
        if kind == 5:  # missing v / op / seq
            full = {"v": PROTOCOL_VERSION, "op": op, "seq": 1, **fields}
            del full[r.choice(["v", "op", "seq"])]
            return [msgpack.packb(full)]
        return [b""]  # an empty header frame

    def not_yours(self) -> list[bytes]:
        """Well-formed requests on another client's reservation or lease, or unknown ids."""
        r = self.rng
        unknown = r.choice([r.randint(1, 10**6), r.randint(1, MAX_INT)])
        if unknown in (self.rid, self.lid):
            unknown += 1
        rid = r.choice([self.rid, unknown])
        lid = r.choice([self.lid, unknown])
        choice = r.randrange(6)
        if choice == 0:
            return [self.header("commit", {"reservation": rid})]
        if choice == 1:
            return [self.header("abort", {"reservation": rid})]
        if choice == 2:
            return [self.header("release", {"lease": lid})]
        if choice == 3:  # commit-and-reserve: the commit is checked before any reservation
            return [self.header("reserve", {"rows": r.randint(1, 50), "commit": rid})]
        if choice == 4:  # sample-and-release: the release is checked before sampling
            kind = r.choice(["rows", "episodes", "slices"])
            return [self.header("sample", {"kind": kind, "n": 1, "length": 1, "release": lid})]
        frames = [r.randbytes(ROW_NBYTES) for _ in range(NUM_FIELDS)]
        return [self.header("commit", {"reservation": rid}), *frames]

    def absurd_sample(self) -> list[bytes]:
        r = self.rng
        kind = r.randrange(4)
        if kind == 0:  # slices longer than any episode
            length = r.choice([LENGTH + 1, CAPACITY + 1, 10**6])
            return [
                self.header("sample", {"kind": "slices", "n": r.randint(1, 100), "length": length})
            ]
        if kind == 1:  # a reply far over max_payload_bytes
            n = r.randint(1, 1 << 20)
            length = r.choice([2**40, MAX_INT, 2**31 // n + 2**28])
            return [self.header("sample", {"kind": "slices", "n": n, "length": length})]
        if kind == 2:  # slices without a length
            return [self.header("sample", {"kind": "slices", "n": r.randint(1, 1 << 20)})]
        n = r.choice([0, -1, (1 << 20) + 1, 2**62, 2**64 - 1])
        return [self.header("sample", {"kind": r.choice(["rows", "episodes"]), "n": n})]

    def bad_schema(self) -> list[bytes]:
        r = self.rng
        spec = json.loads(json.dumps(SPEC))
        kind = r.randrange(6)
        if kind == 0:  # a conflicting but valid schema
            spec["obs"]["dtype"] = r.choice(["float32", "int8", "float64", "bfloat16"])
        elif kind == 1:
            spec["obs"]["shape"] = r.choice([[5], [4, 1], [], [2**40], [2**62, 2**62]])
        elif kind == 2:
            spec[r.choice(["extra", "next.obs", "obs2"])] = {"dtype": "uint8", "shape": [1]}
        elif kind == 3:
            spec = r.choice(
                [
                    {},
                    {"obs": {"dtype": "nope"}},
                    {"obs": {"dtype": "uint8", "shape": [-1]}},
                    {"obs": {"dtype": "uint8", "shape": "4"}},
                    {"obs": {"dtype": "uint8", "shape": [True, 1.5]}},
                    {"obs": 5},
                    {"obs": {"dtype": "uint8", "stride": [1]}},
                    {"": {"dtype": "uint8"}},
                    {"a..b": {"dtype": "uint8"}},
                    {"obs": {"dtype": "uint8"}, "obs.x": {"dtype": "uint8"}},
                ]
            )
        elif kind == 4:
            spec = {f"k{i}": {"dtype": "uint8", "shape": [1]} for i in range(r.randint(1, 2000))}
        else:
            spec = {"obs": self.junk()}
        return [self.header("define_schema", {"schema": spec})]

    def not_admin(self) -> list[bytes]:
        op = self.rng.choice(["clear", "shutdown"])
        fields = {"keep": self.rng.choice([True, False])} if op == "shutdown" else {}
        return [self.header(op, fields)]

    def not_admin_checkpoint(self) -> list[bytes]:
        return [self.header("checkpoint", {"to": self.rng.choice(["/tmp/x", "", "../../etc"])})]

    def bogus_write(self) -> list[bytes]:
        """A write whose payload frames never match the schema, or that is over the limit."""
        r = self.rng
        if r.randrange(5) == 0:  # far more rows than max_payload_bytes allows
            rows = r.choice([2**40, MAX_INT, 2**31 // ROW_NBYTES + 1])
            return [self.header("write", {"rows": rows}), b"\x00" * r.randint(0, 64)]
        rows = r.randint(1, 40)
        count = r.choice([0, 1, NUM_FIELDS - 1, NUM_FIELDS, NUM_FIELDS, NUM_FIELDS + 1, 20])
        sizes = [r.choice([0, 1, 7, rows * 8, rows * ROW_NBYTES]) for _ in range(count)]
        if count == NUM_FIELDS:  # make sure at least one frame is the wrong size
            sizes[r.randrange(count)] = rows * 1000 + r.randint(1, 7)
        fields = {"rows": rows}
        if r.random() < 0.3:
            fields["episodes"] = r.choice([1, rows, rows + 1])
        return [self.header("write", fields), *(r.randbytes(s) for s in sizes)]

    def bad_hello(self) -> list[bytes]:
        r = self.rng
        fields = dict(self.templates["hello"])
        kind = r.randrange(4)
        if kind == 0:
            fields["role"] = r.choice(["root", "Admin", "", "writer ", "superuser"])
        elif kind == 1:
            fields["pid"] = r.choice([-1, 2**31 + 1, 2**63])
        elif kind == 2:
            del fields[r.choice(["role", "pid", "host"])]
        else:
            fields["remote"] = r.choice([1, "yes", None])
        return [self.header("hello", fields)]

    # -- driver -----------------------------------------------------------------------------

    def frames(self) -> list[bytes]:
        generator = self.rng.choices(self.generators, weights=self._weights)[0][1]
        return generator()


def _snapshot(seg: Segment) -> dict[Any, np.ndarray]:
    data: dict[Any, np.ndarray] = {key: arr.copy() for key, arr in seg.arrays.items()}
    data["__generations__"] = seg.generations.copy()
    return data


def _state(conn: Connection) -> dict[str, Any]:
    stats = conn.call("stats")["stats"]
    return {k: stats[k] for k in STATE_KEYS}


@pytest.mark.parametrize(
    "count", [20_000, pytest.param(100_000, marks=pytest.mark.slow, id="100k")], ids=str
)
def test_fuzz_frames_are_refused_and_change_nothing(request, daemon, e2e_env, count):  # noqa: F811
    count = FRAMES or count
    schema_file = e2e_env.runtime_dir / "schema.json"
    schema_file.write_text(json.dumps(SPEC))
    d = daemon(
        capacity=CAPACITY,
        unit="episode",
        args=["--schema", str(schema_file), "--lease-ttl", "600", "--reservation-ttl", "600"],
    )
    from shmbuffer import Writer

    with Writer(d.name, timeout=10) as writer:
        for e in range(30):
            writer.add_episode(make_episode(1, e, LENGTH, OBS))
        writer.flush()
    victim = Connection(d.name, "writer", timeout=10)  # holds a reservation throughout
    learner = Connection(d.name, "reader", timeout=10)  # holds a lease throughout
    admin = Connection(d.name, "admin", timeout=10)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    seg = Segment.attach(d.name, storage_dir=str(d.storage_dir), prefault=False)
    try:
        rid = victim.call("reserve", rows=LENGTH)["reservation"]
        lid = learner.call("sample", kind="episodes", n=3, lease=True)["lease"]
        sock.connect(d.endpoint)
        sock.send_multipart(
            [
                msgpack.packb(
                    {
                        "v": PROTOCOL_VERSION,
                        "op": "hello",
                        "seq": 0,
                        "role": "reader",
                        "pid": os.getpid(),
                        "host": "fuzzer",  # not this host: never reaped by pid
                    }
                )
            ]
        )
        assert sock.poll(10_000) and msgpack.unpackb(sock.recv())["ok"]

        before_data, before_state = _snapshot(seg), _state(admin)
        assert before_state["reservations"] == 1 and before_state["leases"] == 1
        errors_before = admin.call("stats")["stats"]["errors"]

        fuzzer = Fuzzer(SEED, rid, lid)
        codes: Counter[str] = Counter()
        sent = replies = 0
        t0 = time.monotonic()
        while sent < count:
            burst = min(BURST, count - sent)
            for _ in range(burst):
                sock.send_multipart(fuzzer.frames(), copy=False)
            sent += burst
            for _ in range(burst):
                assert sock.poll(REPLY_TIMEOUT_MS), (
                    f"no reply within {REPLY_TIMEOUT_MS} ms after {replies} of {sent} frames"
                )
                frames = sock.recv_multipart()
                assert len(frames) == 1, f"an error reply carried payload: {len(frames)} frames"
                reply = msgpack.unpackb(frames[0], raw=False)
                assert reply["ok"] is False, f"a fuzz frame was accepted: {reply}"
                assert reply["v"] == PROTOCOL_VERSION and isinstance(reply["seq"], int)
                codes[reply["error"]["code"]] += 1
                replies += 1
        took = time.monotonic() - t0
        assert not sock.poll(200), "more replies than frames"

        print(
            f"\nfuzz: {sent:,} frames, {replies:,} error replies in {took:.1f}s "
            f"({sent / took:,.0f} frames/s); by code: {dict(codes.most_common())}"
        )
        assert replies == sent
        assert set(codes) <= set(all_codes()) - {"internal"}, "an internal error is a bug"
        # the daemon still serves, its data and bookkeeping are untouched
        assert d.process.poll() is None
        assert admin.call("ping")["pid"] == d.pid
        assert _state(admin) == before_state
        after = _snapshot(seg)
        for key, array in before_data.items():
            assert np.array_equal(array, after[key]), f"column {key} changed under the fuzzer"
        assert admin.call("stats")["stats"]["errors"] - errors_before == sent
        # what the other clients hold is still theirs
        victim.call("abort", reservation=rid)
        learner.call("release", lease=lid)
        state = _state(admin)
        assert state["reservations"] == 0 and state["leases"] == 0
    finally:
        seg.close()
        sock.close()
        ctx.term()
        for conn in (victim, learner, admin):
            conn.close()
