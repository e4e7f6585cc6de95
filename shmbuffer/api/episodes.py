"""Per-env episode assembly: collect transitions until an episode ends, then hand back rows.

An :class:`EpisodeAssembler` keeps one list of pending steps per env id. A step whose done flag
(any of ``done_keys``) is true ends its episode and belongs to it;
:meth:`EpisodeAssembler.end_episode` ends one by hand (truncation). A finished episode is
postprocessed (``dict[str, list]`` of per-step values → mapping of arrays with a common leading
length) and returned as a :class:`FinishedEpisode` whose ``data`` is a TensorDict of batch
``[rows]``, ready to write.

Vector envs (``num_envs > 1`` for an env id) give values with a leading dim ``num_envs``:

* ``auto_truncate=True``: each step is split into sub-env ids ``f"{env_id}/{i}"``, each with its
  own done tracking, so sub-env 1 can finish while sub-env 0 goes on.
* ``auto_truncate=False``: whole vector steps are kept; the episode ends only by hand and comes
  back env-major, ``[num_envs * L]`` rows with ``num_sub_episodes = num_envs``.

With ``auto_truncate=False`` done flags are not looked at for any env (as in the seed): every
episode ends by :meth:`~EpisodeAssembler.end_episode` / :meth:`~EpisodeAssembler.end_all`.

Every mutating call is all-or-nothing: if validation or the postprocess raises, the assembler's
state is as before the call. Transitions are copied (their mapping structure, never the leaf
tensors/arrays), so mutating the caller's dict later changes nothing here; mutating a tensor in
place before its episode ends does.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from shmbuffer.errors import SchemaError
from shmbuffer.storage.rows import tensordict_class

if TYPE_CHECKING:
    from tensordict import TensorDict

DEFAULT_DONE_KEYS: tuple[str, ...] = ("terminated", "truncated")  # Gymnasium
# The done keys of RLightning-style transitions (``EnvRet.to_dict()``, see shmbuffer.api.hooks).
SEED_DONE_KEYS: tuple[str, ...] = ("last_terminated", "last_truncated")

PostprocessFn = Callable[[dict[str, list[Any]]], Mapping[str, Any]]
Key = tuple[str, ...]

_NON_NUMERIC_KINDS = "USOV"  # numpy dtype kinds torch cannot hold: str, bytes, object, void


@dataclass(frozen=True)
class FinishedEpisode:
    """Rows of one finished episode (or ``num_sub_episodes`` equal-length ones, env-major)."""

    data: TensorDict
    num_sub_episodes: int = 1
    env_id: str = ""
    #: The metadata given with its steps, merged (a later value of a name replaces one before).
    meta: Mapping[str, Any] = field(default_factory=dict)
    #: The tables it goes into, as its steps last named them (None: none named, every table).
    tables: tuple[str, ...] | None = None

    @property
    def length(self) -> int:
        """Rows per sub-episode."""
        return int(self.data.batch_size[0]) // self.num_sub_episodes


# -- stacking helpers (shared with shmbuffer.api.hooks) -------------------------------------------


def _name(key: Key) -> str:
    return ".".join(key)


def is_non_numeric(value: Any) -> bool:
    """True for values no tensor can hold: ``str``, ``bytes``, ``None``, str/object arrays."""
    if value is None or isinstance(value, str | bytes):
        return True
    return isinstance(value, np.ndarray) and value.dtype.kind in _NON_NUMERIC_KINDS


def to_tensor(value: Any, key: Key = ()) -> torch.Tensor:
    """One value as a tensor (numpy arrays are copied only when read-only)."""
    if isinstance(value, torch.Tensor):
        return value
    if is_non_numeric(value):
        raise SchemaError(f"key {_name(key)!r}: non-numeric value {value!r} cannot become a tensor")
    try:
        arr = np.asarray(value)
        if arr.dtype.kind in _NON_NUMERIC_KINDS:
            raise TypeError(f"numpy dtype {arr.dtype}")
        if not arr.flags.writeable:
            arr = arr.copy()
        return torch.as_tensor(arr)
    except (TypeError, ValueError) as exc:
        raise SchemaError(
            f"key {_name(key)!r}: cannot make a tensor of {value!r} ({exc})"
        ) from None


def stack_steps(values: Sequence[Any], key: Key = ()) -> Any:
    """Stack per-step values on a new leading dim; mappings stack leaf by leaf into nested dicts.

    Tensors go through ``torch.stack``; anything else through ``torch.as_tensor(np.asarray(...))``.
    """
    if values and all(isinstance(v, Mapping) for v in values):
        names = list(values[0].keys())
        if any(set(v.keys()) != set(names) for v in values):
            raise SchemaError(f"key {_name(key)!r}: sub-keys differ between steps")
        return {n: stack_steps([v[n] for v in values], (*key, str(n))) for n in names}
    if any(isinstance(v, Mapping) for v in values):
        raise SchemaError(f"key {_name(key)!r}: a mapping in some steps, a value in others")
    try:
        if all(isinstance(v, torch.Tensor) for v in values):
            return torch.stack(list(values))
        if any(isinstance(v, torch.Tensor) for v in values):
            return torch.stack([to_tensor(v, key) for v in values])
    except RuntimeError as exc:
        shapes = sorted({str(list(getattr(v, "shape", ()))) for v in values})
        raise SchemaError(f"key {_name(key)!r}: steps have shapes {shapes} ({exc})") from None
    bad = [v for v in values if is_non_numeric(v)]
    if bad:
        raise SchemaError(
            f"key {_name(key)!r}: non-numeric values (e.g. {bad[0]!r}); "
            "drop them in a postprocess_fn (shmbuffer.api.hooks.default_postprocess_fn drops them)"
        )
    return to_tensor(values, key)


def stack_episode(episode: Mapping[str, Sequence[Any]]) -> dict[str, Any]:
    """The assembler's default postprocess: stack each key's per-step list, nothing else."""
    return {k: stack_steps(v, (k,)) for k, v in episode.items()}


def _copy_tree(transition: Mapping[Any, Any], key: Key = ()) -> dict[str, Any]:
    """Copy the mapping structure (never the leaf values), so caller dicts are never aliased."""
    if not isinstance(transition, Mapping):
        raise TypeError(f"a transition must be a mapping, got {type(transition).__name__}")
    return {
        str(k): _copy_tree(v, (*key, str(k))) if isinstance(v, Mapping) else v
        for k, v in transition.items()
    }


def _leaves(tree: Mapping[str, Any], prefix: Key = ()) -> Iterator[tuple[Key, Any]]:
    for name, value in tree.items():
        if isinstance(value, Mapping):
            yield from _leaves(value, (*prefix, name))
        else:
            yield (*prefix, name), value


def _map_leaves(
    tree: Mapping[str, Any], fn: Callable[[Key, Any], Any], prefix: Key = ()
) -> dict[str, Any]:
    return {
        name: _map_leaves(value, fn, (*prefix, name))
        if isinstance(value, Mapping)
        else fn((*prefix, name), value)
        for name, value in tree.items()
    }


def _split(tree: dict[str, Any], n: int, env_id: str) -> list[dict[str, Any]]:
    """Split one vector-env step into ``n`` sub-env steps along the leading dim."""
    out: list[dict[str, Any]] = [{} for _ in range(n)]
    for name, value in tree.items():
        if isinstance(value, dict):
            parts: Sequence[Any] = _split(value, n, env_id)
        elif isinstance(value, torch.Tensor | np.ndarray):
            if value.ndim == 0 or value.shape[0] != n:
                raise SchemaError(
                    f"env {env_id!r} has num_envs={n}, but key {name!r} has shape "
                    f"{list(value.shape)} (leading dim must be {n})"
                )
            parts = list(value)
        elif isinstance(value, list | tuple):
            if len(value) != n:
                raise SchemaError(
                    f"env {env_id!r} has num_envs={n}, but key {name!r} is a sequence of "
                    f"length {len(value)}"
                )
            parts = value
        else:  # a scalar or string shared by every sub-env
            parts = [value] * n
        for i in range(n):
            out[i][name] = parts[i]
    return out


def _check_vector(tree: dict[str, Any], n: int, env_id: str) -> None:
    for key, value in _leaves(tree):
        if isinstance(value, torch.Tensor | np.ndarray) and (
            value.ndim == 0 or value.shape[0] != n
        ):
            raise SchemaError(
                f"env {env_id!r} has num_envs={n}, but key {_name(key)!r} has shape "
                f"{list(value.shape)} (leading dim must be {n})"
            )


def _flag(value: Any, env_id: str, key: str) -> bool:
    """A done value (bool, numpy bool, 0-d or one-element tensor/array) as a bool."""
    if value is None:
        return False
    arr = value if isinstance(value, torch.Tensor) else np.asarray(value)
    size = arr.numel() if isinstance(arr, torch.Tensor) else arr.size
    if size != 1 or (isinstance(arr, np.ndarray) and arr.dtype.kind in _NON_NUMERIC_KINDS):
        raise SchemaError(
            f"env {env_id!r}: done key {key!r} must hold one bool, got {value!r} "
            "(a vector env needs num_envs for its env id)"
        )
    return bool(arr.reshape(-1)[0])


# -- the assembler -----------------------------------------------------------------------------


@dataclass
class _Pending:
    steps: list[dict[str, Any]]
    keys: frozenset[Key]
    width: int  # 1, or num_envs for whole vector steps kept without auto-truncation
    meta: dict[str, Any] = field(default_factory=dict)  # merged from its steps' meta
    tables: tuple[str, ...] | None = None  # the tables its steps named last


class EpisodeAssembler:
    """Per-env active episodes; see the module docstring for the semantics.

    ``num_envs``: an int (or None = 1) applies to every env id; a mapping gives it per env id,
    and env ids it does not name (including sub-env ids ``env/i``) have ``num_envs=1``.
    ``postprocess_fn`` gets the raw per-step values (no device move) and returns arrays or
    tensors with a common leading length; ``None`` stacks each key (:func:`stack_episode`).
    """

    def __init__(
        self,
        *,
        num_envs: int | Mapping[str, int] | None = None,
        auto_truncate: bool = True,
        done_keys: Sequence[str] = DEFAULT_DONE_KEYS,
        postprocess_fn: PostprocessFn | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        if num_envs is None:
            num_envs = 1
        counts = num_envs.values() if isinstance(num_envs, Mapping) else [num_envs]
        for count in counts:
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ValueError(f"num_envs must be a positive int, got {count!r}")
        if isinstance(done_keys, str):
            raise TypeError("done_keys must be a sequence of key names, not a string")
        self._num_envs = dict(num_envs) if isinstance(num_envs, Mapping) else num_envs
        self.auto_truncate = auto_truncate
        self.done_keys = tuple(done_keys)
        self._postprocess: PostprocessFn = postprocess_fn or stack_episode
        self.device = torch.device(device)
        self._pending: dict[str, _Pending] = {}

    def num_envs(self, env_id: str) -> int:
        if isinstance(self._num_envs, int):
            return self._num_envs
        return self._num_envs.get(env_id, 1)

    # -- adding ----------------------------------------------------------------------------

    def add_transition(
        self,
        env_id: str,
        transition: Mapping[str, Any],
        meta: Mapping[str, Any] | None = None,
        tables: Sequence[str] | None = None,
    ) -> list[FinishedEpisode]:
        """Add one step; return the episodes it finished (done flag on it), postprocessed.
        ``meta`` (checked by the caller) is merged into the metadata of the episode the step
        belongs to (of each sub-env's, for a vector step split by env). ``tables`` (checked
        by the caller; None: not said) are the tables that episode goes into: the last named
        for it wins, none named means every table."""
        named = None if tables is None else tuple(tables)
        if not isinstance(env_id, str):
            raise TypeError(f"env_id must be a str, got {type(env_id).__name__}")
        tree = _copy_tree(transition)
        keys = frozenset(key for key, _ in _leaves(tree))
        if not keys:
            raise SchemaError(f"env {env_id!r}: an empty transition")
        n = self.num_envs(env_id)
        if n > 1 and self.auto_truncate:
            items = [(f"{env_id}/{i}", step) for i, step in enumerate(_split(tree, n, env_id))]
            width = 1
        else:
            if n > 1:
                _check_vector(tree, n, env_id)
            items, width = [(env_id, tree)], n
        for sid, _ in items:
            pending = self._pending.get(sid)
            if pending is not None and pending.keys != keys:
                raise SchemaError(
                    f"env {sid!r}: transition keys {sorted(map(_name, keys))} differ from the "
                    f"episode's earlier steps {sorted(map(_name, pending.keys))}"
                )

        # Finish episodes first (may raise), change state only after.
        finished: list[FinishedEpisode] = []
        done: set[str] = set()
        if self.auto_truncate and width == 1:
            for sid, step in items:
                if any(_flag(step.get(k), sid, k) for k in self.done_keys if k in step):
                    pending = self._pending.get(sid)
                    merged = {**(pending.meta if pending else {}), **(meta or {})}
                    steps = [*(pending.steps if pending else []), step]
                    into = named if named is not None else pending.tables if pending else None
                    episode = self._finish(sid, steps, 1, merged, into)
                    done.add(sid)
                    if episode is not None:
                        finished.append(episode)
        for sid, step in items:
            if sid in done:
                self._pending.pop(sid, None)
            else:
                pending = self._pending.setdefault(sid, _Pending([], keys, width))
                pending.steps.append(step)
                if meta:
                    pending.meta.update(meta)
                if named is not None:
                    pending.tables = named
        return finished

    # -- ending ------------------------------------------------------------------------------

    def end_episode(self, env_id: str) -> list[FinishedEpisode]:
        """End ``env_id``'s episode by hand (all of its ``env_id/i`` when split); ``[]`` if none."""
        return self._end(self._ids(env_id))

    def end_all(self) -> list[FinishedEpisode]:
        """End every pending episode, oldest-started first."""
        return self._end(list(self._pending))

    def pending(self, env_id: str | None = None) -> int:
        """Steps waiting, for one env id (its sub-env steps summed) or for all."""
        ids = list(self._pending) if env_id is None else self._ids(env_id)
        return sum(len(self._pending[sid].steps) for sid in ids)

    def clear(self) -> None:
        """Drop every pending step."""
        self._pending.clear()

    def _ids(self, env_id: str) -> list[str]:
        ids = [env_id] if env_id in self._pending else []
        n = self.num_envs(env_id)
        if n > 1 and self.auto_truncate:
            ids += [sid for sid in (f"{env_id}/{i}" for i in range(n)) if sid in self._pending]
        return ids

    def _end(self, ids: list[str]) -> list[FinishedEpisode]:
        pending = [(sid, self._pending[sid]) for sid in ids]
        episodes = [self._finish(sid, p.steps, p.width, p.meta, p.tables) for sid, p in pending]
        for sid in ids:
            del self._pending[sid]
        return [episode for episode in episodes if episode is not None]

    def _finish(
        self,
        sid: str,
        steps: list[dict[str, Any]],
        width: int,
        meta: Mapping[str, Any],
        tables: tuple[str, ...] | None = None,
    ) -> FinishedEpisode | None:
        """Postprocess ``steps`` into rows; ``None`` (with a warning) when no rows result."""
        merged = {name: [step[name] for step in steps] for name in steps[0]}
        out = self._postprocess(merged)
        if not isinstance(out, Mapping):
            raise SchemaError(
                f"env {sid!r}: postprocess returned {type(out).__name__}, not a mapping"
            )
        tree = _map_leaves(_copy_tree(out), lambda key, value: to_tensor(value, key))
        leaves = list(_leaves(tree))
        if not leaves:
            raise SchemaError(f"env {sid!r}: postprocess returned no keys")
        lead = 2 if width > 1 else 1
        shapes = {_name(key): tuple(t.shape[:lead]) for key, t in leaves}
        if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != lead:
            raise SchemaError(f"env {sid!r}: postprocessed keys differ in leading dims: {shapes}")
        length = leaves[0][1].shape[0]
        if width > 1 and leaves[0][1].shape[1] != width:
            raise SchemaError(f"env {sid!r}: expected [L, {width}] leading dims, got {shapes}")
        if length == 0:
            warnings.warn(
                f"env {sid!r}: an episode of {len(steps)} step(s) has no rows after "
                "postprocessing; dropped",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        if width > 1:  # [L, num_envs, ...] -> env-major [num_envs * L, ...]
            tree = _map_leaves(
                tree, lambda _k, t: t.transpose(0, 1).reshape(width * length, *t.shape[2:])
            )
        data = tensordict_class()(tree, batch_size=[width * length], device=self.device)
        return FinishedEpisode(
            data=data, num_sub_episodes=width, env_id=sid, meta=dict(meta), tables=tables
        )
