"""The daemon's client table: who said ``hello``, what each holds open, and who is gone.

A client is one ZeroMQ identity (a DEALER socket) or lane connection that said ``hello``. Its
record keeps the reservations it holds open; its leases live in
:class:`~shmbuffer.daemon.leases.LeaseTable` under the same client id. A lane client's process
is the one the kernel vouches for (:mod:`~shmbuffer.daemon.processes`), whatever pid its hello
claims. The table decides who is gone — a local process that died (found by its pid, and for
a vouched process its start time, so a reused pid is not mistaken for it), or a client that
holds nothing and was silent for ``client_idle_ttl`` — and the service forgets those with what
they hold (``BufferService.forget``), as it forgets a lane client whose connection closed, so
the table cannot grow forever.

Not thread-safe: the daemon loop serialises calls.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator, Set
from dataclasses import dataclass, field
from typing import Literal

from shmbuffer.daemon.processes import Process, alive
from shmbuffer.errors import LimitExceededError
from shmbuffer.runtime import pid_alive

log = logging.getLogger("shmbuffer.daemon")

REAP_INTERVAL_S = 0.25  # how often clients are checked for a dead process or idleness
FULL_SWEEP_EVERY = 20  # every 20th sweep (~5 s) also checks the pids of clients holding nothing

#: Why a client is forgotten: its process died, it held nothing and stayed silent, or its
#: connection closed while it held something and its process lives on.
Gone = Literal["died", "idle", "closed"]


@dataclass
class Client:
    id: int
    identity: bytes
    role: str
    pid: int
    host: str
    remote: bool
    reservations: set[int] = field(default_factory=set)
    last_seen: float = 0.0
    #: Same host, and its pid was alive from here at hello (so not another pid namespace):
    #: the daemon may reap it the moment that pid dies.
    watch_pid: bool = False
    #: Rows this client committed and sampled (``stats.clients``).
    rows_committed: int = 0
    rows_sampled: int = 0
    #: The process the transport vouches for (the lane's peer credentials); None for a pid
    #: only claimed in the hello (tcp, the ZeroMQ ipc socket).
    process: Process | None = None
    #: Its connection closed while it held reservations or leases: the next sweep forgets it
    #: (as ``died`` if its process is gone by then, else ``closed``).
    disconnected: bool = False

    @property
    def writer(self) -> str:
        """What an episode's metadata records as its ``writer``: ``pid@host``."""
        return f"{self.pid}@{self.host}"

    def is_alive(self) -> bool:
        return alive(self.process) if self.process is not None else pid_alive(self.pid)

    @property
    def local(self) -> bool:
        return not self.remote and self.host == socket.gethostname()


class ClientTable:
    """Client records by identity, with unique ids; at most ``max_clients`` of them."""

    def __init__(self, max_clients: int, idle_ttl: float) -> None:
        self.max_clients = max_clients
        self.idle_ttl = idle_ttl
        self._clients: dict[bytes, Client] = {}
        self._next = 1
        self._next_sweep = 0.0  # monotonic time of the next dead/idle-client sweep
        self._sweeps = 0

    def __len__(self) -> int:
        return len(self._clients)

    def __contains__(self, identity: object) -> bool:
        return identity in self._clients

    def __getitem__(self, identity: bytes) -> Client:
        return self._clients[identity]

    def __iter__(self) -> Iterator[Client]:
        return iter(self._clients.values())

    def get(self, identity: bytes) -> Client | None:
        return self._clients.get(identity)

    @property
    def full(self) -> bool:
        return len(self._clients) >= self.max_clients

    def hello(
        self,
        identity: bytes,
        role: str,
        pid: int,
        host: str,
        remote: bool,
        now: float,
        process: Process | None = None,
    ) -> Client:
        """The record of ``identity``: made on its first ``hello``, the same one (same id) on a
        repeated one. A new client beyond ``max_clients`` is :class:`LimitExceededError`.
        ``process``: what the transport vouches for; its pid replaces the claimed one."""
        client = self._clients.get(identity)
        if client is None:
            if self.full:
                raise LimitExceededError(
                    f"too many clients ({len(self._clients)} connected, limit max_clients="
                    f"{self.max_clients}): close unused Writers/Readers or raise the limit"
                )
            if process is not None:
                if process.pid != pid:
                    log.warning("a lane client claims pid %d; its peer is pid %d", pid, process.pid)
                pid = process.pid
            client = Client(self._next, identity, role, pid, host, remote, process=process)
            client.watch_pid = os.getpid() != pid and (  # an in-process client: never "dead"
                process is not None  # vouched: watched even if it died before its hello
                or (
                    not remote
                    and host == socket.gethostname()
                    and pid_alive(pid)  # else another pid namespace: rely on TTLs
                )
            )
            self._next += 1
            self._clients[identity] = client
            log.info("client %d: %s pid %d on %s", client.id, role, pid, host)
        client.last_seen = now
        return client

    def pop(self, identity: bytes) -> Client | None:
        """Drop the record (what it holds is the caller's to give back)."""
        return self._clients.pop(identity, None)

    def discard_reservation(self, reservation_id: int) -> None:
        """A reservation ended without its owner's request (it expired)."""
        for client in self._clients.values():
            client.reservations.discard(reservation_id)

    def by_id(self, client_id: object) -> Client | None:
        """The client of id ``client_id`` (O(clients): for error messages and status)."""
        return next((c for c in self._clients.values() if c.id == client_id), None)

    def count_role(self, role: str) -> int:
        return sum(1 for client in self._clients.values() if client.role == role)

    def sweep_due(self, now: float) -> bool:
        """True once every ``REAP_INTERVAL_S``: time for :meth:`gone`."""
        if now < self._next_sweep:
            return False
        self._next_sweep = now + REAP_INTERVAL_S
        return True

    def gone(self, now: float, holders: Set[int]) -> list[tuple[Client, Gone]]:
        """The clients to forget now, and why; ``holders`` are the ids that hold leases.

        A local client whose process died is found by its pid: at once if it holds
        reservations or leases (a SIGKILLed writer's rows and a dead learner's leases come back
        within ``REAP_INTERVAL_S``), on every ``FULL_SWEEP_EVERY``-th sweep otherwise. Remote
        clients rely on the reservation and lease TTLs. A client that holds nothing and has
        sent nothing for ``idle_ttl`` seconds goes too.
        """
        self._sweeps += 1
        full = self._sweeps % FULL_SWEEP_EVERY == 0
        found: list[tuple[Client, Gone]] = []
        for client in self._clients.values():
            holds = bool(client.reservations) or client.id in holders
            if (
                client.watch_pid
                and (holds or full or client.disconnected)
                and not (client.is_alive())
            ):
                found.append((client, "died"))
            elif client.disconnected:
                found.append((client, "closed"))
            elif not holds and now - client.last_seen > self.idle_ttl:
                found.append((client, "idle"))
        return found
