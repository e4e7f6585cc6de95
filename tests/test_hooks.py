"""Seed-compatible pre/postprocess hooks and EnvRet/PolicyResponse pairing."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from shmbuffer.api.episodes import SEED_DONE_KEYS, EpisodeAssembler
from shmbuffer.api.hooks import (
    TransitionPairer,
    default_postprocess_fn,
    default_preprocess_fn,
    env_id_of,
    is_env_ret,
    resolve_preprocess,
)


@dataclass
class FakeEnvRet:
    env_id: str
    observation: Any
    last_reward: float = 0.0
    last_terminated: bool = False
    last_truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class FakePolicyResponse:
    env_id: str
    action: Any
    log_prob: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def env_ret(t: int, env_id: str = "e", **kw: Any) -> FakeEnvRet:
    return FakeEnvRet(env_id, torch.full((2,), float(t)), last_reward=float(t), **kw)


def policy(t: int, env_id: str = "e") -> FakePolicyResponse:
    return FakePolicyResponse(env_id, torch.tensor([t]), log_prob=-float(t))


# -- default_preprocess_fn -----------------------------------------------------------------------


def test_preprocess_merges_both_into_a_copy() -> None:
    buf = {"old": 1}
    out = default_preprocess_fn(buf, env_ret(3), policy(3), None, None, None, None)
    assert buf == {"old": 1} and out is not buf
    assert out["old"] == 1 and out["env_id"] == "e" and out["last_reward"] == 3.0
    assert out["action"].tolist() == [3] and out["log_prob"] == -3.0


def test_preprocess_applies_obs_and_reward_preprocessors() -> None:
    out = default_preprocess_fn(
        {}, env_ret(2), None, lambda o: o * 10, lambda r: r + 0.5, None, None
    )
    assert out["observation"].tolist() == [20.0, 20.0] and out["last_reward"] == 2.5
    assert "action" not in out
    # preprocessors are skipped when the key is absent
    out = default_preprocess_fn(
        {}, {"env_id": "e"}, None, lambda o: 1 / 0, lambda r: 1 / 0, None, None
    )
    assert out == {"env_id": "e"}


def test_preprocess_uses_lower_level_fns_instead_of_to_dict() -> None:
    out = default_preprocess_fn(
        None,
        env_ret(1),
        policy(1),
        lambda o: o + 1,
        None,
        lambda er: {"observation": er.observation, "tag": "env"},
        lambda pr: {"act": pr.action},
    )
    assert set(out) == {"observation", "tag", "act"}
    assert out["observation"].tolist() == [2.0, 2.0]  # obs_preprocessor ran on the fn's output


def test_preprocess_accepts_mappings_and_none() -> None:
    out = default_preprocess_fn({}, None, {"env_id": "e", "action": 1}, None, None, None, None)
    assert out == {"env_id": "e", "action": 1}
    assert default_preprocess_fn({"a": 1}, None, None, None, None, None, None) == {"a": 1}
    with pytest.raises(TypeError, match="to_dict"):
        default_preprocess_fn({}, object(), None, None, None, None, None)


# -- default_postprocess_fn ----------------------------------------------------------------------


def three_steps() -> dict[str, list[Any]]:
    rets = [env_ret(0), env_ret(1), env_ret(2, last_terminated=True, info={"k": 1})]
    steps = [
        default_preprocess_fn({}, r, policy(t), None, None, None, None) for t, r in enumerate(rets)
    ]
    return {k: [s[k] for s in steps] for k in steps[0]}


def test_default_postprocess_shifts_three_steps_into_two_rows() -> None:
    out = default_postprocess_fn(three_steps())
    assert set(out) == {
        "observation",
        "next_observation",
        "reward",
        "terminated",
        "truncated",
        "action",
        "log_prob",
    }  # info and env_id dropped
    assert out["observation"][:, 0].tolist() == [0.0, 1.0]
    assert out["next_observation"][:, 0].tolist() == [1.0, 2.0]
    assert out["reward"].tolist() == [1.0, 2.0]  # from last_reward[1:]
    assert out["terminated"].tolist() == [False, True]  # from last_terminated[1:]
    assert out["truncated"].tolist() == [False, False]
    assert out["action"].squeeze(-1).tolist() == [0, 1]  # v[:-1]
    assert out["log_prob"].tolist() == [0.0, -1.0]


def test_default_postprocess_nested_and_non_numeric() -> None:
    episode: dict[str, list[Any]] = {
        "observation": [{"img": np.full(2, t), "name": f"s{t}"} for t in range(3)],
        "step_info": [1, 2, 3],
        "label": [None, None, None],
        "arr": [np.array(["a"]), np.array(["b"]), np.array(["c"])],
    }
    out = default_postprocess_fn(episode)
    assert set(out) == {"observation", "next_observation"}
    assert set(out["observation"]) == {"img"}
    assert out["observation"]["img"][:, 0].tolist() == [0, 1]
    assert out["next_observation"]["img"][:, 0].tolist() == [1, 2]


def test_default_postprocess_refuses_colliding_keys() -> None:
    with pytest.raises(ValueError, match="reward"):
        default_postprocess_fn({"reward": [1.0, 2.0], "last_reward": [0.0, 1.0]})


def test_assembler_with_seed_hooks_end_to_end() -> None:
    asm = EpisodeAssembler(done_keys=SEED_DONE_KEYS, postprocess_fn=default_postprocess_fn)
    pairer = TransitionPairer(None)
    assert asm.add_transition("e", pairer.pair(env_ret(0), policy(0))) == []
    assert asm.add_transition("e", pairer.pair(env_ret(1), policy(1))) == []
    [ep] = asm.add_transition("e", pairer.pair(env_ret(2, last_terminated=True), policy(2)))
    assert ep.length == 2
    assert ep.data["reward"].tolist() == [1.0, 2.0]
    assert ep.data["terminated"].tolist() == [False, True]
    assert ep.data["next_observation"][:, 0].tolist() == [1.0, 2.0]


def test_one_step_episode_under_default_postprocess_warns_and_is_dropped() -> None:
    """Seed regression: N-1 = 0 rows crashed the seed's registry."""
    asm = EpisodeAssembler(done_keys=SEED_DONE_KEYS, postprocess_fn=default_postprocess_fn)
    tr = TransitionPairer(None).pair(env_ret(0, last_truncated=True), policy(0))
    with pytest.warns(RuntimeWarning, match="env 'e'"):
        assert asm.add_transition("e", tr) == []
    assert asm.pending() == 0


def test_vector_env_without_auto_truncate_with_default_postprocess() -> None:
    n = 2
    asm = EpisodeAssembler(
        num_envs={"v": n}, auto_truncate=False, postprocess_fn=default_postprocess_fn
    )
    for t in range(3):
        asm.add_transition(
            "v",
            {
                "observation": torch.tensor([[10.0 * e + t] for e in range(n)]),
                "last_reward": torch.tensor([float(10 * e + t) for e in range(n)]),
                "env_id": "v",
            },
        )
    [ep] = asm.end_episode("v")
    assert ep.num_sub_episodes == n and ep.length == 2
    assert ep.data["observation"].squeeze(-1).tolist() == [0.0, 1.0, 10.0, 11.0]
    assert ep.data["next_observation"].squeeze(-1).tolist() == [1.0, 2.0, 11.0, 12.0]
    assert ep.data["reward"].tolist() == [1.0, 2.0, 11.0, 12.0]


# -- resolve_preprocess --------------------------------------------------------------------------


def custom(buf: Any, er: Any, pr: Any, *_: Any) -> dict[str, Any]:
    return {"custom": True}


def test_resolve_preprocess() -> None:
    assert resolve_preprocess(None, None, None) is default_preprocess_fn
    assert resolve_preprocess(None, lambda x: x, lambda x: x) is default_preprocess_fn
    assert resolve_preprocess(custom, None, None) is custom
    assert resolve_preprocess(default_preprocess_fn, lambda x: x, None) is default_preprocess_fn
    assert resolve_preprocess(custom, lambda x: x, lambda x: x) is custom  # as the seed


def test_custom_preprocess_gets_every_lower_level_fn_as_the_seed_passes_them() -> None:
    """A custom preprocess_fn with env_ret/policy_resp fns is accepted (it was refused) and gets
    all four fns as arguments, in the seed's order, sync and async alike."""
    fns = (lambda o: o, lambda r: r, lambda e: e.to_dict(), lambda p: p.to_dict())
    seen: list[tuple[Any, ...]] = []

    def preprocess(buf: Any, er: Any, pr: Any, *rest: Any) -> dict[str, Any]:
        seen.append((dict(buf), er, pr, *rest))
        return default_preprocess_fn(buf, er, pr, *rest)

    pairer = TransitionPairer(preprocess, *fns)
    er, pr = env_ret(1), policy(1)
    out = pairer.pair(er, pr)
    assert seen[-1] == ({}, er, pr, *fns)
    assert out["observation"].tolist() == [1.0, 1.0] and out["action"].tolist() == [1]
    assert pairer.add_async(er, is_env_ret=True) is None
    assert seen[-1] == ({}, er, None, *fns)
    done = pairer.add_async(pr, is_env_ret=False)
    opened = seen[-1][0]
    assert seen[-1][1:] == (None, pr, *fns) and opened["env_id"] == "e"  # the EnvRet's dict
    assert done is not None and done.keys() == out.keys()


@pytest.mark.parametrize(
    "which", ["obs_preprocessor", "reward_preprocessor", "env_ret", "policy_resp"]
)
def test_a_hook_that_is_not_callable_is_refused_by_name(which: str) -> None:
    names = ["obs_preprocessor", "reward_preprocessor", "env_ret", "policy_resp"]
    fns: list[Any] = [None] * 4
    fns[names.index(which)] = 3
    with pytest.raises(TypeError, match=rf"{which}\w* must be callable or None, got int"):
        TransitionPairer(None, *fns)
    with pytest.raises(TypeError, match="preprocess_fn must be callable"):
        TransitionPairer(3)  # type: ignore[arg-type]


# -- TransitionPairer ----------------------------------------------------------------------------


def test_pair_checks_env_ids_and_returns_fresh_dicts() -> None:
    pairer = TransitionPairer(None)
    with pytest.raises(ValueError, match=r"'a'.*'b'"):
        pairer.pair(env_ret(0, "a"), policy(0, "b"))
    first = pairer.pair(env_ret(0), policy(0))
    second = pairer.pair(env_ret(0), policy(0))
    assert first is not second and first.keys() == second.keys()


def test_pair_passes_preprocessors() -> None:
    pairer = TransitionPairer(None, lambda o: o * 0, None, None, lambda pr: {"a": pr.action})
    out = pairer.pair(env_ret(5), policy(5))
    assert out["observation"].tolist() == [0.0, 0.0] and out["a"].tolist() == [5]
    assert "log_prob" not in out


def mutating_preprocess(buf: Any, er: Any, pr: Any, *_: Any) -> Any:
    """The seed's habit: fill the given buffer in place and return it."""
    if er is not None:
        buf["obs"] = er.observation
    if pr is not None:
        buf["action"] = pr.action
    return buf


@pytest.mark.parametrize("preprocess", [None, mutating_preprocess])
def test_async_pairing_appends_one_fresh_dict_per_pair(preprocess: Any) -> None:
    """Seed regression: add_data_async appended one dict twice and mutated it later."""
    pairer = TransitionPairer(preprocess)
    appended: list[dict[str, Any]] = []
    for t in range(3):
        assert pairer.add_async(env_ret(t), is_env_ret=True) is None
        assert pairer.pending_env_ids() == ["e"]
        done = pairer.add_async(policy(t), is_env_ret=False)
        assert done is not None
        appended.append(done)
    assert len(appended) == 3
    assert len({id(d) for d in appended}) == 3
    for t, d in enumerate(appended):
        assert d["action"].tolist() == [t]  # earlier dicts were not mutated by later pairs
    assert pairer.pending_env_ids() == []


def test_async_pairing_per_env_interleaved() -> None:
    pairer = TransitionPairer(None)
    pairer.add_async(env_ret(0, "a"), is_env_ret=True)
    pairer.add_async(env_ret(1, "b"), is_env_ret=True)
    b = pairer.add_async(policy(1, "b"), is_env_ret=False)
    a = pairer.add_async(policy(0, "a"), is_env_ret=False)
    assert a is not None and b is not None
    assert a["last_reward"] == 0.0 and b["last_reward"] == 1.0


def test_async_pairing_errors_name_the_env_and_keep_state() -> None:
    pairer = TransitionPairer(None)
    with pytest.raises(ValueError, match=r"'e'.*no EnvRet pending"):
        pairer.add_async(policy(0), is_env_ret=False)
    pairer.add_async(env_ret(0), is_env_ret=True)
    with pytest.raises(ValueError, match=r"'e'.*second EnvRet"):
        pairer.add_async(env_ret(1), is_env_ret=True)
    done = pairer.add_async(policy(0), is_env_ret=False)
    assert done is not None and done["last_reward"] == 0.0  # the first EnvRet was kept
    pairer.add_async(env_ret(2), is_env_ret=True)
    pairer.clear()
    assert pairer.pending_env_ids() == []


def test_async_pairing_with_mappings() -> None:
    pairer = TransitionPairer(None)
    items = [{"env_id": "m", "observation": 1.0}, {"env_id": "m", "action": 2}]
    for item in items:
        out = pairer.add_async(item, is_env_ret=is_env_ret(item))
    assert out == {"env_id": "m", "observation": 1.0, "action": 2}


# -- helpers -------------------------------------------------------------------------------------


class EnvRetV2:
    env_id = "x"


class MyPolicyResponse:
    env_id = "x"
    observation = None  # the name wins over attributes


class Obj:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def test_is_env_ret() -> None:
    assert is_env_ret(env_ret(0)) is True
    assert is_env_ret(policy(0)) is False
    assert is_env_ret(EnvRetV2()) is True
    assert is_env_ret(MyPolicyResponse()) is False
    assert is_env_ret({"observation": 1}) is True
    assert is_env_ret({"action": 1}) is False
    assert is_env_ret(Obj(observation=1)) is True
    assert is_env_ret(Obj(action=1)) is False
    with pytest.raises(TypeError):
        is_env_ret({"observation": 1, "action": 2})
    with pytest.raises(TypeError):
        is_env_ret(Obj())


def test_env_id_of() -> None:
    assert env_id_of(env_ret(0, "q")) == "q"
    assert env_id_of({"env_id": "m"}) == "m"
    with pytest.raises(TypeError, match="env_id"):
        env_id_of({"observation": 1})
    with pytest.raises(TypeError, match="env_id"):
        env_id_of(object())
