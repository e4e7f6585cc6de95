"""A Reader's hindsight-relabelled sample (``Reader.sample(n, her=...)``): the relabelling of
:mod:`shmbuffer.api.her`, over rows a writer may be overwriting while they are read.

The rows are drawn by the daemon with ``context`` (each drawn row's place in its episode:
``before``, ``left``): a reader's own draws know no episodes. After the drawn rows' gather and
check (``Reader._checked_gather``, whose redraws carry their context too), each relabelled
item's goal is drawn inside its episode and read from shared memory, and then every row that
read touched (the done flags scanned and the goal's row) must still carry the drawn row's
stamp: one reservation, one stamp (``storage/stamps.py``), so a row of the episode that has
another stamp now was overwritten, and its goal may come from another write. Such items are
drawn again, leased (the episodes holding them: their goals cannot move while they are read),
and the goals drawn again, at most ``MAX_RESAMPLES`` times, then TornReadError. (Drawing the
whole sample again, unleased, gave up under a writer lapping a 40-row ring.)

torch and tensordict are imported by the first call, as the Reader's other modules do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from shmbuffer.errors import InvalidArgumentError, TornReadError
from shmbuffer.wire.protocol import decode_i64

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict

__all__ = ["sample_her"]

#: Whole samples drawn before a relabelled one gives up (as ``reader.MAX_RESAMPLES``).
MAX_RESAMPLES = 8


def sample_her(
    reader: Any,  # a Reader (reader.py imports this module: typed loosely, no import circle)
    n: int,
    her: Any,
    return_info: bool,
    beta: float | None,
    where: str | None,
) -> TensorDict | tuple[TensorDict, dict[str, torch.Tensor]]:
    """``n`` rows drawn by the daemon with their context, a share relabelled by ``her``
    (checked against the schema before anything is drawn)."""
    from shmbuffer.api.her import apply_goals, check_her, draw_goals, goal_values, rows_read

    if reader.remote:
        raise InvalidArgumentError(
            "her: a remote reader receives rows, not the shared memory a goal is read from "
            "(sample them and relabel in this process, or read through a local Reader)"
        )
    reader._ready()
    spec = check_her(her, reader.schema)
    fields = reader._fields("rows", n, return_info, beta, where)
    fields["context"] = True
    reply, _frames = reader._sample_ahead(**fields)
    items = reader._items(reply, return_info, ("before", "left"))
    physical = decode_i64(reply["rows"]).copy()
    leases = [reply["lease"]] if "lease" in reply else []
    try:
        gens = decode_i64(reply["gens"]).copy()
        data = reader._checked_gather(physical, gens, fields, 1, items, leases)
        assert reader.segment is not None
        columns, stamps = reader.segment.columns, reader.segment.generations
        for _ in range(MAX_RESAMPLES):
            rng = _goal_rng(reader)
            goals = draw_goals(spec, physical, items["before"], items["left"], columns, rng)
            values = goal_values(goals, columns, spec)
            item, rows = rows_read(goals, len(stamps))
            torn = np.unique(item[stamps[rows] != gens[item]])
            if not torn.size:
                apply_goals(data, goals, values, spec)
                info = {k: v for k, v in items.items() if k not in ("before", "left")}
                return (data, reader._info(info)) if return_info else data
            _redraw(reader, torn, fields, return_info, data, physical, gens, items, leases)
    finally:
        reader._release_soon(leases)
    raise TornReadError(
        f"goals kept being overwritten while read through {MAX_RESAMPLES} relabelled samples"
    )


def _redraw(
    reader: Any,
    torn: np.ndarray,
    fields: dict[str, Any],
    return_info: bool,
    data: TensorDict,
    physical: np.ndarray,
    gens: np.ndarray,
    items: dict[str, np.ndarray],
    leases: list[int],
) -> None:
    """Draw the ``torn`` items again, leased (the episodes holding them, so the goals read
    next in them cannot move), and patch them into the batch and its arrays."""
    import torch

    reader._went_stale()
    reader.resamples += len(torn)
    again = {**fields, "n": len(torn), "lease": True}
    reply, _ = reader._sample(**again)
    if "lease" in reply:
        leases.append(reply["lease"])
    fresh_items = reader._items(reply, return_info, ("before", "left"))
    fresh, fresh_gens = decode_i64(reply["rows"]).copy(), decode_i64(reply["gens"]).copy()
    data[torch.from_numpy(torn)] = reader._checked_gather(
        fresh, fresh_gens, again, 1, fresh_items, leases
    )
    physical[torn], gens[torn] = fresh, fresh_gens
    for name, values in items.items():
        values[torn] = fresh_items[name]


def _goal_rng(reader: Any) -> np.random.Generator:
    """The reader's generator of goal draws: from the daemon's ``--seed`` (where it says one,
    as for a reader's own row draws) and this client's id, so that a seeded run relabels
    alike run after run; from the OS otherwise. Made at the first relabelled sample."""
    if reader._her_rng is None:
        seed = (reader.conn.buffer.get("local_draws") or {}).get("seed")
        entropy = None if seed is None else [seed, reader.conn.client_id, 1]
        reader._her_rng = np.random.default_rng(entropy)
    rng: np.random.Generator = reader._her_rng
    return rng
