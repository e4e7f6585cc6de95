"""Run one scenario as another user: ``python -m tests.e2e._as_user UID GID SCENARIO ARGS…``.

The test process is root; this child starts as root too, imports everything it will need,
then drops to ``UID``/``GID`` (groups: just ``GID``) and runs the scenario. The imports come
first because our interpreter lives in root's home, which the other user cannot read: a lazy
import after the switch would fail for reasons that have nothing to do with shmbuffer.

Scenarios print one JSON line on stdout; ``daemon`` runs ``shmbuffer-daemon start ARGS…``
until it is signalled.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

# Everything the scenarios reach, imported while the interpreter's files are still readable.
import numpy  # noqa: F401
import torch  # noqa: F401
import zmq  # noqa: F401

import shmbuffer.cli
import shmbuffer.cli.demo_loops
import shmbuffer.clients.connection
import shmbuffer.clients.reader
import shmbuffer.clients.writer
import shmbuffer.daemon.checkpoint
import shmbuffer.daemon.journal
import shmbuffer.daemon.recovery
import shmbuffer.daemon.server
import shmbuffer.daemon.service
import shmbuffer.runtime
from shmbuffer import Reader, Writer
from shmbuffer.errors import ShmBufferError
from shmbuffer.storage.schema import Schema
from shmbuffer.storage.segment import Segment, default_storage_dir

SMALL = Schema.from_spec({"obs": {"dtype": "uint8", "shape": [4]}})


def create_segment(name: str, other_data: str) -> dict[str, Any]:
    """Make a segment in the default storage root; try to open another user's data file; run
    ``cleanup --dry-run``."""
    out: dict[str, Any] = {"root": str(default_storage_dir())}
    try:
        seg = Segment.create(name, SMALL, 4)
        out["created"] = str(seg.path)
        seg.close()
    except (ShmBufferError, OSError) as exc:
        out["created"] = f"{type(exc).__name__}: {exc}"
    try:
        open(other_data, "r+b").close()
        out["other"] = "opened"
    except OSError as exc:
        out["other"] = type(exc).__name__
    try:
        out["cleanup"] = shmbuffer.daemon.recovery.cleanup(dry_run=True)
    except Exception as exc:
        out["cleanup"] = f"{type(exc).__name__}: {exc}"
    return out


def write_and_sample(target: str, remote: str = "") -> dict[str, Any]:
    """One episode through a Writer (the first one defines a lazy schema), one sample back;
    with ``remote`` (any text) both pass ``remote=True``. ``seconds``: how long it took."""
    out: dict[str, Any] = {}
    began = time.monotonic()
    options: dict[str, Any] = {"timeout": 10, "remote": True if remote else None}
    try:
        with Writer(target, **options) as writer:
            writer.add_episode(shmbuffer.cli.demo_loops.make_episode(0, 0, 10, (2,)))
            writer.flush()
        with Reader(target, **options) as reader:
            out["sampled"] = int(reader.sample(4).batch_size[0])
            out["segment"] = str(reader.segment.path) if reader.segment is not None else None
    except (ShmBufferError, OSError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["seconds"] = time.monotonic() - began
    return out


def resolve(name: str, runtime_dir: str = "") -> dict[str, Any]:
    """Find ``name`` as clients do (``runtime.resolve_endpoint``): with this process's own
    environment, then (if given) with ``SHMBUFFER_RUNTIME_DIR`` pointed at ``runtime_dir``."""
    out: dict[str, Any] = {}
    attempts = [("by_name", None)] + ([("by_dir", runtime_dir)] if runtime_dir else [])
    for key, folder in attempts:
        if folder is not None:
            os.environ["SHMBUFFER_RUNTIME_DIR"] = folder
        try:
            out[key] = shmbuffer.runtime.resolve_endpoint(name)
        except (ShmBufferError, OSError) as exc:
            out[key] = f"{type(exc).__name__}: {exc}"
    return out


def main() -> int:
    uid, gid, scenario, *args = sys.argv[1:]
    os.setgroups([int(gid)])
    os.setgid(int(gid))
    os.setuid(int(uid))
    if scenario == "daemon":
        return shmbuffer.cli.main(["start", *args])
    scenarios = {"segment": create_segment, "write": write_and_sample, "resolve": resolve}
    result = scenarios[scenario](*args)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
