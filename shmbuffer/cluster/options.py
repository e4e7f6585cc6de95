"""``ShardedBuffer.create(**daemon_options)`` as ``shmbuffer-daemon start`` flags, and the
names a shard's daemon goes by.

Only flags of ``start`` that mean the same on every node are taken; those the cluster sets per
shard (name, endpoint, capacity, unit, resume, ...) or whose files would have to exist on every
node (CURVE keys: the cluster makes its own) are refused by name. Values are checked by the
daemon's own parser when it starts (an error then names the flag).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from shmbuffer.names import UNITS, validate_name
from shmbuffer.samplers import OPTIONS

#: ``start`` flags a cluster passes through, as keyword names (the sampler's: as the samplers
#: declare them).
DAEMON_OPTIONS = frozenset(
    {
        *(option.name for option in OPTIONS),
        "mode",
        "schema",
        "storage_dir",
        "lease_ttl",
        "reservation_ttl",
        "group",
        "insecure_tcp_admin",
        "metrics_port",
        "metrics_host",
        "seed",
        "sampler",
        "rate_limiter",
        "min_size",
        "samples_per_insert",
        "error_buffer",
        "log_level",
        # name -> the options one Buffer(tables=...) table takes: a --table flag each
        "tables",
    }
)
#: Options the cluster decides itself, with the reason given to whoever passes one.
RESERVED = {
    "name": "the cluster names each shard's daemon after the buffer and its node",
    "endpoint": "each shard listens on its node's address (a free port)",
    "capacity": "pass capacity to ShardedBuffer.create",
    "unit": "pass unit to ShardedBuffer.create",
    "resume": "the shard host resumes a daemon that died by itself",
    "restore": "not supported by a cluster",
    "detach": "the shard host keeps its daemon as a child",
    "config": "pass the settings as keyword arguments",
    "curve_secret": "the cluster makes each shard's CURVE keys (curve=True)",
    "curve_clients": "the cluster makes each shard's CURVE keys (curve=True)",
    "insecure_tcp": "pass curve=False to ShardedBuffer.create",
    "keep": "a shard's segment goes with its daemon",
}
#: Longest buffer name: a shard's daemon is ``<name>.<12 hex of the node id>``.
MAX_NAME = 64 - 13
NODE_TAG = 12


def shard_name(name: str, node_id: str) -> str:
    """The daemon (and segment) name of ``name``'s shard on node ``node_id``: simulated nodes
    share one host, /dev/shm and runtime folder, so the node scopes it."""
    return validate_name(f"{name}.{node_id[:NODE_TAG]}")


def check_name(name: str) -> str:
    if not isinstance(name, str) or len(name) > MAX_NAME:
        raise ValueError(
            f"ShardedBuffer name must be a string of at most {MAX_NAME} characters (a shard "
            f"adds its node), got {name!r}"
        )
    return validate_name(name)


def check_capacity(capacity: Any, unit: str) -> tuple[int, str]:
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be a positive int (rows per shard), got {capacity!r}")
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {list(UNITS)}, got {unit!r}")
    return capacity, unit


def check_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The daemon options, checked by name (ValueError naming a reserved or unknown one)."""
    for key in options:
        if key in RESERVED:
            raise ValueError(f"daemon option {key!r} cannot be given: {RESERVED[key]}")
        if key not in DAEMON_OPTIONS:
            raise ValueError(
                f"unknown daemon option {key!r}; known: {', '.join(sorted(DAEMON_OPTIONS))}"
            )
    tables = options.get("tables")
    if tables is not None:
        if not isinstance(tables, Mapping) or not tables:
            raise ValueError(f"daemon option 'tables' must map names to options, got {tables!r}")
        for name, given in tables.items():
            if not isinstance(name, str) or not isinstance(given, Mapping):
                raise ValueError(f"daemon option 'tables': table {name!r} needs a mapping")
    seed = options.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"daemon option 'seed' must be an int, got {seed!r}")
    return dict(options)


def start_flags(options: Mapping[str, Any], shard_index: int) -> list[str]:
    """``start`` flags for the ``shard_index``-th shard (``log_level`` comes first, before
    the command). A seed becomes ``seed + shard_index``: shards with one seed would draw the
    same positions."""
    flags: list[str] = []
    level = options.get("log_level")
    if level is not None:
        flags += ["--log-level", str(level)]
    flags.append("start")
    for key, value in sorted(options.items()):
        if value is None or value is False or key == "log_level":
            continue
        if key == "tables":  # in their order: the first is the default table
            flags += [
                arg for name, given in value.items() for arg in ("--table", table_flag(name, given))
            ]
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"daemon option {key!r} must be finite, got {value!r}")
        flags += [flag, str(int(value) + shard_index if key == "seed" else value)]
    return flags


def table_flag(name: str, options: Mapping[str, Any]) -> str:
    """One table's ``--table`` value, ``NAME:SAMPLER,option=value...`` (the daemon checks
    the options when it starts, naming the table)."""
    rest = {k: v for k, v in options.items() if k != "sampler" and v is not None}
    pairs = [f"{k.replace('_', '-')}={v}" for k, v in rest.items()]
    return ",".join([f"{name}:{options.get('sampler', 'uniform')}", *pairs])
