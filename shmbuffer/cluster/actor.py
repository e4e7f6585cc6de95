"""The shard host: a Ray actor pinned to one node that owns that node's daemon.

Ray places and supervises the host (node-affinity scheduling, ``num_cpus=0``); the host owns
its daemon child through a :class:`~shmbuffer.cluster.supervisor.DaemonSupervisor` (start,
``--resume`` after a death, explicit stop) and publishes where it listens. No data passes
through the actor or Ray's object store: clients talk to the daemon over ZeroMQ and, on its
node, through shared memory.

The daemon listens on tcp on the node's address. On a non-loopback address it is a CURVE
server with a keypair the host makes at start (its public key is published with the endpoint
and passed to every client); ``curve=False`` opts out (``--insecure-tcp``: a trusted network).
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
from typing import Any

import ray

from shmbuffer import runtime
from shmbuffer.cluster.options import shard_name, start_flags
from shmbuffer.cluster.supervisor import DaemonSupervisor, make_curve_keys


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class ShardHost:
    """One shard's host (wrapped with ``ray.remote`` by the handle). Construction starts the
    daemon and returns once it serves; :meth:`stop` must be called before the actor is
    killed (Ray kills with SIGKILL; the daemon's death signal is only the safety net)."""

    def __init__(
        self,
        name: str,
        index: int,
        capacity: int,
        unit: str,
        options: dict[str, Any],
        curve: bool | None = None,
        runtime_dir: str | None = None,
        ready_timeout: float = 120.0,
    ) -> None:
        if runtime_dir is not None:  # this worker process is the host's alone
            os.environ[runtime.ENV_RUNTIME_DIR] = runtime_dir
        self.node_id: str = ray.get_runtime_context().get_node_id()
        self.ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call, unused-ignore]
        self.index = index
        self.daemon = shard_name(name, self.node_id)
        options = dict(options)
        storage_dir = options.pop("storage_dir", None)
        flags = [*start_flags(options, index), "--capacity", str(capacity), "--unit", unit]
        loopback = is_loopback(self.ip)
        use_curve = (not loopback) if curve is None else bool(curve)
        self.curve_server_key: str | None = None
        self._keys = runtime.runtime_dir() / "cluster-keys" / self.daemon
        if use_curve:
            secret, self.curve_server_key = make_curve_keys(self._keys)
            flags += ["--curve-secret", str(secret)]
        elif not loopback:
            flags.append("--insecure-tcp")
        self.supervisor = DaemonSupervisor(
            self.daemon,
            flags,
            host=self.ip,
            storage_dir=None if storage_dir is None else str(storage_dir),
            ready_timeout=ready_timeout,
        )
        self.supervisor.start()

    def info(self) -> dict[str, Any]:
        """Where the shard is: ``index``, ``node_id``, ``host`` (hostname), ``ip``,
        ``endpoint``, ``pid`` (None while the daemon is down), ``alive``, ``restarts``,
        ``daemon`` (its buffer name), ``curve_server_key`` (Z85, or None)."""
        return {
            **self.supervisor.info(),
            "index": self.index,
            "node_id": self.node_id,
            "host": socket.gethostname(),
            "ip": self.ip,
            "daemon": self.daemon,
            "curve_server_key": self.curve_server_key,
        }

    def describe(self, timeout: float = 5.0) -> dict[str, Any]:
        """:meth:`info` with the daemon's ``rows``, ``episodes`` and ``writers`` (None while
        it does not answer)."""
        from shmbuffer.clients.connection import Connection
        from shmbuffer.errors import ShmBufferError

        info = self.info()
        figures: dict[str, Any] = {"rows": None, "episodes": None, "writers": None}
        if info["alive"]:
            try:
                conn = Connection(
                    info["endpoint"],
                    "admin",
                    timeout=timeout,
                    curve_server_key=self.curve_server_key,
                )
                try:
                    stats = conn.call("stats")["stats"]
                finally:
                    conn.close()
                figures = {k: int(stats[k]) for k in figures}
            except ShmBufferError:
                pass
        return {**info, **figures}

    def stop(self) -> int | None:
        """Stop the daemon (SIGTERM, wait, SIGKILL) and remove the host's keys; the daemon's
        exit code."""
        code = self.supervisor.stop()
        shutil.rmtree(self._keys, ignore_errors=True)
        return code
