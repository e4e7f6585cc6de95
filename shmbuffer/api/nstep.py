"""n-step returns at sample time: what a learner computes from the rows after each draw,
computed where the episode structure is known.

For a drawn row ``t`` of an episode, with ``m <= n`` the steps left in the episode from ``t``
on (``t`` itself included, capped at ``n``):

* ``n_step_return = sum_{k < m} gamma**k * reward[t + k]``;
* the next-observation key holds ``next_obs[t + m - 1]`` (the observation at ``t + m``),
  replacing the row's own, so a learner's target code reads it where it read the 1-step one;
* ``discount = gamma**m``, or 0 when step ``t + m - 1`` terminated. A truncation, or the end
  of the stored part of an episode, bootstraps: ``gamma**m``.

The window never leaves the drawn row's registry entry (an episode, or in transition unit the
chunk one write made) and stops at the first step whose terminated or truncated flag is set:
a chunk may hold several episodes one after another. A transition chunk written across the
ring's end is two registry entries; :attr:`Ring.wrap_split <shmbuffer.ring.ring.Ring.wrap_split>`
says which, and the window follows it from the last row to row 0.

Which entry holds each drawn row is an :class:`~shmbuffer.samplers.index.EpisodeIndex` kept
by :class:`~shmbuffer.ring.rowepisodes.RowEpisodes`, a ring listener made on the first read
that asks (O(C) once, then O(k) per k rows written or evicted), so that a draw costs
O(batch * n) vectorised numpy and no search. A daemon's Reader makes the same computation
(:func:`n_step_values`) over the shared rows, with each row's place in its episode from the
daemon, and checks the rows it read against the drawn row's stamp
(:mod:`shmbuffer.clients.nstep_reads`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from tensordict import TensorDict

from shmbuffer.errors import InvalidArgumentError
from shmbuffer.storage.rows import gather_columns
from shmbuffer.storage.schema import Key, Schema, as_key, key_str

__all__ = ["DEFAULT_KEYS", "NStep", "check_n_step", "n_step_batch", "n_step_values"]

I64 = npt.NDArray[np.int64]

#: The columns an n-step sample reads, by role (``n_step_keys=`` overrides any of them;
#: ``"truncated": None`` for data without a truncation flag).
DEFAULT_KEYS: Mapping[str, str | Sequence[str] | None] = {
    "reward": "reward",
    "terminated": "terminated",
    "truncated": "truncated",
    "next_obs": ("next", "obs"),
}


@dataclass(frozen=True)
class NStep:
    """Checked n-step arguments: ``n`` steps, discount ``gamma`` and the schema keys read."""

    n: int
    gamma: float
    reward: Key
    terminated: Key
    truncated: Key | None
    next_obs: Key


def check_n_step(
    n_step: Any,
    gamma: Any,
    keys: Mapping[str, str | Sequence[str] | None] | None,
    schema: Schema | None,
) -> NStep:
    """The arguments of an n-step sample, checked before anything is drawn:
    InvalidArgumentError naming the one that is wrong (``n_step`` an int >= 1, ``gamma`` in
    [0, 1], each key a column of the schema; TypeError for a wrong type)."""
    if isinstance(n_step, bool) or not isinstance(n_step, int | np.integer):
        raise TypeError(f"n_step must be an integer, got {n_step!r}")
    if n_step < 1:
        raise InvalidArgumentError(f"n_step must be >= 1, got {n_step}")
    if isinstance(gamma, bool) or not isinstance(gamma, int | float | np.floating):
        raise TypeError(f"gamma must be a number, got {gamma!r}")
    if not 0.0 <= float(gamma) <= 1.0:  # NaN fails this too
        raise InvalidArgumentError(f"gamma must be in [0, 1], got {gamma}")
    unknown = set(keys or {}) - set(DEFAULT_KEYS)
    if unknown:
        raise InvalidArgumentError(
            f"n_step_keys: unknown role(s) {sorted(unknown)}; the roles are {list(DEFAULT_KEYS)}"
        )
    named = {**DEFAULT_KEYS, **(keys or {})}
    found: dict[str, Key | None] = {}
    for role, name in named.items():
        if name is None and role == "truncated":
            found[role] = None
            continue
        if name is None:
            raise InvalidArgumentError(f"n_step_keys: the {role!r} key is needed, got None")
        key = as_key(name if isinstance(name, str) else tuple(name))
        if schema is not None and key not in schema:
            raise InvalidArgumentError(
                f"n-step sample reads the {role} key {key_str(key)!r}, which the schema "
                f"lacks (it has {[key_str(f.key) for f in schema]}); name it with "
                f"n_step_keys={{{role!r}: ...}}"
            )
        found[role] = key
    reward, terminated, next_obs = found["reward"], found["terminated"], found["next_obs"]
    assert reward is not None and terminated is not None and next_obs is not None
    return NStep(int(n_step), float(gamma), reward, terminated, found["truncated"], next_obs)


def n_step_batch(
    data: TensorDict,
    rows: I64,
    columns: Mapping[Key, torch.Tensor],
    left: I64,
    spec: NStep,
) -> I64:
    """Add ``n_step_return`` and ``discount`` to ``data`` (the drawn ``rows``, copied out) and
    replace its next observation by the one ``m`` steps on (:func:`n_step_values`); returns
    the rows read that the values depend on, as :func:`n_step_values` does."""
    values, reach = n_step_values(rows, columns, left, spec)
    for key, value in values.items():
        data.set(key, value)
    return reach


def n_step_values(
    rows: I64,
    columns: Mapping[Key, torch.Tensor],
    left: I64,
    spec: NStep,
) -> tuple[dict[Key, torch.Tensor], I64]:
    """The ``n_step_return``, ``discount`` and next observation (under ``spec.next_obs``) of
    each drawn row of ``rows`` (the module docstring), read from the ring's ``columns``;
    ``left``: each row's rows of its episode from it on, itself included
    (``Container.extent``). The one computation every front end makes: the in-process Buffer
    over its own columns, a Reader over the shared ones.

    Also returns ``reach``, ``[B, n]``: the rows whose values the result was computed from
    (row ``t + k`` for ``k < m``; the drawn row itself in the places after). A reader whose
    columns writers may overwrite checks that each still carries its drawn row's stamp after
    this copy: then all of them were written with it and none was touched since
    (``storage/stamps.py``); rows read past ``m`` change nothing and are not named."""
    capacity = len(columns[spec.reward])
    steps = np.arange(spec.n, dtype=np.int64)
    window = np.minimum(left, spec.n)  # [B]
    ahead = (rows[:, None] + steps) % capacity  # [B, n]; past the window: masked below
    done = _flags(_take(columns[spec.terminated], ahead), 2)
    if spec.truncated is not None:
        done |= _flags(_take(columns[spec.truncated], ahead), 2)
    inside = steps < window[:, None]
    # m: up to and including the first step that ends the episode, else the whole window
    ended = done & inside
    m = np.where(ended.any(axis=1), ended.argmax(axis=1) + 1, window)
    within = steps < m[:, None]  # [B, n]
    used = torch.from_numpy(within)
    reward = _take(columns[spec.reward], ahead)  # [B, n, *reward's row shape]
    dtype = reward.dtype if reward.is_floating_point() else torch.float32
    powers = torch.tensor([spec.gamma**k for k in range(spec.n)], dtype=torch.float64)
    trailing = [1] * (reward.dim() - 2)
    weights = (powers * used).reshape(*used.shape, *trailing)
    returns = (reward.double() * weights).sum(dim=1).to(dtype)
    last = (rows + m - 1) % capacity
    terminated = _flags(_take(columns[spec.terminated], last), 1)
    discount = np.where(terminated, 0.0, np.power(spec.gamma, m.astype(np.float64)))
    # shaped as the return, so that ``return + discount * value`` never broadcasts [B] by [B, 1]
    shaped = torch.from_numpy(discount).to(dtype).reshape(len(rows), *trailing)
    values: dict[Key, torch.Tensor] = {
        ("n_step_return",): returns,
        ("discount",): shaped.expand_as(returns).clone(),
        spec.next_obs: _take(columns[spec.next_obs], last),
    }
    reach: I64 = np.where(within, ahead, rows[:, None])
    return values, reach


def _take(column: torch.Tensor, index: I64) -> torch.Tensor:
    """``column``'s rows at ``index`` (any shape), copied by the one row copier
    (``storage/rows.py``: numpy's ``take``, large rows streamed; torch's indexing copied 256
    image rows several times slower)."""
    got = gather_columns({("rows",): column}, index.reshape(-1))[("rows",)]
    return got.reshape(*index.shape, *column.shape[1:])


def _flags(values: torch.Tensor, lead: int) -> npt.NDArray[np.bool_]:
    """A done column's values (``lead`` leading dims, then a row's shape) as bools, a row
    counting as set where any of its elements is."""
    flat = values.reshape(*values.shape[:lead], -1) != 0
    out: npt.NDArray[np.bool_] = flat.any(dim=-1).numpy()
    return out
