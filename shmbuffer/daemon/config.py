"""The daemon's settings: defaults, a TOML config file, and command-line overrides."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from shmbuffer.names import MODES, UNITS, check_choice, validate_name
from shmbuffer.runtime import runtime_dir


@dataclass
class DaemonConfig:
    name: str = "default"
    capacity: int = 100_000
    unit: str = "transition"
    mode: str = "circular"
    #: Declared schema spec (``{"obs": {"dtype": "float32", "shape": [64]}}``) or None (lazy).
    schema: dict[str, Any] | None = None
    endpoint: str | None = None
    storage_dir: str | None = None
    #: Seconds a reader's lease on episodes lasts without being released.
    lease_ttl: float = 30.0
    #: Seconds a writer may hold rows between reserve and commit.
    reservation_ttl: float = 60.0
    max_clients: int = 1024
    max_reservations_per_client: int = 64
    max_leases_per_client: int = 4096
    #: Largest remote write / payload sample, in bytes (a bigger single frame is dropped by
    #: libzmq, which disconnects its sender; see tests/e2e/test_limits.py).
    max_payload_bytes: int = 1 << 31
    #: Seconds a client holding nothing may stay silent before it is forgotten (local clients
    #: whose process died are forgotten at once: the daemon checks their pids).
    client_idle_ttl: float = 3600.0
    seed: int | None = None
    #: Access control (see ``shmbuffer/daemon/security.py``): a group name or gid that may
    #: use the segment (0750/0660) and the ipc socket (0660); None keeps them owner-only.
    group: str | int | None = None
    #: CURVE secret certificate (``shmbuffer-daemon keygen``): the socket becomes a CURVE
    #: server; clients need its public key.
    curve_secret: str | None = None
    #: Folder of allowed client public keys (``*.key``); None admits any client with the key.
    curve_clients: str | None = None
    #: Allow binding a non-loopback tcp endpoint without CURVE.
    insecure_tcp: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate_name(self.name)
        check_choice("unit", self.unit, UNITS)
        check_choice("mode", self.mode, MODES)
        if not isinstance(self.capacity, int) or self.capacity < 1:
            raise ValueError(f"capacity must be a positive integer, got {self.capacity!r}")
        for name in ("lease_ttl", "reservation_ttl", "client_idle_ttl"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        for name in (
            "max_clients",
            "max_reservations_per_client",
            "max_leases_per_client",
            "max_payload_bytes",
        ):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def resolved_endpoint(self) -> str:
        return self.endpoint or f"ipc://{runtime_dir() / (self.name + '.sock')}"

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> DaemonConfig:
        """Defaults, then the TOML file (top level or a ``[daemon]`` table), then overrides
        that are not None. Unknown keys in the file are an error naming them."""
        values: dict[str, Any] = {}
        if path is not None:
            with open(path, "rb") as f:
                data = tomllib.load(f)
            data = data.get("daemon", data)
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(data) - known)
            if unknown:
                raise ValueError(f"{path}: unknown settings {unknown}; known: {sorted(known)}")
            values.update(data)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def load_schema_file(path: str | Path) -> dict[str, Any]:
    """A schema spec from a TOML or JSON file (by extension)."""
    path = Path(path)
    if path.suffix == ".json":
        import json

        with open(path) as f:
            return dict(json.load(f))
    with open(path, "rb") as f:
        data = tomllib.load(f)
    return dict(data.get("schema", data))
