"""The daemon's settings: defaults, a TOML config file, and command-line overrides."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from shmbuffer.api.metadata import check_kinds
from shmbuffer.daemon.table_config import built_config_tables, normalized_tables
from shmbuffer.errors import ConfigError, InvalidArgumentError
from shmbuffer.names import MODES, UNITS, check_choice, validate_name
from shmbuffer.runtime import ENV_RUNTIME_DIR, group_user_dir, runtime_dir
from shmbuffer.samplers import (
    OPTIONS,
    RATE_LIMITERS,
    SAMPLERS,
    Option,
    RateLimiter,
    Sampler,
    build_rate_limiter,
    build_sampler,
)
from shmbuffer.storage.cuda_segment import cuda_problem, normalize_device
from shmbuffer.storage.schema import Schema

#: Longest ipc socket path: ``sun_path`` holds 108 bytes on Linux, one of them the final NUL.
MAX_IPC_PATH_BYTES = 107
MAX_PORT = 65535

#: The sampler's and the rate limiter's settings (``--priority-exponent`` ...), each None
#: unless given: the sampler's own default then, and a setting given that the chosen sampler or
#: limiter does not take is refused at start. The sampler's are what the samplers declare
#: (``Sampler.options``); each is a field below too (tests/test_sampler_declarations.py).
SAMPLER_OPTIONS = tuple(option.name for option in OPTIONS)
LIMITER_OPTIONS = ("min_size", "samples_per_insert", "error_buffer")


def check_endpoint(endpoint: str) -> str:
    """``endpoint`` if the daemon can bind it as written, else :class:`ConfigError` saying
    why: only ``ipc://PATH`` (at most 107 bytes: libzmq fails a longer one with a bare
    ``ZMQError``) and ``tcp://HOST:PORT`` with a port of 1-65535, or ``*``/``0`` for one chosen
    at bind time (libzmq takes ``:99999`` as a request for any free port)."""
    if not isinstance(endpoint, str):
        raise ConfigError(f"endpoint must be a string, got {endpoint!r}")
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :]
        size = len(os.fsencode(path))
        if not path:
            raise ConfigError(f"endpoint {endpoint!r}: the ipc path is empty")
        if size > MAX_IPC_PATH_BYTES:
            raise ConfigError(
                f"endpoint {endpoint!r}: the ipc path is {size} bytes, over the kernel's limit "
                f"of {MAX_IPC_PATH_BYTES} for a socket path; use a shorter path (or a shorter "
                f"${ENV_RUNTIME_DIR} for the default endpoint)"
            )
        return endpoint
    if endpoint.startswith("tcp://"):
        rest = endpoint[len("tcp://") :].rsplit(";", 1)[-1]  # SOURCE;DEST: DEST is bound
        host, sep, port = rest.rpartition(":")
        if not sep or not host.strip("[]"):
            raise ConfigError(
                f"endpoint {endpoint!r}: expected tcp://HOST:PORT (HOST * for every interface)"
            )
        if port != "*" and not (port.isdigit() and int(port) <= MAX_PORT):
            raise ConfigError(
                f"endpoint {endpoint!r}: port {port!r} is not 1-{MAX_PORT}, or * / 0 for any "
                "free port"
            )
        return endpoint
    scheme = endpoint.partition("://")[0] if "://" in endpoint else endpoint
    raise ConfigError(
        f"endpoint {endpoint!r}: transport {scheme!r} is not supported; use ipc://PATH or "
        "tcp://HOST:PORT"
    )


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
    #: Seeds the daemon's random generator (every draw) and iterate's shuffles.
    seed: int | None = None
    #: A sampler's name (``shmbuffer.samplers.SAMPLERS``); the options below are those the
    #: samplers declare.
    sampler: str = "uniform"
    priority_exponent: float | None = None
    importance_exponent: float | None = None
    priority_eps: float | None = None
    max_times_sampled: int | None = None
    #: ``none``, ``min-size`` or ``sample-to-insert``; its settings are counted in rows.
    rate_limiter: str = "none"
    min_size: int | None = None
    samples_per_insert: float | None = None
    error_buffer: float | None = None
    #: Episode metadata names and their kinds (``{"ret": "float", "env_id": "str"}``: then no
    #: other name is taken), or None to take them as writers give them (docs/metadata.md).
    meta: dict[str, str] | None = None
    #: Several tables over the rows (``--table``, ``[tables.NAME]``): name -> the options one
    #: ``Buffer(tables=...)`` table takes, the first the default table; None: one table,
    #: ``"default"``, of the sampler and limiter settings above (which go inside a table
    #: once there are tables, never beside them). See ``daemon/table_config.py``.
    tables: dict[str, dict[str, Any]] | None = None
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
    #: Allow admin requests (clear, shutdown, checkpoint) on a tcp endpoint without CURVE,
    #: where any local user can connect and claim the admin role (see security.py).
    insecure_tcp_admin: bool = False
    #: Serve Prometheus metrics over HTTP on this port (``--metrics-port``; 0: any free port,
    #: logged and written to the runtime file); None serves none. Needs ``prometheus_client``
    #: (the ``live`` extra). See ``shmbuffer/daemon/metrics.py``.
    metrics_port: int | None = None
    #: The address the metrics server listens on: loopback unless asked otherwise.
    metrics_host: str = "127.0.0.1"
    #: Where the rows live (``--device``): ``cpu`` (a tmpfs segment) or ``cuda``/``cuda:N``
    #: (one allocation on that GPU, shared with clients by CUDA IPC; stamps stay on the host).
    #: See docs/cuda.md.
    device: str = "cpu"
    #: ``--pin-memory``: a CPU buffer that every reader with CUDA page-locks in its own
    #: process (``cudaHostRegister``), so host -> device copies of its rows run as DMA.
    pin_memory: bool = False
    #: ``--compressed-bytes``: the size of the byte store of the schema's compressed columns
    #: (``bytes.bin`` beside the rows; docs/compression.md). None: the schema has none.
    compressed_bytes: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate_name(self.name)
        check_choice("unit", self.unit, UNITS)
        check_choice("mode", self.mode, MODES)
        if not isinstance(self.capacity, int) or self.capacity < 1:
            raise ValueError(f"capacity must be a positive integer, got {self.capacity!r}")
        for name in ("lease_ttl", "reservation_ttl", "client_idle_ttl"):
            value = getattr(self, name)
            # nan passes a `<= 0` test and would make every deadline comparison false
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if not number or not math.isfinite(value) or value <= 0:
                raise ConfigError(
                    f"{name} must be a positive, finite number of seconds, got {value!r}"
                )
        for name in ("insecure_tcp", "insecure_tcp_admin"):
            if type(getattr(self, name)) is not bool:  # a TOML string "false" would be truthy
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.endpoint is not None:
            check_endpoint(self.endpoint)
        for name in (
            "max_clients",
            "max_reservations_per_client",
            "max_leases_per_client",
            "max_payload_bytes",
        ):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        nbytes = self.compressed_bytes
        if nbytes is not None and (type(nbytes) is not int or nbytes < 1):
            raise ConfigError(
                f"compressed_bytes must be a positive integer (bytes), got {nbytes!r}"
            )
        if self.seed is not None and (type(self.seed) is not int or self.seed < 0):
            raise ConfigError(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.meta is not None:
            try:
                self.meta = check_kinds(self.meta)
            except InvalidArgumentError as exc:
                raise ConfigError(f"--meta: {exc}") from None
        self._check_metrics()
        self._check_device()
        if self.tables is not None:
            self.tables = normalized_tables(self.tables)
            beside = [_flag(k) for k in _TABLE_WORDS if getattr(self, k) != _PLAIN.get(k)]
            if beside:
                raise ConfigError(
                    f"with --table give {', '.join(beside)} per table "
                    "(NAME:SAMPLER,option=value...), inside --table, not beside it"
                )
        self.make_tables()  # refuses a bad sampler or limiter setting before anything starts

    def make_tables(self) -> dict[str, tuple[Sampler, RateLimiter]]:
        """Each table's new sampler and limiter, by name, the default table first: the
        configured ``tables``, or one named ``"default"`` of :meth:`make_sampler` and
        :meth:`make_rate_limiter`. ConfigError naming the table or the flag."""
        if self.tables is None:
            return {"default": (self.make_sampler(), self.make_rate_limiter())}
        return built_config_tables(self.tables, self.capacity)

    def _check_metrics(self) -> None:
        """``--metrics-port``/``--metrics-host``: a port of 0-65535 and a host name, and
        ``prometheus_client`` installed when a port is given (checked before anything
        starts, so a missing extra is not found after the segment was allocated)."""
        if not isinstance(self.metrics_host, str) or not self.metrics_host.strip():
            raise ConfigError(
                f"--metrics-host must be a host name or address, got {self.metrics_host!r}"
            )
        port = self.metrics_port
        if port is None:
            return
        if type(port) is not int or not 0 <= port <= MAX_PORT:
            raise ConfigError(
                f"--metrics-port must be a port of 1-{MAX_PORT} (0: any free port), got {port!r}"
            )
        if importlib.util.find_spec("prometheus_client") is None:
            raise ConfigError(
                "--metrics-port needs prometheus_client, which is not installed: "
                "pip install 'shmbuffer[live]'"
            )

    def _check_device(self) -> None:
        """``--device`` and ``--pin-memory``, checked against what this process's torch
        reports before anything is allocated (the daemon allocates, so it must see the GPU)."""
        if type(self.pin_memory) is not bool:
            raise ConfigError(f"pin_memory must be true or false, got {self.pin_memory!r}")
        try:
            self.device = normalize_device(self.device)
        except ValueError as exc:
            raise ConfigError(f"--device: {exc}") from None
        if self.device != "cpu":
            if self.pin_memory:
                raise ConfigError(
                    f"--pin-memory page-locks a CPU buffer; with --device {self.device} the rows "
                    "live on the GPU already: give one or the other"
                )
            problem = cuda_problem(self.device)
            if problem is not None:
                raise ConfigError(f"--device {self.device}: this process cannot use it: {problem}")
        elif self.pin_memory:
            problem = cuda_problem()
            if problem is not None:
                raise ConfigError(
                    f"--pin-memory needs CUDA (it page-locks the rows for GPU copies): {problem}"
                )

    def make_sampler(self) -> Sampler:
        """A new sampler as configured; ConfigError naming the setting (as its flag) that is
        unknown, out of range, or not taken by the chosen sampler."""
        if self.sampler not in SAMPLERS:
            raise ConfigError(f"--sampler {self.sampler!r}: expected one of {list(SAMPLERS)}")
        options = {option.name: _checked(option, getattr(self, option.name)) for option in OPTIONS}
        try:
            return build_sampler(self.sampler, **options)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"--sampler {self.sampler}: {_as_flags(str(exc))}") from None

    def make_rate_limiter(self) -> RateLimiter:
        """A new rate limiter as configured (ConfigError as :meth:`make_sampler`).
        ``sample-to-insert`` needs ``--samples-per-insert`` and ``--error-buffer``;
        ``--min-size`` defaults to 1 for it and for ``min-size``."""
        kind = self.rate_limiter
        if kind not in RATE_LIMITERS:
            raise ConfigError(f"--rate-limiter {kind!r}: expected one of {list(RATE_LIMITERS)}")
        options = {name: getattr(self, name) for name in LIMITER_OPTIONS}
        for name in ("samples_per_insert", "error_buffer"):
            _check_number(name, options[name])
        if options["min_size"] is not None and type(options["min_size"]) is not int:
            raise ConfigError(f"--min-size must be an integer, got {options['min_size']!r}")
        if kind == "sample-to-insert":
            needed = ("samples_per_insert", "error_buffer")
            missing = [_flag(name) for name in needed if options[name] is None]
            if missing:
                raise ConfigError(
                    f"--rate-limiter sample-to-insert needs {' and '.join(missing)} (Reverb's "
                    "SampleToInsertRatio: samples per inserted row, and the slack in rows "
                    "around it, at least max(1, samples_per_insert))"
                )
        if kind in ("sample-to-insert", "min-size") and options["min_size"] is None:
            options["min_size"] = 1
        try:
            limiter = build_rate_limiter(kind, **options)
            limiter.bind(self.capacity)  # a --min-size above --capacity is never met
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"--rate-limiter {kind}: {_as_flags(str(exc))}") from None
        return limiter

    @property
    def resolved_endpoint(self) -> str:
        """``endpoint``, else the default ipc socket: ``<runtime dir>/<name>.sock``, or with
        ``group`` in the group's discovery folder (``runtime.group_user_dir``), which its
        members can reach wherever the runtime dir is (``$XDG_RUNTIME_DIR`` is owner-only)."""
        if self.endpoint:
            return check_endpoint(self.endpoint)
        from shmbuffer.daemon.security import resolve_group

        gid = resolve_group(self.group)
        folder = runtime_dir() if gid is None else group_user_dir(gid)
        return check_endpoint(f"ipc://{folder / (self.name + '.sock')}")

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> DaemonConfig:
        """Defaults, then the TOML file (top level or a ``[daemon]`` table), then overrides
        that are not None. Unknown keys in the file are an error naming them."""
        values: dict[str, Any] = {}
        if path is not None:
            try:
                with open(path, "rb") as f:
                    data = tomllib.load(f)
            except (OSError, ValueError) as exc:  # ValueError: tomllib.TOMLDecodeError
                raise ConfigError(f"config file {path}: {exc}") from exc
            tables = data.get("tables") if "daemon" in data else None
            data = dict(data.get("daemon", data))
            if tables is not None:  # [tables.NAME] beside [daemon]
                data.setdefault("tables", tables)
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(data) - known)
            if unknown:
                raise ValueError(f"{path}: unknown settings {unknown}; known: {sorted(known)}")
            values.update(data)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


#: The one-table settings that ``tables`` replaces, and their values when not given.
_TABLE_WORDS = ("sampler", *SAMPLER_OPTIONS, "rate_limiter", *LIMITER_OPTIONS)
_PLAIN: dict[str, Any] = {"sampler": "uniform", "rate_limiter": "none"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _as_flags(message: str) -> str:
    """A sampler's or limiter's message with its option names as the flags that set them."""
    for name in (*SAMPLER_OPTIONS, *LIMITER_OPTIONS):
        message = message.replace(name, _flag(name))
    return message


def _checked(option: Option[Any], value: Any) -> Any:
    """``value`` of a declared sampler option if given as its type allows (an integer, or a
    finite number for a float option; a TOML string or bool is refused)."""
    if option.type is float:
        _check_number(option.name, value)
    elif value is not None and type(value) is not int:
        raise ConfigError(f"{option.flag} must be an integer, got {value!r}")
    return value


def _check_number(name: str, value: Any) -> None:
    """A setting that must be a finite number if given (a TOML string or bool is refused)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{_flag(name)} must be a finite number, got {value!r}")


def load_schema_file(path: str | Path) -> dict[str, Any]:
    """A schema spec from a TOML or JSON file (by extension), checked here so that every
    error, a syntax error or a bad dtype, names the file."""
    path = Path(path)
    try:
        if path.suffix == ".json":
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        else:
            with open(path, "rb") as f:
                data = tomllib.load(f)
            data = data.get("schema", data)
        if not isinstance(data, dict):
            raise ConfigError(f"expected a table of keys, got {type(data).__name__}")
        Schema.from_spec(data)
    except (OSError, ValueError) as exc:  # decode errors and SchemaError are ValueErrors
        raise ConfigError(f"schema file {path}: {exc}") from exc
    return dict(data)
