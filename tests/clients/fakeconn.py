"""A test double of :class:`shmbuffer.clients.connection.Connection`: the Writer's and Reader's
state machines driven against an in-process daemon model, no socket and no process.

:class:`FakeDaemon` answers the requests the client modules make (hello, ping, stats, reserve
with its piggybacked commits and batches ahead, commit, abort, sample, renew, release, bye)
from a small model: a ring pointer over a real shared :class:`~shmbuffer.storage.segment.Segment` in
a temporary folder (the clients attach it as they attach a daemon's, and copy rows into and out of
it), the reservations and what became of each, the committed rows, and the open leases.
Every request is logged in order (:attr:`FakeDaemon.log`) for the tests to read what the client
sent and when. Replies are made when a request is sent; :attr:`FakeDaemon.unready` holds back
the ``ready`` answer of a request to model a reply still on its way.

:class:`FakeConnection` implements exactly the part of the Connection interface the modules
call; a test installs it with ``monkeypatch.setattr(<module>, "Connection", ...)``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shmbuffer.errors import NotFoundError
from shmbuffer.storage.schema import Schema
from shmbuffer.storage.segment import Segment
from shmbuffer.wire.protocol import encode_i64

PROTOCOL = "1.7"


@dataclass
class Reservation:
    id: int
    rows: int
    ranges: list[list[int]]
    ahead: bool
    committed: bool = False
    aborted: int | None = None  # the ``written`` its abort said


@dataclass
class Request:
    op: str
    fields: dict[str, Any]
    seq: int
    reply: dict[str, Any] | None = None
    error: Exception | None = None
    taken: bool = False


@dataclass
class FakeDaemon:
    """The daemon's side; one per test, shared by the connections a test opens."""

    tmp: Path
    schema: Schema
    capacity: int = 1024
    unit: str = "transition"
    mode: str = "circular"
    sampler: str = "uniform"
    consumes: bool = False
    lease_ttl: float = 30.0
    renew_ttl: float | None = None  # the TTL a renewal's reply gives (None: lease_ttl)
    extra: dict[str, Any] = field(default_factory=dict)  # more of the hello's ``buffer``

    def __post_init__(self) -> None:
        self.segment = Segment.create(
            "fake", self.schema, self.capacity, storage_dir=self.tmp, prefault=False
        )
        self.lock = threading.Lock()
        self.log: list[Request] = []
        self.reservations: dict[int, Reservation] = {}
        self.pointer = 0  # the next row the ring hands out
        self.committed: list[int] = []  # reservation ids, in commit order
        self.rows_written: list[int] = []  # rows filled by fill(), for samples
        self.episodes: list[tuple[int, int]] = []  # (start, length) filled by fill()
        self.leases: dict[int, int] = {}  # open lease -> episodes
        self.refuse_ahead = False  # answer a reserve ahead with reservation 0
        self.unready: set[int] = set()  # seqs whose reply ready() says is not here yet
        self._ids = 0
        self._samples = 0

    @property
    def buffer(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity,
            "unit": self.unit,
            "mode": self.mode,
            "sampler": self.sampler,
            "consumes": self.consumes,
            "lease_ttl": self.lease_ttl,
            "schema": self.schema.to_spec(),
            "segment": {"name": "fake", "storage_dir": str(self.tmp)},
            **self.extra,
        }

    def close(self) -> None:
        self.segment.close()

    # -- what tests read ------------------------------------------------------------------

    def ops(self, op: str) -> list[dict[str, Any]]:
        with self.lock:
            return [r.fields for r in self.log if r.op == op]

    def names(self) -> list[str]:
        with self.lock:
            return [r.op for r in self.log if r.op not in ("hello", "bye", "stats")]

    def committed_rows(self) -> int:
        return sum(self.reservations[r].rows for r in self.committed)

    def outstanding(self) -> list[Reservation]:
        """Reservations neither committed nor aborted."""
        return [r for r in self.reservations.values() if not r.committed and r.aborted is None]

    def fill(self, rows: int, length: int = 1) -> None:
        """Committed rows ``0..rows`` whose every column holds the row's number (a writer's
        work, done here for reader tests), as episodes of ``length``."""
        for key, array in self.segment.arrays.items():
            shape = (rows,) + (1,) * (array.ndim - 1)
            array[:rows] = np.arange(rows).reshape(shape)
            del key
        self.rows_written = list(range(rows))
        self.episodes = [(s, length) for s in range(0, rows - length + 1, length)]
        self.pointer = rows % self.capacity

    # -- requests -------------------------------------------------------------------------

    def handle(self, op: str, fields: dict[str, Any], seq: int) -> Request:
        with self.lock:
            request = Request(op, dict(fields), seq)
            self.log.append(request)
            try:
                request.reply = getattr(self, f"_op_{op}")(fields)
            except Exception as exc:  # handed to the waiter, as the daemon's error reply is
                request.error = exc
            return request

    def _op_hello(self, fields: dict[str, Any]) -> dict[str, Any]:
        return {"client": 1, "buffer": self.buffer, "daemon_pid": 0}

    def _op_ping(self, fields: dict[str, Any]) -> dict[str, Any]:
        return {"protocol": PROTOCOL}

    def _op_bye(self, fields: dict[str, Any]) -> dict[str, Any]:
        return {}

    def _op_stats(self, fields: dict[str, Any]) -> dict[str, Any]:
        return {"stats": {**self.buffer, "rows": len(self.rows_written)}}

    def _reserve_one(self, rows: int, ahead: bool) -> Reservation:
        start = self.pointer
        end = start + rows
        if end <= self.capacity:
            ranges = [[start, end]]
        else:  # across the ring's end: two ranges
            ranges = [[start, self.capacity], [0, end - self.capacity]]
        self.pointer = end % self.capacity
        self._ids += 1
        reservation = Reservation(self._ids, rows, ranges, ahead)
        self.reservations[reservation.id] = reservation
        return reservation

    def _commit(self, reservation: int) -> None:
        held = self.reservations.get(reservation)
        if held is None or held.committed or held.aborted is not None:
            raise NotFoundError(f"reservation {reservation} is not held")
        held.committed = True
        self.committed.append(reservation)

    def _op_reserve(self, fields: dict[str, Any]) -> dict[str, Any]:
        commits = [fields["commit"]] if "commit" in fields else []
        for reservation in commits + list(fields.get("commits", ())):
            self._commit(reservation)
        ahead = bool(fields.get("ahead"))
        if ahead and self.refuse_ahead:
            return {"reservation": 0, "ranges": []}
        first = self._reserve_one(fields["rows"], ahead)
        reply: dict[str, Any] = {"reservation": first.id, "ranges": first.ranges}
        if fields.get("count", 1) > 1:
            more = [self._reserve_one(fields["rows"], ahead) for _ in range(fields["count"] - 1)]
            reply["more"] = [[r.id, r.ranges] for r in more]
        return reply

    def _op_commit(self, fields: dict[str, Any]) -> dict[str, Any]:
        self._commit(fields["reservation"])
        return {"episodes": []}

    def _op_abort(self, fields: dict[str, Any]) -> dict[str, Any]:
        held = self.reservations[fields["reservation"]]
        assert not held.committed and held.aborted is None, "aborted twice, or after its commit"
        held.aborted = int(fields["written"])
        return {}

    def _op_sample(self, fields: dict[str, Any]) -> dict[str, Any]:
        n = int(fields["n"])
        self._samples += 1
        if fields["kind"] == "episodes":
            chosen = [self.episodes[i % len(self.episodes)] for i in range(n)]
            self._ids += 1
            self.leases[self._ids] = n
            return {
                "lease": self._ids,
                "ids": encode_i64(np.arange(n)),
                "starts": encode_i64([s for s, _ in chosen]),
                "lengths": encode_i64([length for _, length in chosen]),
            }
        # Request k hands out the rows after those request k - 1 handed out: each batch tells
        # which request drew it.
        live = self.rows_written
        base = sum(int(r.fields["n"]) for r in self.log[:-1] if r.op == "sample")
        rows = np.array([live[(base + i) % len(live)] for i in range(n)], np.int64)
        reply: dict[str, Any] = {"rows": encode_i64(rows)}
        reply["gens"] = encode_i64(self.segment.generations[rows])
        if fields.get("lease"):
            self._ids += 1
            self.leases[self._ids] = n
            reply["lease"] = self._ids
        return reply

    def _op_renew(self, fields: dict[str, Any]) -> dict[str, Any]:
        if fields["lease"] not in self.leases:
            raise NotFoundError(f"lease {fields['lease']} not held")
        return {"ttl": self.lease_ttl if self.renew_ttl is None else self.renew_ttl}

    def _op_release(self, fields: dict[str, Any]) -> dict[str, Any]:
        if self.leases.pop(fields["lease"], None) is None:
            raise NotFoundError(f"lease {fields['lease']} not held")
        return {}


class FakeConnection:
    """The Connection methods and attributes the Writer and Reader modules use, answered by
    :attr:`daemon` (set by the test before a client is made)."""

    daemon: FakeDaemon  # class attribute: the Writer and Reader construct their own

    def __init__(self, target: str, role: str, *, timeout: float = 10.0, **options: Any) -> None:
        self.endpoint = f"fake://{target}"
        self.remote = bool(options.get("remote") or False)
        self.timeout = timeout
        self.label = role
        self.last_heard = 0.0
        self.forked = False
        self._closed = False
        self._seq = 0
        self._requests: dict[int, Request] = {}
        self._lock = threading.RLock()  # the renewer and the ticker share it, as the socket
        hello = self.call("hello", role=role)
        self.client_id: int = hello["client"]
        self.buffer: dict[str, Any] = hello["buffer"]
        self.daemon_pid: int = hello["daemon_pid"]

    @property
    def closed(self) -> bool:
        return self._closed

    def check(self) -> None:
        if self._closed:
            raise AssertionError("a closed fake connection was used")

    def check_payload(self, op: str, size: int) -> None:
        pass

    def send(self, op: str, frames: Sequence[Any] = (), **fields: Any) -> int:
        self.check()
        with self._lock:
            self._seq += 1
            self._requests[self._seq] = self.daemon.handle(op, fields, self._seq)
            return self._seq

    def ready(self, seq: int) -> bool:
        return seq not in self.daemon.unready

    def wait(self, seq: int, timeout: float | None = None) -> tuple[dict[str, Any], list[Any]]:
        with self._lock:
            request = self._requests.pop(seq)
        assert not request.taken
        request.taken = True
        self.daemon.unready.discard(seq)
        if request.error is not None:
            raise request.error
        assert request.reply is not None
        return request.reply, []

    def wait_all(self, seqs: Sequence[int], timeout: float | None = None) -> None:
        for seq in seqs:
            self.daemon.unready.discard(seq)

    def call(
        self, op: str, frames: Sequence[Any] = (), timeout: float | None = None, **fields: Any
    ) -> dict[str, Any]:
        return self.wait(self.send(op, frames, **fields), timeout)[0]

    @contextlib.contextmanager
    def bounded(self, seconds: float) -> Iterator[None]:
        yield

    def close(self, goodbye: bool = True) -> None:
        if not self._closed and goodbye:
            self.call("bye")
        self._closed = True

    def pending(self) -> list[int]:
        """Seqs sent whose replies were never taken."""
        return sorted(self._requests)
