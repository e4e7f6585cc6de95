"""Pre- and postprocessing hooks with the seed's (RLightning's) signatures, and async pairing.

A *preprocess* hook turns an env return and a policy response into one transition dict::

    preprocess_fn(transition_buffer, env_ret, policy_resp, obs_preprocessor,
                  reward_preprocessor, env_ret_preprocess_fn, policy_resp_preprocess_fn) -> dict

A *postprocess* hook turns a finished episode (``dict[str, list]`` of per-step values) into rows;
:func:`default_postprocess_fn` shifts RLightning's ``last_*`` keys so N steps make N-1 rows.
Use it with ``EpisodeAssembler(done_keys=SEED_DONE_KEYS, postprocess_fn=default_postprocess_fn)``.

``env_ret`` and ``policy_resp`` are duck-typed: any object with ``env_id`` and ``to_dict()``,
or a plain mapping (its ``"env_id"`` key is the env id).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from shmbuffer.api.episodes import SEED_DONE_KEYS, is_non_numeric, stack_steps

__all__ = [
    "SEED_DONE_KEYS",
    "PreprocessFn",
    "TransitionPairer",
    "default_postprocess_fn",
    "default_preprocess_fn",
    "env_id_of",
    "is_env_ret",
    "resolve_preprocess",
]

PreprocessFn = Callable[..., Mapping[str, Any]]
Fn = Callable[[Any], Any] | None


def _as_dict(item: Any) -> dict[str, Any]:
    if isinstance(item, Mapping):
        return dict(item)
    to_dict = getattr(item, "to_dict", None)
    if not callable(to_dict):
        raise TypeError(
            f"expected a mapping or an object with to_dict(), got {type(item).__name__}"
        )
    return dict(to_dict())


def env_id_of(item: Any) -> str:
    """The env id of an EnvRet / PolicyResponse (its ``env_id`` attribute or mapping key)."""
    if isinstance(item, Mapping):
        if "env_id" not in item:
            raise TypeError(f"mapping has no 'env_id' key (keys: {sorted(map(str, item))})")
        return str(item["env_id"])
    if not hasattr(item, "env_id"):
        raise TypeError(f"{type(item).__name__} has no env_id attribute")
    return str(item.env_id)


def _has(item: Any, name: str) -> bool:
    return name in item if isinstance(item, Mapping) else hasattr(item, name)


def is_env_ret(item: Any) -> bool:
    """Tell an EnvRet (True) from a PolicyResponse (False) in duck-typed mode.

    The type name decides first (contains ``"EnvRet"`` / ``"PolicyResponse"``); otherwise an
    ``observation`` attribute or key means EnvRet and an ``action`` one PolicyResponse. Having
    both, or neither, raises :class:`TypeError`.
    """
    name = type(item).__name__
    if "EnvRet" in name:
        return True
    if "PolicyResponse" in name:
        return False
    obs, action = _has(item, "observation"), _has(item, "action")
    if obs != action:
        return obs
    raise TypeError(
        f"cannot tell whether {name} is an EnvRet or a PolicyResponse "
        f"(observation: {obs}, action: {action}); pass is_env_ret explicitly"
    )


def default_preprocess_fn(
    transition_buffer: Mapping[str, Any] | None,
    env_ret: Any,
    policy_resp: Any,
    obs_preprocessor: Fn,
    reward_preprocessor: Fn,
    env_ret_preprocess_fn: Fn,
    policy_resp_preprocess_fn: Fn,
) -> dict[str, Any]:
    """Merge ``env_ret`` and/or ``policy_resp`` (either may be None) into a copy of the buffer.

    ``env_ret`` becomes ``env_ret_preprocess_fn(env_ret)`` or its ``to_dict()``; then
    ``obs_preprocessor`` maps its ``observation`` and ``reward_preprocessor`` its ``last_reward``
    (each if given and the key is present). ``policy_resp`` becomes
    ``policy_resp_preprocess_fn(policy_resp)`` or its ``to_dict()``. Later keys win.
    """
    out = dict(transition_buffer or {})
    if env_ret is not None:
        d = dict(env_ret_preprocess_fn(env_ret)) if env_ret_preprocess_fn else _as_dict(env_ret)
        if obs_preprocessor is not None and "observation" in d:
            d["observation"] = obs_preprocessor(d["observation"])
        if reward_preprocessor is not None and "last_reward" in d:
            d["last_reward"] = reward_preprocessor(d["last_reward"])
        out.update(d)
    if policy_resp is not None:
        d = (
            dict(policy_resp_preprocess_fn(policy_resp))
            if policy_resp_preprocess_fn
            else _as_dict(policy_resp)
        )
        out.update(d)
    return out


def _numeric_only(values: list[Any]) -> list[Any] | None:
    """Per-step values with non-numeric leaves dropped; None if the whole key is non-numeric."""
    if values and all(isinstance(v, Mapping) for v in values):
        kept = {}
        for name in values[0]:
            sub = _numeric_only([v.get(name) for v in values])
            if sub is not None:
                kept[name] = sub
        if not kept:
            return None
        return [{name: sub[i] for name, sub in kept.items()} for i in range(len(values))]
    return None if any(is_non_numeric(v) for v in values) else values


def _shift(value: Any, index: slice) -> Any:
    if isinstance(value, dict):
        return {name: _shift(sub, index) for name, sub in value.items()}
    return value[index]


def default_postprocess_fn(episode: dict[str, list[Any]]) -> dict[str, Any]:
    """RLightning's episode-end postprocess: N steps → N-1 transitions.

    Each key's list is stacked (nested mappings leaf by leaf); then

    * keys containing ``"info"`` are dropped, and so are keys (or nested leaves) whose values
      are non-numeric — ``str``/``bytes``/``None``/str or object arrays, e.g. ``env_id``;
    * ``last_X`` becomes ``X = v[1:]`` (the reward/done that followed step t's action);
    * ``observation`` becomes ``observation = v[:-1]`` and ``next_observation = v[1:]``;
    * every other key becomes ``v[:-1]``.

    Two keys landing on one name (``last_reward`` and ``reward``) raise :class:`ValueError`.
    """
    out: dict[str, Any] = {}

    def put(name: str, value: Any, source: str) -> None:
        if name in out:
            raise ValueError(f"postprocess: key {source!r} would overwrite {name!r}")
        out[name] = value

    for key, raw in episode.items():
        if "info" in key:
            continue
        values = _numeric_only(list(raw))
        if values is None:
            continue
        stacked = stack_steps(values, (key,))
        if key.startswith("last_") and len(key) > len("last_"):
            put(key[len("last_") :], _shift(stacked, slice(1, None)), key)
        elif key == "observation":
            put("observation", _shift(stacked, slice(None, -1)), key)
            put("next_observation", _shift(stacked, slice(1, None)), key)
        else:
            put(key, _shift(stacked, slice(None, -1)), key)
    return out


def resolve_preprocess(
    preprocess_fn: PreprocessFn | None,
    env_ret_preprocess_fn: Fn,
    policy_resp_preprocess_fn: Fn,
) -> PreprocessFn:
    """The preprocess to use: ``preprocess_fn``, or :func:`default_preprocess_fn` when None.

    Any combination with the lower-level fns is accepted, as in the seed: every call passes
    ``obs_preprocessor``, ``reward_preprocessor``, ``env_ret_preprocess_fn`` and
    ``policy_resp_preprocess_fn`` to ``preprocess_fn`` as arguments, so a custom one decides
    how to use them and nothing is bypassed behind its back (RLightning's buffer gives all
    six hooks). A hook that is neither callable nor None raises :class:`TypeError` naming it.
    """
    _check_callable(
        preprocess_fn=preprocess_fn,
        env_ret_preprocess_fn=env_ret_preprocess_fn,
        policy_resp_preprocess_fn=policy_resp_preprocess_fn,
    )
    return default_preprocess_fn if preprocess_fn is None else preprocess_fn


def _check_callable(**hooks: object) -> None:
    for name, fn in hooks.items():
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable or None, got {type(fn).__name__}")


class TransitionPairer:
    """Builds transitions from EnvRet/PolicyResponse pairs, synchronously or one at a time.

    Every transition returned is a fresh dict, returned once; nothing it returned is touched
    again. ``preprocess=None`` means :func:`default_preprocess_fn`; whichever it is, it gets
    the four lower-level fns as arguments on every call (:func:`resolve_preprocess`).
    """

    def __init__(
        self,
        preprocess: PreprocessFn | None,
        obs_preprocessor: Fn = None,
        reward_preprocessor: Fn = None,
        env_ret_preprocess_fn: Fn = None,
        policy_resp_preprocess_fn: Fn = None,
    ) -> None:
        _check_callable(obs_preprocessor=obs_preprocessor, reward_preprocessor=reward_preprocessor)
        self._preprocess = resolve_preprocess(
            preprocess, env_ret_preprocess_fn, policy_resp_preprocess_fn
        )
        self._args = (
            obs_preprocessor,
            reward_preprocessor,
            env_ret_preprocess_fn,
            policy_resp_preprocess_fn,
        )
        self._open: dict[str, dict[str, Any]] = {}

    def _run(self, buffer: dict[str, Any], env_ret: Any, policy_resp: Any) -> dict[str, Any]:
        out = self._preprocess(buffer, env_ret, policy_resp, *self._args)
        if not isinstance(out, Mapping):
            raise TypeError(f"preprocess returned {type(out).__name__}, not a mapping")
        return dict(out)

    def pair(self, env_ret: Any, policy_resp: Any) -> dict[str, Any]:
        """The transition of a matching (EnvRet, PolicyResponse) pair."""
        env_id, policy_env_id = env_id_of(env_ret), env_id_of(policy_resp)
        if env_id != policy_env_id:
            raise ValueError(
                f"mismatched env ids: EnvRet {env_id!r}, PolicyResponse {policy_env_id!r}"
            )
        return self._run({}, env_ret, policy_resp)

    def add_async(self, item: Any, *, is_env_ret: bool) -> dict[str, Any] | None:
        """Open a transition with an EnvRet (→ None) or complete it with its PolicyResponse.

        A PolicyResponse with no open transition for its env, or a second EnvRet while one is
        open, raises :class:`ValueError`; state is then unchanged.
        """
        env_id = env_id_of(item)
        if is_env_ret:
            if env_id in self._open:
                raise ValueError(
                    f"env {env_id!r}: a second EnvRet arrived while the previous one still "
                    "waits for its PolicyResponse"
                )
            self._open[env_id] = self._run({}, item, None)
            return None
        if env_id not in self._open:
            raise ValueError(f"env {env_id!r}: a PolicyResponse arrived with no EnvRet pending")
        done = self._run(dict(self._open[env_id]), None, item)
        del self._open[env_id]
        return done

    def pending_env_ids(self) -> list[str]:
        """Env ids with an EnvRet waiting for its PolicyResponse."""
        return list(self._open)

    def clear(self) -> None:
        self._open.clear()
