"""The seed-compatible ``Storage`` façade over the in-process Buffer (or a daemon's Writer)."""

from __future__ import annotations

import logging
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from shmbuffer.api.hooks import default_postprocess_fn, default_preprocess_fn
from shmbuffer.buffer import Buffer
from shmbuffer.clients import storage as storage_module
from shmbuffer.clients.storage import Storage
from shmbuffer.errors import CapacityError

# -- fakes of the seed framework's messages -----------------------------------------------------


@dataclass
class FakeEnvRet:
    env_id: str
    observation: Any
    last_reward: Any = 0.0
    last_terminated: Any = False
    last_truncated: Any = False
    info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class FakePolicyResponse:
    env_id: str
    action: Any

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class FakeEnvMeta:
    env_id: str
    num_envs: int


def obs(t: int) -> torch.Tensor:
    return torch.tensor([float(t), float(t) + 0.5])


def env_ret(t: int, env_id: str = "e", done: bool = False, **kw: Any) -> FakeEnvRet:
    return FakeEnvRet(
        env_id,
        obs(t),
        last_reward=float(t) * 10,
        last_terminated=done,
        info={"t": t, "msg": "step"},
        **kw,
    )


def policy(t: int, env_id: str = "e") -> FakePolicyResponse:
    return FakePolicyResponse(env_id, torch.tensor([t, -t]))


def run_episode(storage: Storage, steps: int, env_id: str = "e", start: int = 0) -> None:
    """``steps`` paired steps of ``env_id``; the last has last_terminated=True."""
    for t in range(start, start + steps):
        storage.add_transition(env_ret(t, env_id, done=t == start + steps - 1), policy(t, env_id))


def run_episode_async(storage: Storage, steps: int, env_id: str = "e", start: int = 0) -> None:
    for t in range(start, start + steps):
        storage.add_data_async(env_ret(t, env_id, done=t == start + steps - 1))
        storage.add_data_async(policy(t, env_id))


# -- ingestion and the seed's default postprocess ---------------------------------------------


def test_full_episode_through_add_transition_matches_seed_postprocess() -> None:
    s = Storage(capacity=20)
    for t in range(3):
        s.add_transition(env_ret(t), policy(t))
    assert len(s) == 0  # nothing is written before the episode ends
    s.add_transition(env_ret(3, done=True), policy(3))
    n = 4
    assert len(s) == n - 1 == s.size == s.get_size()
    data = s.get_data()
    assert isinstance(data, TensorDict)
    assert set(data.keys()) == {
        "observation",
        "next_observation",
        "action",
        "reward",
        "terminated",
        "truncated",
    }  # env_id (a str) and info are dropped, last_* renamed
    assert torch.equal(data["observation"], torch.stack([obs(t) for t in range(n - 1)]))
    assert torch.equal(data["next_observation"], torch.stack([obs(t) for t in range(1, n)]))
    assert data["reward"].tolist() == [10.0, 20.0, 30.0]  # last_reward of the next step
    assert data["terminated"].tolist() == [False, False, True]
    assert data["truncated"].tolist() == [False, False, False]
    assert data["action"].tolist() == [[0, 0], [1, -1], [2, -2]]


def test_run_episode_helper_terminates_on_its_last_step() -> None:
    s = Storage(capacity=20)
    run_episode(s, 5)
    assert len(s) == 4
    run_episode(s, 2, start=10)
    assert len(s) == 5
    assert s.get_data()["reward"].tolist() == [10.0, 20.0, 30.0, 40.0, 110.0]


def test_truncated_flag_also_ends_the_episode() -> None:
    s = Storage(capacity=20)
    s.add_transition(env_ret(0), policy(0))
    s.add_transition(FakeEnvRet("e", obs(1), 1.0, False, True, {"t": 1, "msg": ""}), policy(1))
    assert len(s) == 1
    assert s[0]["truncated"].item() is True


def test_add_data_async_gives_the_same_rows_as_sync() -> None:
    sync, asyn = Storage(capacity=50), Storage(capacity=50)
    for storage, run in ((sync, run_episode), (asyn, run_episode_async)):
        run(storage, 4, "a")
        run(storage, 3, "b", start=100)
        run(storage, 5, "a", start=200)
    assert len(asyn) == len(sync) == 3 + 2 + 4  # each pair stored once, not twice
    a, b = sync.get_data(), asyn.get_data()
    assert isinstance(a, TensorDict) and isinstance(b, TensorDict)
    assert set(a.keys()) == set(b.keys())
    for key in sorted(a.keys()):
        assert torch.equal(a[key], b[key]), key


def test_add_data_async_interleaved_envs() -> None:
    s = Storage(capacity=50)
    s.add_data_async(env_ret(0, "a"))
    s.add_data_async(env_ret(0, "b"))
    s.add_data_async(policy(0, "b"))
    s.add_data_async(policy(0, "a"))
    s.add_data_async(env_ret(1, "a", done=True))
    s.add_data_async(policy(1, "a"))
    assert len(s) == 1
    assert s[0]["action"].tolist() == [0, 0]


def test_add_data_async_refuses_bad_sequences_and_types() -> None:
    s = Storage(capacity=10)
    with pytest.raises(ValueError, match="no EnvRet pending"):
        s.add_data_async(policy(0))
    s.add_data_async(env_ret(0))
    with pytest.raises(ValueError, match="second EnvRet"):
        s.add_data_async(env_ret(1))
    with pytest.raises(TypeError):
        s.add_data_async(object())
    s.add_data_async(policy(0))  # the first EnvRet is still open and now completes
    s.add_data_async(env_ret(1, done=True))
    s.add_data_async(policy(1))
    assert len(s) == 1


def test_add_transition_refuses_mismatched_env_ids() -> None:
    s = Storage(capacity=10)
    with pytest.raises(ValueError, match="mismatched env ids"):
        s.add_transition(env_ret(0, "a"), policy(0, "b"))
    assert len(s) == 0
    assert s.buffer.assembler.pending() == 0


def test_obs_and_reward_preprocessors_are_applied() -> None:
    s = Storage(
        capacity=10,
        obs_preprocessor=lambda o: o * 2,
        reward_preprocessor=lambda r: r + 1.0,
    )
    run_episode(s, 3)
    data = s.get_data()
    assert torch.equal(data["observation"], torch.stack([obs(0), obs(1)]) * 2)
    assert torch.equal(data["next_observation"], torch.stack([obs(1), obs(2)]) * 2)
    assert data["reward"].tolist() == [11.0, 21.0]


def test_lower_level_preprocess_fns_are_applied() -> None:
    s = Storage(
        capacity=10,
        env_ret_preprocess_fn=lambda e: {**e.to_dict(), "extra": 7},
        policy_resp_preprocess_fn=lambda p: {"action": p.action * 3},
    )
    run_episode(s, 2)
    assert s[0]["extra"].item() == 7
    assert s[0]["action"].tolist() == [0, 0]
    run_episode(s, 2, start=5)
    assert s[-1]["action"].tolist() == [15, -15]


def test_custom_preprocess_fn_is_used() -> None:
    calls: list[int] = []

    def preprocess(buf: Any, er: Any, pr: Any, *rest: Any) -> dict[str, Any]:
        calls.append(1)
        out = default_preprocess_fn(buf, er, pr, *rest)
        out["flag"] = 1
        return out

    s = Storage(capacity=10, preprocess_fn=preprocess)
    run_episode(s, 2)
    assert len(calls) == 2 and s[0]["flag"].item() == 1


def test_constructed_as_rlightning_constructs_it_with_every_hook() -> None:
    """The seed's positional constructor with all six hooks is accepted (it was refused at
    construction). The seed calls ``preprocess_fn(transition_buffer, env_ret, policy_resp,
    obs_preprocessor, reward_preprocessor, env_ret_preprocess_fn, policy_resp_preprocess_fn)``;
    a preprocess_fn of one's own decides how to use the other four."""
    calls: list[tuple[Any, ...]] = []

    def obs_pre(o: Any) -> Any:
        return o * 2

    def reward_pre(r: Any) -> Any:
        return r + 1.0

    def env_ret_fn(e: Any) -> dict[str, Any]:
        return {**e.to_dict(), "extra": 7}

    def policy_fn(p: Any) -> dict[str, Any]:
        return {"action": p.action * 3}

    def preprocess(buf: Any, er: Any, pr: Any, *fns: Any) -> dict[str, Any]:
        calls.append((er, pr, *fns))
        out = default_preprocess_fn(buf, er, pr, *fns)
        out["mine"] = 1
        return out

    def postprocess(episode: dict[str, list[Any]]) -> dict[str, Any]:
        out = default_postprocess_fn(episode)
        out["post"] = torch.ones(len(out["reward"]))
        return out

    s = Storage(
        50,  # capacity, mode, unit, env_meta_list, device: the seed's order, all positional
        "circular",
        "transition",
        [FakeEnvMeta("e", 1)],
        "cpu",
        obs_pre,
        reward_pre,
        env_ret_fn,
        policy_fn,
        preprocess,
        postprocess,
        True,
    )
    run_episode(s, 3)
    run_episode_async(s, 3, start=10)
    assert len(s) == 4 and len(calls) == 3 + 2 * 3
    hooks = (obs_pre, reward_pre, env_ret_fn, policy_fn)
    assert all(call[2:] == hooks for call in calls)  # every call got all four, in order
    assert [(er is None, pr is None) for er, pr, *_ in calls[3:5]] == [(False, True), (True, False)]
    data = s.get_data()
    assert torch.equal(data["observation"][0], obs(0) * 2)  # obs_preprocessor
    assert data["reward"].tolist() == [11.0, 21.0, 111.0, 121.0]  # reward_preprocessor
    assert data["extra"].tolist() == [7] * 4  # env_ret_preprocess_fn
    assert data["action"].tolist() == [[0, 0], [3, -3], [30, -30], [33, -33]]  # policy_resp fn
    assert data["mine"].tolist() == [1] * 4 and data["post"].tolist() == [1.0] * 4


def test_custom_postprocess_fn_is_used() -> None:
    def postprocess(episode: dict[str, list[Any]]) -> dict[str, Any]:
        return {"obs": torch.stack(episode["observation"])}

    s = Storage(capacity=10, postprocess_fn=postprocess)
    run_episode(s, 3)
    assert len(s) == 3  # every step is a row: no shift
    assert list(s.get_data().keys()) == ["obs"]


# -- configuration ----------------------------------------------------------------------------


def test_defaults() -> None:
    with Storage() as s:
        assert (s.capacity, s.mode, s.unit) == (100_000, "circular", "transition")
        assert s.auto_truncate_episode is True
        assert s.device == torch.device("cpu")
        assert isinstance(s.buffer, Buffer)


@pytest.mark.parametrize("mode", ["standard", "ring", ""])
def test_unknown_mode_is_refused(mode: str) -> None:
    with pytest.raises(ValueError, match=r"mode.*circular.*fixed"):
        Storage(capacity=10, mode=mode)


def test_unknown_unit_is_refused() -> None:
    with pytest.raises(ValueError, match=r"unit.*transition.*episode"):
        Storage(capacity=10, unit="step")


def test_bad_env_meta_is_refused() -> None:
    with pytest.raises(TypeError, match="env_id and num_envs"):
        Storage(env_meta_list=[object()])


# -- reading ----------------------------------------------------------------------------------


def episode_storage() -> Storage:
    """Episode unit with episodes of 3, 3 and 2 rows (rewards 10.., 110.., 210..)."""
    s = Storage(capacity=50, unit="episode")
    run_episode(s, 4)
    run_episode(s, 4, start=10)
    run_episode(s, 3, start=20)
    return s


def test_episode_unit_indexing() -> None:
    s = episode_storage()
    assert len(s) == 3 == s.size == s.get_size()
    first = s[0]
    assert isinstance(first, dict)
    assert first["reward"].tolist() == [10.0, 20.0, 30.0]
    assert first["observation"].shape == (3, 2)
    last = s[-1]
    assert isinstance(last, dict)
    assert last["reward"].tolist() == [210.0, 220.0]
    pair = s[[0, 1]]  # equal lengths: one [2, 3] TensorDict, returned as a dict
    assert isinstance(pair, dict)
    assert pair["reward"].tolist() == [[10.0, 20.0, 30.0], [110.0, 120.0, 130.0]]
    assert pair["observation"].shape == (2, 3, 2)
    everything = s[0:3]  # unequal lengths: a list of TensorDicts
    assert isinstance(everything, list) and len(everything) == 3
    assert all(isinstance(td, TensorDict) for td in everything)
    assert [td.batch_size[0] for td in everything] == [3, 3, 2]
    assert everything[2]["reward"].tolist() == [210.0, 220.0]
    tail = s[1:]
    assert isinstance(tail, list) and [td["reward"][0].item() for td in tail] == [110.0, 210.0]
    assert isinstance(s[-2:-1], dict) and s[-2:-1]["reward"].tolist() == [[110.0, 120.0, 130.0]]
    assert s[np.array([2, 0])][0]["reward"].tolist() == [210.0, 220.0]
    assert s[torch.tensor([-1])]["reward"].tolist() == [[210.0, 220.0]]
    assert s[5:] == []


def test_episode_unit_get_data() -> None:
    s = episode_storage()
    data = s.get_data()
    assert isinstance(data, list) and [td.batch_size[0] for td in data] == [3, 3, 2]
    s2 = Storage(capacity=50, unit="episode")
    run_episode(s2, 3)
    run_episode(s2, 3, start=10)
    data2 = s2.get_data()
    assert isinstance(data2, TensorDict) and data2.batch_size == (2, 2)


@pytest.mark.parametrize("index", [3, -4, [0, 3], np.array([-5])])
def test_episode_index_out_of_range(index: Any) -> None:
    s = episode_storage()
    with pytest.raises(IndexError):
        s[index]


def test_transition_unit_getitem_returns_dicts() -> None:
    s = Storage(capacity=50)
    run_episode(s, 5)  # rewards 10, 20, 30, 40
    row = s[0]
    assert isinstance(row, dict)
    assert row["reward"].item() == 10.0 and row["observation"].tolist() == obs(0).tolist()
    assert s[-1]["reward"].item() == 40.0
    rows = s[1:3]
    assert isinstance(rows, dict) and rows["reward"].tolist() == [20.0, 30.0]
    assert s[[3, 0]]["reward"].tolist() == [40.0, 10.0]
    with pytest.raises(IndexError):
        s[4]
    with pytest.raises(IndexError):
        s[-5]


def test_circular_transition_unit_keeps_the_newest_oldest_first() -> None:
    s = Storage(capacity=5)
    run_episode(s, 4)  # 3 rows: 10, 20, 30
    run_episode(s, 4, start=10)  # 3 rows: 110, 120, 130 -> wraps over the oldest rows
    assert 3 <= len(s) <= 5
    rewards = s.get_data()["reward"].tolist()
    assert rewards[-3:] == [110.0, 120.0, 130.0]  # oldest first, the newest kept
    assert rewards[:-3] == [10.0, 20.0, 30.0][3 - (len(s) - 3) :]
    assert s[-1]["reward"].item() == 130.0


def test_circular_episode_unit_evicts_whole_episodes() -> None:
    s = Storage(capacity=7, unit="episode")
    run_episode(s, 4)
    run_episode(s, 4, start=10)
    run_episode(s, 4, start=20)  # does not fit after 6 rows: wraps, evicting episode 0
    assert len(s) == 2
    assert s[0]["reward"].tolist() == [110.0, 120.0, 130.0]
    assert s[1]["reward"].tolist() == [210.0, 220.0, 230.0]


def test_reads_on_an_empty_storage() -> None:
    for unit in ("transition", "episode"):
        s = Storage(capacity=5, unit=unit)
        assert len(s) == 0 and not s
        data = s.get_data()
        assert isinstance(data, TensorDict) and data.batch_size == (0,)
        with pytest.raises(IndexError):
            s[0]
        assert s[:] == ([] if unit == "episode" else {})


# -- fixed mode -------------------------------------------------------------------------------


def test_fixed_mode_full_raises_capacity_error_and_keeps_data() -> None:
    s = Storage(capacity=5, mode="fixed")
    run_episode(s, 4)  # 3 rows
    before = s.get_data().clone()
    with pytest.raises(CapacityError):
        run_episode(s, 4, start=10)  # 3 more rows do not fit
    assert len(s) == 3
    after = s.get_data()
    for key in sorted(before.keys()):
        assert torch.equal(before[key], after[key]), key
    with pytest.raises(CapacityError):
        s.add_episode(before[:3])
    assert len(s) == 3
    run_episode(s, 3, start=20)  # 2 rows still fit
    assert len(s) == 5


# -- add_episode ------------------------------------------------------------------------------


def test_add_episode_single_and_vector() -> None:
    s = Storage(capacity=50, unit="episode")
    s.add_episode({"x": torch.arange(4), "y": torch.ones(4, 2)})
    s.add_episode(TensorDict({"x": torch.arange(3), "y": torch.zeros(3, 2)}, batch_size=[3]))
    vec = {"x": torch.arange(6).reshape(3, 2), "y": torch.zeros(3, 2, 2)}
    s.add_episode(vec, num_envs=2)
    assert len(s) == 4
    assert s[0]["x"].tolist() == [0, 1, 2, 3]
    assert s[1]["x"].tolist() == [0, 1, 2]
    assert s[2]["x"].tolist() == [0, 2, 4]  # sub-env 0
    assert s[3]["x"].tolist() == [1, 3, 5]  # sub-env 1


# -- truncation -------------------------------------------------------------------------------


def test_truncate_one_episode_twice_is_a_no_op() -> None:
    s = Storage(capacity=20, unit="episode")
    for t in range(3):
        s.add_transition(env_ret(t), policy(t))
    s.truncate_one_episode("e")
    assert len(s) == 1 and s[0]["reward"].tolist() == [10.0, 20.0]
    s.truncate_one_episode("e")
    s.truncate_one_episode(env_ret(9))  # an object with env_id
    s.truncate_one_episode("never-seen")
    assert len(s) == 1


def test_truncate_one_episode_refuses_other_types() -> None:
    s = Storage(capacity=20)
    with pytest.raises(TypeError, match="env_id"):
        s.truncate_one_episode(3)


def test_truncate_episodes_without_auto_truncate() -> None:
    s = Storage(capacity=50, unit="episode", auto_truncate_episode=False)
    for t in range(4):  # done flags are not looked at
        s.add_transition(env_ret(t, "a", done=True), policy(t, "a"))
        s.add_transition(env_ret(t, "b"), policy(t, "b"))
    assert len(s) == 0
    s.truncate_episodes(["a", "b"])
    assert len(s) == 2
    assert s[0]["reward"].tolist() == [10.0, 20.0, 30.0]
    s.truncate_episodes(["a", "b"])
    assert len(s) == 2


def test_truncate_keeps_an_open_async_env_ret_for_the_next_episode() -> None:
    s = Storage(capacity=50, unit="episode")
    for t in range(2):
        s.add_data_async(env_ret(t))
        s.add_data_async(policy(t))
    s.add_data_async(env_ret(2))  # opened, not yet part of the episode
    s.truncate_one_episode("e")
    assert len(s) == 1 and s[0]["reward"].tolist() == [10.0]
    s.add_data_async(policy(2))
    s.add_data_async(env_ret(3, done=True))
    s.add_data_async(policy(3))
    assert len(s) == 2 and s[1]["reward"].tolist() == [30.0]


# -- vector envs ------------------------------------------------------------------------------


def vec_env_ret(t: int, done: tuple[bool, bool]) -> FakeEnvRet:
    return FakeEnvRet(
        "vec",
        torch.stack([obs(t), obs(t + 100)]),
        last_reward=torch.tensor([float(t), float(t + 100)]),
        last_terminated=torch.tensor(done),
        last_truncated=torch.tensor([False, False]),
    )


def vec_policy(t: int) -> FakePolicyResponse:
    return FakePolicyResponse("vec", torch.tensor([[t], [t + 100]]))


def test_vector_env_auto_truncate_splits_into_sub_env_ids() -> None:
    s = Storage(capacity=50, unit="episode", env_meta_list=[FakeEnvMeta("vec", 2)])
    assembler = s.buffer.assembler
    s.add_transition(vec_env_ret(0, (False, False)), vec_policy(0))
    s.add_transition(vec_env_ret(1, (False, False)), vec_policy(1))
    assert assembler.pending("vec/0") == 2 and assembler.pending("vec/1") == 2
    s.add_transition(vec_env_ret(2, (False, True)), vec_policy(2))  # sub-env 1 ends
    assert assembler.pending("vec/0") == 3 and assembler.pending("vec/1") == 0
    assert len(s) == 1
    assert s[0]["reward"].tolist() == [101.0, 102.0]
    assert s[0]["observation"].tolist() == [obs(100).tolist(), obs(101).tolist()]
    assert s[0]["action"].tolist() == [[100], [101]]
    s.add_transition(vec_env_ret(3, (True, False)), vec_policy(3))  # sub-env 0 ends
    assert len(s) == 2
    assert s[1]["reward"].tolist() == [1.0, 2.0, 3.0]
    assert assembler.pending("vec/1") == 1
    with pytest.warns(RuntimeWarning, match="no rows"):  # sub-env 1: one step, zero rows
        s.truncate_one_episode("vec")  # ends every sub-env of "vec"
    assert len(s) == 2
    assert assembler.pending() == 0


def test_vector_env_truncate_writes_every_sub_env() -> None:
    s = Storage(capacity=50, unit="episode", env_meta_list=[FakeEnvMeta("vec", 2)])
    for t in range(3):
        s.add_transition(vec_env_ret(t, (False, False)), vec_policy(t))
    s.truncate_episodes(["vec"])
    assert len(s) == 2
    rewards = sorted(s[i]["reward"].tolist() for i in range(2))
    assert rewards == [[1.0, 2.0], [101.0, 102.0]]


def test_vector_env_without_auto_truncate_is_stored_env_major() -> None:
    s = Storage(
        capacity=50,
        unit="episode",
        env_meta_list=[FakeEnvMeta("vec", 2), FakeEnvMeta("single", 1)],
        auto_truncate_episode=False,
    )
    for t in range(4):
        s.add_transition(vec_env_ret(t, (t == 3, False)), vec_policy(t))
    assert len(s) == 0
    s.truncate_one_episode("vec")
    assert len(s) == 2
    assert s[0]["reward"].tolist() == [1.0, 2.0, 3.0]
    assert s[1]["reward"].tolist() == [101.0, 102.0, 103.0]


# -- sizes, clear, lifecycle ------------------------------------------------------------------


def test_len_size_get_size_and_clear() -> None:
    s = Storage(capacity=20)
    run_episode(s, 4)
    assert len(s) == s.size == s.get_size() == 3 and s
    s.add_transition(env_ret(10), policy(10))  # pending step
    s.add_data_async(env_ret(0, "x"))  # half-paired transition
    s.clear()
    assert len(s) == s.size == s.get_size() == 0 and not s
    assert s.buffer.assembler.pending() == 0
    with pytest.raises(ValueError, match="no EnvRet pending"):
        s.add_data_async(policy(0, "x"))
    run_episode(s, 2, start=50)
    assert len(s) == 1 and s[0]["reward"].item() == 510.0


def test_close_is_idempotent_and_context_manager_closes() -> None:
    with Storage(capacity=10) as s:
        run_episode(s, 2)
    assert s.buffer.segment is None
    s.close()


def test_named_storage_uses_a_shared_memory_segment() -> None:
    name = f"storage-test-{uuid.uuid4().hex[:12]}"
    with Storage(capacity=10, name=name) as s:
        run_episode(s, 3)
        assert s.buffer.name == name and len(s) == 2


def test_print_timing_summary(caplog: pytest.LogCaptureFixture) -> None:
    s = Storage(capacity=10)
    run_episode(s, 3)
    s.add_data_async(env_ret(0, "x"))
    assert s.timing_raw["add_transition"]["count"] == 3
    assert s.timing_raw["add_data_async"]["count"] == 1
    stats = s.timing_raw["add_transition"]
    with caplog.at_level(logging.DEBUG, logger="shmbuffer.clients.storage"):
        s.print_timing_summary(reset=True)
    # The seed's header and line format, which log scrapers match on.
    lines = caplog.messages
    assert lines[0] == "Buffer storage timing:"
    assert lines[1] == (
        f"{'add_transition':28} count={3:<3} total={stats['total']:.6f}s avg={stats['avg']:.6f}s"
    )
    assert lines[2].startswith(f"{'add_data_async':28} count=1   total=")
    assert s.timing_raw == {}
    s.print_timing_summary()


# -- daemon backend (a fake Writer: the wiring only) ------------------------------------------


class FakeWriter:
    instances: list[FakeWriter] = []

    def __init__(self, target: str, **kwargs: Any) -> None:
        self.target, self.kwargs = target, kwargs
        self.capacity, self.unit, self.mode = 64, "episode", "circular"
        self.calls: list[tuple[str, Any]] = []
        FakeWriter.instances.append(self)

    def add_transition(self, env_id: str, transition: dict[str, Any]) -> None:
        self.calls.append(("add_transition", env_id))

    def end_episode(self, env_id: str) -> None:
        self.calls.append(("end_episode", env_id))

    def add_episode(self, episode: Any, num_envs: int = 1) -> None:
        self.calls.append(("add_episode", num_envs))

    def flush(self) -> None:
        self.calls.append(("flush", None))

    def close(self) -> None:
        self.calls.append(("close", None))


def test_daemon_backend_writes_through_a_writer_and_refuses_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(storage_module, "Writer", FakeWriter)
    s = Storage(env_meta_list=[FakeEnvMeta("v", 3)], daemon="mybuf")
    writer = FakeWriter.instances[-1]
    assert writer.target == "mybuf"
    assert writer.kwargs["num_envs"] == {"v": 3}
    assert writer.kwargs["done_keys"] == ("last_terminated", "last_truncated")
    assert writer.kwargs["auto_truncate"] is True
    assert (s.capacity, s.unit) == (64, "episode")  # the daemon's configuration
    s.add_transition(env_ret(0), policy(0))
    s.add_data_async(env_ret(1))
    s.add_data_async(policy(1))
    s.truncate_one_episode("e")
    s.add_episode({"x": torch.zeros(2)})
    s.flush()
    assert [c[0] for c in writer.calls] == [
        "add_transition",
        "add_transition",
        "end_episode",
        "add_episode",
        "flush",
    ]
    assert s  # truthy without asking the daemon
    for read in (lambda: s[0], s.get_data, lambda: len(s), lambda: s.size, s.clear):
        with pytest.raises(NotImplementedError, match=r"shmbuffer\.Reader"):
            read()
    with s:
        pass
    s.close()
    assert writer.calls[-1] == ("close", None)
    assert writer.calls.count(("close", None)) == 1


def test_daemon_backend_refuses_settings_the_daemon_does_not_have(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A capacity/unit/mode the daemon does not have is refused naming each difference (it
    ran on silently with the daemon's), and the Writer is closed, not leaked."""
    monkeypatch.setattr(storage_module, "Writer", FakeWriter)  # 64 rows, episode, circular
    with pytest.raises(ValueError) as info:
        Storage(capacity=10**6, mode="fixed", unit="transition", daemon="mybuf")
    message = str(info.value)
    assert "capacity: requested 1000000, daemon has 64" in message
    assert "mode: requested fixed, daemon has circular" in message
    assert "unit: requested transition, daemon has episode" in message
    assert "--capacity 1000000 --mode fixed --unit transition" in message  # how to match it
    assert FakeWriter.instances[-1].calls == [("close", None)]
    with pytest.raises(ValueError, match=r"^Storage\(daemon='mybuf'\).*: capacity: .*64\. "):
        Storage(capacity=10, mode="circular", unit="episode", daemon="mybuf")  # only capacity
    with Storage(64, "circular", "episode", daemon="mybuf") as s:  # the same settings: fine
        assert (s.capacity, s.mode, s.unit) == (64, "circular", "episode")
    with Storage(unit="episode", daemon="mybuf") as s:  # None: whatever the daemon has
        assert s.capacity == 64


@pytest.mark.parametrize("capacity", [0, -5, 2.5, "100", True])
def test_a_bad_capacity_is_refused_before_connecting(
    monkeypatch: pytest.MonkeyPatch, capacity: Any
) -> None:
    monkeypatch.setattr(storage_module, "Writer", FakeWriter)
    before = len(FakeWriter.instances)
    with pytest.raises(ValueError, match=r"capacity must be a positive int or None, got"):
        Storage(capacity=capacity, daemon="mybuf")
    with pytest.raises(ValueError, match=r"capacity must be a positive int or None, got"):
        Storage(capacity=capacity)
    assert len(FakeWriter.instances) == before


# -- transition unit: what the ring keeps of an episode --------------------------------------


def _steps(episode: int, length: int) -> dict[str, torch.Tensor]:
    return {"ep": torch.full((length,), episode), "t": torch.arange(length)}


def test_transition_unit_keeps_fragments_as_the_readme_says() -> None:
    """Three 10-row episodes in 25 rows, the README's case. Transition
    unit overwrites row by row, so the oldest episode keeps its last 5 rows and the third one,
    which wrapped around the ring's end, is two 5-row entries; ``sample_episodes`` returns
    these entries. Episode unit keeps whole episodes only (README: "Units")."""
    s = Storage(capacity=25, unit="transition", seed=0)
    for e in range(3):
        s.add_episode(_steps(e, 10))
    buf = s.buffer
    assert len(s) == 25 and buf.num_episodes == 4
    entries = [(ep.start, ep.end) for ep in buf.container.registry]
    assert entries == [(5, 10), (10, 20), (20, 25), (0, 5)]
    sampled = buf.sample_episodes(64)
    assert isinstance(sampled, list)  # unequal lengths
    kinds = {(int(ep["ep"][0]), tuple(ep["t"].tolist())) for ep in sampled}
    assert kinds == {
        (0, (5, 6, 7, 8, 9)),  # the surviving tail of episode 0
        (1, tuple(range(10))),  # the only whole one
        (2, (0, 1, 2, 3, 4)),  # episode 2 before the ring's end ...
        (2, (5, 6, 7, 8, 9)),  # ... and after it
    }
    whole = Storage(capacity=25, unit="episode", seed=0)
    for e in range(3):
        whole.add_episode(_steps(e, 10))
    assert len(whole) == 2
    assert {tuple(ep["t"].tolist()) for ep in whole.buffer.sample_episodes(16)} == {
        tuple(range(10))
    }


def test_transition_unit_fragments_are_few_and_never_mix_episodes() -> None:
    """The README's bound, over random lengths: every entry is consecutive steps of one
    episode; at most three are not whole — the two pieces of the newest episode that wrapped
    (one ends at the ring's end, one starts at row 0) and the entry the ring is part-way
    through overwriting (it starts at the write pointer)."""
    rng = np.random.default_rng(7)
    capacity = 25
    s = Storage(capacity=capacity, unit="transition")
    buf = s.buffer
    lengths: dict[int, int] = {}
    for e in range(400):
        lengths[e] = int(rng.integers(1, 13))
        s.add_episode(_steps(e, lengths[e]))
        assert buf.segment is not None
        ep_col = buf.segment.columns[("ep",)].numpy()
        t_col = buf.segment.columns[("t",)].numpy()
        fragments = []
        for entry in buf.container.registry:
            eps, ts = ep_col[entry.start : entry.end], t_col[entry.start : entry.end]
            assert (eps == eps[0]).all(), f"entry {entry} mixes episodes {set(eps.tolist())}"
            assert (np.diff(ts) == 1).all(), f"entry {entry} is not consecutive steps"
            if entry.length != lengths[int(eps[0])]:
                fragments.append(entry)
        assert len(fragments) <= 3, fragments
        pointer = buf.container.pointer
        for entry in fragments:
            assert entry.end == capacity or entry.start in (0, pointer), (entry, pointer)
