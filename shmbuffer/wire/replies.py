"""What a successful reply may carry: :data:`REPLIES`, every op's reply fields, and
:func:`validate_reply`, which checks a reply against it.

The request direction is ``protocol.py``'s :data:`~shmbuffer.wire.protocol.REQUESTS`, which
hands these names on; ``tests/test_protocol.py`` holds both tables and ``docs/protocol.md``
together, and ``tests/test_handlers.py`` checks that the daemon's real replies match
:data:`REPLIES`. A field added to a reply goes here, with a "(since 1.N)" comment.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shmbuffer.errors import ProtocolError
from shmbuffer.wire.spec import Spec, check_field

_NIL = type(None)
#: Seconds taken from the daemon's settings, whole where a TOML file wrote them so.
_SECONDS = (float, int)
_BIN = Spec((bytes,), required=False)  # an index array (encode_i64), sent for some kinds


def _nested(prefix: str, fields: Mapping[str, Spec]) -> dict[str, Spec]:
    return {f"{prefix}.{name}": spec for name, spec in fields.items()}


#: A segment's ``{name, path, storage_dir}`` map (nil before the first schema).
_SEGMENT = {"name": Spec((str,)), "path": Spec((str,)), "storage_dir": Spec((str,))}
#: What the ``buffer`` and ``stats`` maps both say of the buffer's layout.
_LAYOUT: dict[str, Spec] = {
    "name": Spec((str,)),
    "capacity": Spec((int,)),
    "unit": Spec((str,)),
    "mode": Spec((str,)),
    "schema": Spec((dict, _NIL)),
    "segment": Spec((dict, _NIL)),
    **_nested("segment", _SEGMENT),
}
#: The ``buffer`` map of ``hello`` and ``define_schema`` replies.
_BUFFER: dict[str, Spec] = {
    **_LAYOUT,
    "lease_ttl": Spec(_SECONDS),
    "reservation_ttl": Spec(_SECONDS),
    "max_payload_bytes": Spec((int,)),
    # since 1.2: what a reader needs to know of the sampler (a consume-once one is never
    # prefetched: a sample sent ahead would consume data the learner never asked for)
    "sampler": Spec((str,)),
    "max_times_sampled": Spec((int, _NIL)),
    # since 1.7: the sampler's own word on that, whatever its name
    "consumes": Spec((bool,), required=False),
    # since 1.8: where the daemon publishes its live runs for readers' own draws (nil: it
    # does not, a GPU buffer), and the seed they draw with (nil: from the OS)
    "local_draws": Spec((dict, _NIL), required=False),
    "local_draws.file": Spec((str,)),
    "local_draws.seed": Spec((int, _NIL)),
    # since 1.9: the metadata names episodes may carry, their kinds, and whether those are
    # all (declared up front)
    "meta": Spec((dict,), required=False),
    "meta.kinds": Spec((dict,)),
    "meta.declared": Spec((bool,)),
    # since 1.9: every table, the default one first, each a map of name, sampler, consumes
    # and max_times_sampled (the fields above are the default table's)
    "tables": Spec((list,), required=False),
}
#: The ``stats.sampler`` map (since 1.2).
_SAMPLER: dict[str, Spec] = {
    "kind": Spec((str,)),
    "settings": Spec((dict,)),  # its constructor options, as ``--sampler`` flags set them
    "figures": Spec((dict,)),  # its own counts (kind-specific: epochs, retired items, ...)
}
#: The ``stats.rate_limiter`` map.
_LIMITER: dict[str, Spec] = {
    "kind": Spec((str,)),
    "min_size": Spec((int,)),
    # since 1.2
    "settings": Spec((dict,)),
    "inserted": Spec((int,)),
    "sampled": Spec((int,)),
    "deleted": Spec((int,)),
    "size": Spec((int,)),
    "insert_blocked_s": Spec((float,)),
    "sample_blocked_s": Spec((float,)),
    "inserts_waiting": Spec((int,)),
    "samples_waiting": Spec((int,)),
}
#: The ``stats`` map: the buffer's state, then the daemon's counters.
_STATS: dict[str, Spec] = {
    **_LAYOUT,
    "rows": Spec((int,)),
    "episodes": Spec((int,)),
    "fill": Spec((float,)),
    "pointer": Spec((int,)),
    "insert_rows_per_s": Spec((float,)),
    "sample_rows_per_s": Spec((float,)),
    "writers": Spec((int,)),
    "readers": Spec((int,)),
    # one map per client: id, role, pid, host, remote, idle_s, reservations, leases,
    # rows_committed, rows_sampled (for `status --watch`; a client ignores what it lacks)
    "clients": Spec((list,)),
    "reservations": Spec((int,)),
    "reserved_rows": Spec((int,)),
    # one map per pinned reservation past its TTL or whose connection is gone: pid,
    # reservation, rows, past_ttl_s, connected (``daemon/pins.py``)
    "stalled_writers": Spec((list,)),
    "leases": Spec((int,)),
    "uptime_s": Spec((float,)),
    "pid": Spec((int,)),
    "protocol": Spec((str,)),
    "rate_limiter": Spec((dict,)),
    **_nested("rate_limiter", _LIMITER),
    "sampler": Spec((dict,)),
    **_nested("sampler", _SAMPLER),
    **{
        counter: Spec((int,))
        for counter in (
            "rows_committed",
            "episodes_committed",
            "rows_sampled",
            "samples",
            "messages",
            "errors",
            "reservations_expired",
            "leases_expired",
            "clients_reaped",
            "clients_expired",
            "priority_updates",
            "priority_updates_stale",
            "rows_rewritten",  # since 1.11
        )
    },
    # since 1.9 (one, "default", without --table): name -> {sampler, rate_limiter,
    # priority_updates, priority_updates_stale, holds_writes}, the maps as above, the default
    # table first; holds_writes: why writes wait for that table now (nil: they do not)
    "tables": Spec((dict,), required=False),
    # since 1.10, with compressed columns: their byte store's bytes, used, fill, ratio (raw
    # bytes of the live episodes' columns over their chunks'), columns (name -> codec)
    "compressed": Spec((dict,), required=False),
}

#: Every op's successful reply fields (besides ``v``, ``seq`` and ``ok``); a field inside a map
#: is named by its path (``buffer.name``). ``required=False``: present only for some requests.
REPLIES: dict[str, dict[str, Spec]] = {
    "hello": {
        "client": Spec((int,)),
        "buffer": Spec((dict,)),
        **_nested("buffer", _BUFFER),
        "daemon_pid": Spec((int,)),
    },
    "bye": {},
    "ping": {"pid": Spec((int,)), "protocol": Spec((str,))},
    "stats": {"stats": Spec((dict,)), **_nested("stats", _STATS)},
    "define_schema": {"buffer": Spec((dict,)), **_nested("buffer", _BUFFER)},
    "reserve": {
        "reservation": Spec((int,)),  # 0: an ``ahead`` reserve that was not granted
        "ranges": Spec((list,)),
        "committed": Spec((list,), required=False),  # with the request's 'commit(s)'
        # with 'count' (since 1.5): [reservation, ranges] of each granted after the first
        "more": Spec((list,), required=False),
        # with 'chunks' (since 1.10): each chunk's first byte in bytes.bin, i64, in the
        # order of the request's chunks
        "offsets": _BIN,
    },
    "commit": {"episodes": Spec((list,))},
    "abort": {},
    "write": {"episodes": Spec((list,))},
    # since 1.11: rows rewritten, and the positions (in the request's rows) of those skipped
    "rewrite": {"written": Spec((int,)), "skipped": Spec((bytes,))},
    "sample": {
        "rows": _BIN,
        "starts": _BIN,
        "ids": _BIN,
        "lengths": _BIN,
        "gens": _BIN,
        "lease": Spec((int,), required=False),
        # with info (since 1.2): per item, f64 arrays for probability and weight
        "index": _BIN,
        "generation": _BIN,
        "probability": _BIN,
        "weight": _BIN,
        # with context (since 1.10): per drawn row, the rows of its episode before it and
        # from it on (itself included), i64
        "before": _BIN,
        "left": _BIN,
    },
    "drawn": {"counted": Spec((int,))},
    # since 1.9: episode ids (i64), and per name its kind and values (nil where missing)
    "episodes": {"ids": Spec((bytes,)), "kinds": Spec((dict,)), "columns": Spec((dict,))},
    "update_priorities": {"updated": Spec((int,)), "stale": Spec((int,))},
    "iterate": {"rows": Spec((bytes,)), "gens": Spec((bytes,)), "total": Spec((int,))},
    "read": {},
    "configure": {"rate_limiter": Spec((dict,)), **_nested("rate_limiter", _LIMITER)},
    "release": {},
    "renew": {"ttl": Spec(_SECONDS)},
    "clear": {},
    "shutdown": {},
    "checkpoint": {
        "path": Spec((str,)),
        "bytes": Spec((int,)),
        "seconds": Spec((float,)),
        "copied_bytes": Spec((int,)),
        "linked_bytes": Spec((int,)),
        "max_pause_ms": Spec((float,)),
    },
}


def validate_reply(op: str, fields: Mapping[str, Any]) -> None:
    """Check a successful reply's fields (without v/seq/ok) against :data:`REPLIES`: no field
    the table lacks, every required one present (inside a map: whenever the map is), each of
    its type. The tests run it on the daemon's real replies; a ProtocolError names the field."""
    _check_reply_map(op, "", fields, REPLIES[op])


def _check_reply_map(
    op: str, prefix: str, value: Mapping[str, Any], specs: dict[str, Spec]
) -> None:
    level = {
        name[len(prefix) :]: spec
        for name, spec in specs.items()
        if name.startswith(prefix) and "." not in name[len(prefix) :]
    }
    for key in value.keys() - level.keys():
        raise ProtocolError(f"op {op!r}: reply field {prefix + str(key)!r} is not in REPLIES")
    for key, spec in level.items():
        path = prefix + key
        if key not in value:
            if spec.required:
                raise ProtocolError(f"op {op!r}: reply field {path!r} is missing")
            continue
        check_field(op, path, value[key], spec, what="reply field")
        # a map is looked into only where the table lists its fields (a schema spec is free)
        if isinstance(value[key], dict) and any(n.startswith(path + ".") for n in specs):
            _check_reply_map(op, path + ".", value[key], specs)
