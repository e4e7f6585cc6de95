"""Hindsight experience replay at sample time (Andrychowicz et al. 2017): a share of a batch
gets, in place of the goal it was collected for, a goal achieved in the same episode, and the
reward the user's function gives for it.

Of a batch of ``B`` drawn rows, ``int(B * k / (k + 1))`` (chosen at random; as Stable
Baselines3's ``HerReplayBuffer`` counts them) are relabelled. For a relabelled row ``t`` a goal
step ``t'`` of its episode is drawn by the strategy:

* ``future``: uniform in ``[t, last]`` (``t'`` = ``t`` included: the goal this very step
  achieved);
* ``final``: ``last``, the episode's last stored step;
* ``episode``: uniform in ``[first, last]``;

and then

* the goal key (default ``desired_goal``) gets ``achieved[t']`` (default key
  ``("next", "achieved_goal")``: the goal achieved *after* step ``t'``), and so does the goal
  in the next observation (``("next", <goal key>)``, where the schema has it; ``next_goal_key``
  names another or, None, none), so a learner's target reads the same goal;
* the reward key (default ``reward``) gets ``reward_fn(achieved[t], new_goal)``: the user's
  function, vectorised over the relabelled rows (torch tensors in, one reward per row out);
* a bool ``relabelled`` entry ``[B]`` says which rows were.

Done flags are not changed (as SB3 does): a learner that ends its bootstrap where a goal is
reached derives it from the reward.

An episode is the drawn row's registry entry (``Container.extent``: its rows before ``t`` and
from ``t`` on, following a chunk split at the ring's end), cut at done flags
(``done_keys``, default: whichever of ``terminated``/``truncated`` the schema has), since a
chunk ``extend`` wrote may hold several episodes one after another. Every row the goal read
(flags and the goal itself) lies between the episode's first row used and its last: a
:class:`~shmbuffer.clients.reader.Reader` checks those rows' stamps against the drawn row's
after its copy (:func:`rows_read`); an in-process Buffer has no concurrent writer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch
from tensordict import TensorDict

from shmbuffer.errors import InvalidArgumentError
from shmbuffer.storage.schema import Key, Schema, as_key, key_str

__all__ = [
    "OPTIONS",
    "STRATEGIES",
    "Goals",
    "Her",
    "apply_goals",
    "check_her",
    "draw_goals",
    "goal_values",
    "her_batch",
    "rows_read",
]

I64 = npt.NDArray[np.int64]
RewardFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

STRATEGIES = ("future", "final", "episode")
#: Every option ``her=`` takes, with its default (``reward_fn`` has none).
OPTIONS: Mapping[str, Any] = {
    "strategy": "future",
    "k": 4,
    "reward_fn": None,
    "goal_key": "desired_goal",
    "achieved_key": ("next", "achieved_goal"),
    "reward_key": "reward",
    "next_goal_key": "default",  # ("next", goal_key) where the schema has it
    "done_keys": "default",  # those of terminated/truncated the schema has
}
_DONE: tuple[Key, ...] = (("terminated",), ("truncated",))
#: The goal draws' generator where a caller passes none (a process's own, unseeded).
_RNG = np.random.default_rng()
#: Rows of done flags read per step of the vectorised scan for an episode's ends.
_SCAN = 32


@dataclass(frozen=True)
class Her:
    """Checked ``her=`` options (the module docstring)."""

    strategy: str
    k: int
    reward_fn: RewardFn
    goal: Key
    next_goal: Key | None
    achieved: Key
    reward: Key
    done: tuple[Key, ...]

    def relabelled(self, batch: int) -> int:
        """How many of ``batch`` rows are relabelled: ``k / (k + 1)`` of them, rounded down."""
        return batch * self.k // (self.k + 1)


@dataclass(frozen=True)
class Goals:
    """The goal drawn for each relabelled item: ``items`` (positions in the batch),
    ``rows`` (the physical row whose achieved goal it gets), and the rows read for it, from
    ``first`` on, ``count`` of them (the ring's ends wrapped)."""

    items: I64
    rows: I64
    first: I64
    count: I64


def check_her(her: Any, schema: Schema | None, n_step: Any = None) -> Her:
    """``her=``'s options checked before anything is drawn: InvalidArgumentError naming the
    option or key that is wrong (an unknown option, a strategy, ``k`` an int >= 0,
    ``reward_fn`` callable, each key a column of the schema, goal and achieved goal of one
    shape), or ``n_step`` given too: an n-step return sums rewards for the goal the steps
    after ``t`` were collected for, which a relabelled row no longer has."""
    if n_step is not None:
        raise InvalidArgumentError(
            "her and n_step cannot be combined: an n-step return sums rewards of the original "
            "goal, which a relabelled row no longer has"
        )
    if not isinstance(her, Mapping):
        raise InvalidArgumentError(f"her must be a dict of options, got {type(her).__name__}")
    unknown = set(her) - set(OPTIONS)
    if unknown:
        raise InvalidArgumentError(
            f"her: unknown option(s) {sorted(map(str, unknown))}; the options are {list(OPTIONS)}"
        )
    o = {**OPTIONS, **her}
    if o["strategy"] not in STRATEGIES:
        raise InvalidArgumentError(
            f"her: strategy must be one of {list(STRATEGIES)}, got {o['strategy']!r}"
        )
    k = o["k"]
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 0:
        raise InvalidArgumentError(f"her: k must be an integer >= 0, got {k!r}")
    if not callable(o["reward_fn"]):
        raise InvalidArgumentError(
            "her: reward_fn must be a callable reward_fn(achieved, desired) -> rewards, "
            f"got {o['reward_fn']!r}"
        )
    goal = _key(o["goal_key"], "goal_key", schema)
    achieved = _key(o["achieved_key"], "achieved_key", schema)
    reward = _key(o["reward_key"], "reward_key", schema)
    if o["next_goal_key"] == "default":
        nxt: Key | None = ("next", *goal)
        nxt = nxt if schema is None or nxt in schema else None
    else:
        nxt = (
            None
            if o["next_goal_key"] is None
            else _key(o["next_goal_key"], "next_goal_key", schema)
        )
    if o["done_keys"] == "default":
        done = tuple(key for key in _DONE if schema is None or key in schema)
    else:
        if isinstance(o["done_keys"], str) or not isinstance(o["done_keys"], Sequence):
            raise InvalidArgumentError(
                f"her: done_keys must be a list of keys, got {o['done_keys']!r}"
            )
        done = tuple(_key(name, "done_keys", schema) for name in o["done_keys"])
    if schema is not None:
        for name, key in (("goal_key", goal), ("next_goal_key", nxt)):
            if key is not None and schema[key].shape != schema[achieved].shape:
                raise InvalidArgumentError(
                    f"her: {name} {key_str(key)!r} has rows of shape {list(schema[key].shape)}, "
                    f"achieved_key {key_str(achieved)!r} {list(schema[achieved].shape)}: "
                    "a relabelled goal is an achieved one, so they must agree"
                )
    return Her(o["strategy"], int(k), o["reward_fn"], goal, nxt, achieved, reward, done)


def _key(name: Any, option: str, schema: Schema | None) -> Key:
    if isinstance(name, str):
        key = as_key(name)
    elif isinstance(name, tuple | list) and name and all(isinstance(p, str) for p in name):
        key = tuple(name)
    else:
        raise InvalidArgumentError(f"her: {option} must be a key (str or tuple), got {name!r}")
    if schema is not None and key not in schema:
        raise InvalidArgumentError(
            f"her: {option} {key_str(key)!r} is not a column of the schema (it has "
            f"{[key_str(f.key) for f in schema]})"
        )
    return key


def draw_goals(
    spec: Her,
    rows: I64,
    before: I64,
    left: I64,
    columns: Mapping[Key, torch.Tensor],
    rng: np.random.Generator,
) -> Goals:
    """Choose the relabelled items of the drawn ``rows`` and, for each, its goal row by the
    strategy, inside its episode: ``before``/``left`` its registry entry's rows before it and
    from it on (``Container.extent``), cut at the first done flag either way."""
    capacity = len(columns[spec.achieved])
    items = np.sort(rng.permutation(len(rows))[: spec.relabelled(len(rows))]).astype(np.int64)
    t, ahead = rows[items], left[items]
    # the last step of t's episode: the first done flag from t on (t's own included)
    end = _first_flag(columns, spec.done, t, ahead, 1, capacity)
    if spec.strategy == "episode":  # and its first: after the last done flag before t
        start = _first_flag(columns, spec.done, (t - 1) % capacity, before[items], -1, capacity)
    else:
        start = np.zeros_like(end)
    if spec.strategy == "final":
        offset = end
    else:
        low = -start if spec.strategy == "episode" else np.zeros_like(end)
        offset = low + np.floor(rng.random(len(items)) * (end - low + 1)).astype(np.int64)
        offset = np.minimum(offset, end)  # a float rounding up to 1.0 stays in range
    goal_rows = (t + offset) % capacity
    return Goals(items, goal_rows, (t - start) % capacity, start + end + 1)


def _first_flag(
    columns: Mapping[Key, torch.Tensor],
    keys: tuple[Key, ...],
    origin: I64,
    limit: I64,
    step: int,
    capacity: int,
) -> I64:
    """For each row, how many rows from ``origin`` (going ``step``) come before the first
    with a done flag set (forward: that row counted too, so the episode's last row is
    ``origin + result``), within ``limit`` rows; ``limit - 1`` forward and ``limit`` back
    where no flag is set. Read in blocks of :data:`_SCAN` rows, the unresolved rows only."""
    forward = step == 1
    found = np.where(forward, limit - 1, limit).astype(np.int64)
    if not keys or not len(origin):
        return found
    todo = np.arange(len(origin))
    for base in range(0, int(limit.max(initial=0)), _SCAN):
        todo = todo[limit[todo] > base]
        if not len(todo):
            break
        steps = base + np.arange(_SCAN, dtype=np.int64)
        at = (origin[todo, None] + step * steps) % capacity  # [m, _SCAN]
        flags = np.zeros(at.shape, bool)
        for key in keys:
            column = columns[key]
            values = column[torch.from_numpy(at).to(column.device)]
            flags |= (values.reshape(*at.shape, -1) != 0).any(dim=-1).cpu().numpy()
        flags &= steps < limit[todo, None]
        hit = flags.any(axis=1)
        first = flags.argmax(axis=1) + base
        found[todo[hit]] = first[hit]
        todo = todo[~hit]
    return found


def goal_values(goals: Goals, columns: Mapping[Key, torch.Tensor], spec: Her) -> torch.Tensor:
    """The achieved goals at the goal rows (a copy)."""
    column = columns[spec.achieved]
    return column[torch.from_numpy(goals.rows).to(column.device)]


def rows_read(goals: Goals, capacity: int) -> tuple[I64, I64]:
    """Every row the goals read (flags and goal), as ``(item, row)`` pairs: a reader checks
    each row's stamp against its item's drawn row's after the copy."""
    count = goals.count
    items = np.repeat(goals.items, count)
    starts = np.repeat(np.cumsum(count) - count, count)
    offsets = np.arange(int(count.sum()), dtype=np.int64) - starts
    return items, (np.repeat(goals.first, count) + offsets) % capacity


def apply_goals(data: TensorDict, goals: Goals, values: torch.Tensor, spec: Her) -> None:
    """Write the new goals into ``data`` (the drawn rows' copy) and their rewards, by the
    user's ``reward_fn``; add the ``relabelled`` mask."""
    n = data.batch_size[0]
    mask = torch.zeros(n, dtype=torch.bool)
    mask[torch.from_numpy(goals.items)] = True
    data.set("relabelled", mask.to(data.device) if data.device is not None else mask)
    if not len(goals.items):
        return
    at = torch.from_numpy(goals.items)
    goal = data.get(spec.goal)
    at = at.to(goal.device)
    new = values.to(goal.device, goal.dtype)
    goal[at] = new
    if spec.next_goal is not None:
        nxt = data.get(spec.next_goal)
        nxt[at] = values.to(nxt.device, nxt.dtype)
    reward = data.get(spec.reward)
    got = spec.reward_fn(data.get(spec.achieved)[at], new)
    want = (len(goals.items), *reward.shape[1:])
    if not isinstance(got, torch.Tensor) or got.numel() != int(np.prod(want)):
        raise InvalidArgumentError(
            f"her: reward_fn returned {got!r:.80} for {len(goals.items)} relabelled rows; it "
            f"must return a tensor of {list(want)} (one reward per row, as the "
            f"{key_str(spec.reward)!r} column holds)"
        )
    reward[at] = got.reshape(want).to(reward.device, reward.dtype)


class _HasColumns(Protocol):
    @property
    def columns(self) -> Mapping[Key, torch.Tensor]: ...


def her_batch(
    data: TensorDict,
    rows: I64,
    segment: _HasColumns | None,
    extent: Callable[[I64], tuple[I64, I64]],
    spec: Her | None,
    rng: np.random.Generator | None = None,
) -> None:
    """Relabel ``data`` (the copy of the drawn ``rows`` of ``segment``) in place, where no
    writer runs beside the read (an in-process Buffer): draw, read and apply in one go;
    ``extent``: ``Container.extent``. Nothing without a ``spec`` (no ``her=``)."""
    if spec is None or segment is None:
        return
    columns = segment.columns
    before, left = extent(rows)
    goals = draw_goals(spec, rows, before, left, columns, rng or _RNG)
    apply_goals(data, goals, goal_values(goals, columns, spec), spec)
