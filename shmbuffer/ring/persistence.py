"""A ring and its tables across restarts: their state, and the journal's replayed draws.

A state holds the registry, the ring's position and every table's sampler (its kind, settings
and state), limiter counts, generator state and priority counters, as plain values
(:func:`state_of`, :func:`load_state`). The default table's sit at the top level, where they
always were, so states saved before several tables existed load as they did; every other
table's are under ``"tables"`` by name, in the container's order, and the default table's name
under ``"table"``. The journal's replay runs the same code as the live requests: the ring's
``replay_*`` methods tell every listener what a commit or eviction did, so it is redone on
``--resume`` too, and :func:`replay_sample` draws a journaled sample again on the table that
drew it (the generator set as it was), so what samples changed (consumption, epochs,
``max_times_sampled`` counts, the limiter's sampled count) comes back as well.
"""

from __future__ import annotations

import base64
import operator
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from shmbuffer.api.reads import expand_slices
from shmbuffer.errors import ShmBufferError
from shmbuffer.registry.intervals import EpisodeRegistry
from shmbuffer.ring.listeners import EPISODES, ROWS, SLICES, SampleRecord, set_rng_words
from shmbuffer.ring.ring import Ring
from shmbuffer.ring.table import Table
from shmbuffer.storage.rows import episode_rows


def state_of(ring: Ring, tables: Mapping[str, Table]) -> dict[str, Any]:
    """Everything a restart needs, open reservations aside (their rows are never
    published): ring, registry, and each table's parts (:func:`table_state`): the first of
    ``tables`` (the default one) at the top level, the others under ``"tables"`` by name.
    Plain values, JSON- and msgpack-able both: bytes travel as ``{"b64": ...}`` and integers
    beyond 64 bits (the generators') as ``{"int": "..."}``."""
    (default, table), *others = tables.items()
    state = {
        "capacity": ring.capacity,
        "unit": ring.unit,
        "mode": ring.mode,
        "pointer": ring.pointer,
        "rows_written": ring.rows_written,
        "next_reservation": ring.next_reservation,
        "registry": ring.registry.to_state(),
        # the entry that ends at the ring's end and goes on at row 0 (one episode written
        # across the wrap), which a reader of the saved rows must join again
        "wrap_split": ring.wrap_split,
        # which tables hold the live episodes written into only some (ring/members.py)
        "members": (
            ring.membership.state([ep.id for ep in ring.registry]) if len(ring.membership) else []
        ),
        **table_state(table),
    }
    if others or default != "default":  # one table named "default": the layout of old
        state["table"] = default
        state["tables"] = {name: table_state(each) for name, each in others}
    return state


def table_state(table: Table) -> dict[str, Any]:
    """One table's sampler (its kind, settings and state), limiter (kind, settings, counts),
    generator state and priority counters."""
    return {
        "sampler": {
            "name": table.sampler.name,
            "settings": table.sampler.settings(),
            "state": encode_state(table.sampler.state_dict()),
        },
        "rate_limiter": {
            "name": table.rate_limiter.name,
            "settings": table.rate_limiter.settings(),
            "state": encode_state(table.rate_limiter.state_dict()),
        },
        "rng": encode_state(table.rng.bit_generator.state),
        "priority_updates": table.priority_updates,
        "priority_updates_stale": table.priority_updates_stale,
    }


def saved_tables(state: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """Each saved table's entry by name, the default one first: the state itself for the
    default table (its parts are at the top level), named ``"default"`` in a state saved
    before several tables existed."""
    others = state.get("tables") or {}
    if not isinstance(others, Mapping):
        raise ValueError(f"saved tables must be a mapping, got {type(others).__name__}")
    return {str(state.get("table", "default")): state, **others}


def load_state(ring: Ring, tables: Mapping[str, Table], state: Mapping[str, Any]) -> None:
    """``ring`` and its ``tables`` (by name, the default one first) take over ``state`` (see
    :func:`state_of`); a table the state does not have starts over from the loaded registry (a state
    of one table, saved before tables had names, is the default table's). Open reservations are
    dropped and use counters restart at 0 for every committed row, or take a table entry's
    ``"use_counts"`` (an array, what the dead daemon's counter file held: see
    :func:`adopt_use_counts`) when it is there. ValueError when it does not fit (capacity, unit,
    mode, other tables, another sampler kind) or is inconsistent; checked before anything changes,
    except a sampler state that fails its own checks (the owner discards the ring then). A different
    limiter kind keeps the saved counts."""
    for key in ("capacity", "unit", "mode"):
        if state[key] != getattr(ring, key):
            raise ValueError(
                f"saved state is capacity={state['capacity']} unit={state['unit']} "
                f"mode={state['mode']}, the buffer is capacity={ring.capacity} "
                f"unit={ring.unit} mode={ring.mode}"
            )
    saved = saved_tables(state)
    default = next(iter(tables))
    if "table" not in state and len(saved) == 1:  # a state of one table: the default one's
        saved = {default: state}
    missing = [name for name in saved if name not in tables]
    if missing or next(iter(saved)) != default:
        raise ValueError(
            f"saved state has the tables {', '.join(saved)}, this buffer has "
            f"{', '.join(tables)}: resume or restore with the same tables"
        )
    for name, entry in saved.items():
        kind = (entry.get("sampler") or {}).get("name")
        if kind is not None and kind != tables[name].sampler.name:
            where = "" if len(tables) == 1 else f"table {name!r}: "
            raise ValueError(
                f"{where}saved state is for the {kind!r} sampler, this buffer's is "
                f"{tables[name].sampler.name!r}: resume or restore with the same sampler"
            )
    registry = EpisodeRegistry.from_state(state["registry"])
    ring.load(
        registry,
        operator.index(state["pointer"]),
        operator.index(state["rows_written"]),
        operator.index(state["next_reservation"]),
        state.get("members"),
    )  # every table starts over from the registry: counters, sampler, limiter counts
    ring.wrap_split = operator.index(state.get("wrap_split", -1))  # absent: saved before it was
    for name, entry in saved.items():
        load_table(tables[name], entry)


def load_table(table: Table, saved: Mapping[str, Any]) -> None:
    """``table`` (just started over from the loaded registry) takes its saved parts."""
    sampler = saved.get("sampler") or {}
    # A checkpoint written before samplers existed kept the generator under "sampler".
    rng = saved.get("rng", sampler.get("rng"))
    if saved.get("use_counts") is not None:
        adopt_use_counts(table, saved["use_counts"])
    if "state" in sampler:
        table.sampler.load_state_dict(decode_state(sampler["state"]))
    limiter = saved.get("rate_limiter") or {}
    if "state" in limiter:
        counts = decode_state(limiter["state"])
        table.rate_limiter.load_state_dict({**counts, "limiter": table.rate_limiter.name})
    if rng is not None:
        table.rng.bit_generator.state = decode_state(rng)
    table.priority_updates = int(saved.get("priority_updates", 0))
    table.priority_updates_stale = int(saved.get("priority_updates_stale", 0))


def adopt_use_counts(table: Table, saved: npt.ArrayLike) -> None:
    """Take the use counters a dead daemon left (its counter file, written in place by every
    read): kept for every committed row, -1 elsewhere. The registry is what the journal
    replayed, the state of the last acknowledged request, so a row the file still counts but
    no episode holds (an unacknowledged reservation's) goes back to -1. ValueError for a wrong
    size."""
    counts = np.asarray(saved)
    if counts.shape != (table.ring.capacity,):
        raise ValueError(f"use counts of shape {counts.shape}, the ring has {table.ring.capacity}")
    committed = table.use_counts >= 0
    table.use_counts[committed] = np.maximum(counts[committed], 0)


def replay_sample(table: Table, draw: SampleRecord) -> bool:
    """Redo a journaled draw (:class:`~shmbuffer.ring.listeners.SampleRecord`) on ``table``: the
    generator set to ``rng`` when given, the sampler asked again (its consumption, epochs and
    counts move as they did), the limiter told ``handed`` rows (exact, whatever the draw) and
    the use counters the rows drawn. The limiter is not asked: the live draw was admitted.

    True when the draw went as journaled (refused or not; as many rows). Samplers whose
    draws change state draw the same again (their contract); others, say uniform draws
    through a registry laid out otherwise after a resume, may not, and need not."""
    call, n, length, strict, handed, refused, rng = draw
    if rng is not None:
        set_rng_words(table.rng, rng)
    sampler = table.sampler
    try:
        if call == ROWS:
            rows = sampler.sample_rows(n, table.rng).rows
            got = rows.size
        elif call == EPISODES:
            episodes = sampler.sample_episodes(n, table.rng)
            rows = episode_rows(episodes.starts, episodes.ends - episodes.starts)
            got = rows.size
        elif call == SLICES:
            sliced = sampler.sample_slices(n, length, table.rng, strict)
            rows, real = expand_slices(sliced.starts, length, None if strict else sliced.lengths)
            if real is not None:  # the real rows only, as the live draw counted them
                rows = rows[real.reshape(-1)]
            got = n * length
        else:
            raise ValueError(f"unknown sample call {call}")
    except (ShmBufferError, ValueError, IndexError):
        sampler.changed_on_refusal = False
        table.rng_unlogged = sampler.uses_rng
        if not refused:  # the live draw handed rows out: the limiter counts them anyway
            table.rate_limiter.on_sample(handed)
        return refused
    table.rate_limiter.on_sample(handed)
    table.count_use(rows)
    return not refused and got == handed


def encode_state(value: Any) -> Any:
    """``value`` with bytes as ``{"b64": str}`` and ints outside int64 as ``{"int": str}``, so
    it fits JSON (the journal's snapshot) and msgpack alike; :func:`decode_state` undoes it."""
    if isinstance(value, bytes | bytearray | memoryview):
        return {"b64": base64.b64encode(value).decode("ascii")}
    if isinstance(value, bool | float | str) or value is None:
        return value
    if isinstance(value, int | np.integer):
        value = int(value)
        return value if -(2**63) <= value < 2**63 else {"int": str(value)}
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, Mapping):
        return {str(k): encode_state(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [encode_state(v) for v in value]
    raise TypeError(f"cannot save a {type(value).__name__} in a container state")


def decode_state(value: Any) -> Any:
    if isinstance(value, Mapping):
        if len(value) == 1 and "b64" in value:
            return base64.b64decode(value["b64"])
        if len(value) == 1 and "int" in value:
            return int(value["int"])
        return {k: decode_state(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_state(v) for v in value]
    return value
