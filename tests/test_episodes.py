"""EpisodeAssembler: done detection, manual truncation, vector envs, postprocessing, errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from shmbuffer.api.episodes import (
    DEFAULT_DONE_KEYS,
    EpisodeAssembler,
    FinishedEpisode,
    stack_episode,
)
from shmbuffer.errors import SchemaError


def step(t: float, *, terminated: Any = False, truncated: Any = False) -> dict[str, Any]:
    return {
        "obs": torch.tensor([t, t + 0.5]),
        "reward": float(t),
        "terminated": terminated,
        "truncated": truncated,
    }


def vstep(t: int, n: int, done: list[bool]) -> dict[str, Any]:
    """A vector-env step: obs[e] = 100 * e + t."""
    return {
        "obs": torch.tensor([[100.0 * e + t] for e in range(n)]),
        "terminated": torch.tensor(done),
        "truncated": np.zeros(n, dtype=bool),
    }


# -- done detection ----------------------------------------------------------------------------


def test_default_done_keys_are_gymnasium() -> None:
    assert DEFAULT_DONE_KEYS == ("terminated", "truncated")


def test_done_step_ends_the_episode_and_belongs_to_it() -> None:
    asm = EpisodeAssembler()
    assert asm.add_transition("a", step(0)) == []
    assert asm.add_transition("a", step(1)) == []
    [ep] = asm.add_transition("a", step(2, terminated=True))
    assert isinstance(ep, FinishedEpisode)
    assert ep.env_id == "a" and ep.num_sub_episodes == 1 and ep.length == 3
    assert ep.data.batch_size == torch.Size([3])
    assert ep.data["obs"][:, 0].tolist() == [0.0, 1.0, 2.0]
    assert ep.data["reward"].tolist() == [0.0, 1.0, 2.0]
    assert ep.data["terminated"].tolist() == [False, False, True]
    assert asm.pending() == 0 and asm.pending("a") == 0
    # the next step opens a new episode
    asm.add_transition("a", step(3))
    assert asm.pending("a") == 1


@pytest.mark.parametrize(
    "flag",
    [True, np.bool_(True), torch.tensor(True), torch.tensor([True]), np.array([1]), 1],
    ids=["bool", "np.bool_", "tensor0d", "tensor1", "ndarray1", "int"],
)
def test_done_value_types(flag: Any) -> None:
    asm = EpisodeAssembler(postprocess_fn=lambda ep: {"obs": torch.stack(ep["obs"])})
    assert asm.add_transition("a", step(0)) == []
    assert len(asm.add_transition("a", step(1, truncated=flag))) == 1


@pytest.mark.parametrize(
    "flag", [False, np.bool_(False), torch.tensor(False), torch.tensor([0]), None]
)
def test_false_done_values_do_not_end(flag: Any) -> None:
    asm = EpisodeAssembler(postprocess_fn=lambda ep: {"obs": torch.stack(ep["obs"])})
    assert asm.add_transition("a", step(0, terminated=flag)) == []
    assert asm.pending("a") == 1


def test_done_flag_with_several_elements_is_refused_and_state_kept() -> None:
    asm = EpisodeAssembler()
    asm.add_transition("a", step(0))
    with pytest.raises(SchemaError, match=r"'a'.*terminated.*num_envs"):
        asm.add_transition("a", step(1, terminated=torch.tensor([True, False])))
    assert asm.pending("a") == 1


def test_custom_done_keys() -> None:
    asm = EpisodeAssembler(done_keys=("done",))
    assert asm.add_transition("a", {"x": 1.0, "terminated": True, "done": False}) == []
    [ep] = asm.add_transition("a", {"x": 2.0, "terminated": False, "done": True})
    assert ep.data["x"].tolist() == [1.0, 2.0]


def test_without_auto_truncate_done_flags_are_ignored() -> None:
    asm = EpisodeAssembler(auto_truncate=False)
    assert asm.add_transition("a", step(0, terminated=True)) == []
    assert asm.add_transition("a", step(1)) == []
    [ep] = asm.end_episode("a")
    assert ep.length == 2


# -- manual truncation ---------------------------------------------------------------------------


def test_end_episode_is_idempotent() -> None:
    """Seed regression: a second truncate of the same env raised KeyError."""
    asm = EpisodeAssembler()
    asm.add_transition("a", step(0))
    asm.add_transition("a", step(1))
    [ep] = asm.end_episode("a")
    assert ep.length == 2
    assert asm.end_episode("a") == []
    assert asm.end_episode("never-seen") == []


def test_end_all_and_clear_and_pending() -> None:
    asm = EpisodeAssembler()
    for t in range(3):
        asm.add_transition("a", step(t))
    asm.add_transition("b", step(0))
    assert asm.pending() == 4 and asm.pending("a") == 3 and asm.pending("b") == 1
    episodes = asm.end_all()
    assert [(e.env_id, e.length) for e in episodes] == [("a", 3), ("b", 1)]
    assert asm.pending() == 0 and asm.end_all() == []
    asm.add_transition("a", step(0))
    asm.clear()
    assert asm.pending() == 0 and asm.end_episode("a") == []


# -- vector envs ---------------------------------------------------------------------------------


def test_vector_env_auto_truncate_splits_per_sub_env() -> None:
    asm = EpisodeAssembler(num_envs={"vec": 2})
    assert asm.add_transition("vec", vstep(0, 2, [False, False])) == []
    [ep1] = asm.add_transition("vec", vstep(1, 2, [False, True]))
    # sub-env 1 finished, sub-env 0 continues
    assert ep1.env_id == "vec/1" and ep1.length == 2 and ep1.num_sub_episodes == 1
    assert ep1.data["obs"].squeeze(-1).tolist() == [100.0, 101.0]
    assert ep1.data["terminated"].tolist() == [False, True]
    assert asm.pending("vec/0") == 2 and asm.pending("vec/1") == 0 and asm.pending("vec") == 2

    [ep0] = asm.add_transition("vec", vstep(2, 2, [True, False]))
    assert ep0.env_id == "vec/0" and ep0.data["obs"].squeeze(-1).tolist() == [0.0, 1.0, 2.0]
    assert asm.pending("vec/1") == 1  # sub-env 1's new episode

    both = asm.add_transition("vec", vstep(3, 2, [True, True]))
    assert [e.env_id for e in both] == ["vec/0", "vec/1"]


def test_vector_env_end_episode_ends_all_sub_envs_or_one() -> None:
    asm = EpisodeAssembler(num_envs={"vec": 3})
    for t in range(2):
        asm.add_transition("vec", vstep(t, 3, [False] * 3))
    [one] = asm.end_episode("vec/2")
    assert one.env_id == "vec/2" and one.data["obs"].squeeze(-1).tolist() == [200.0, 201.0]
    rest = asm.end_episode("vec")
    assert [e.env_id for e in rest] == ["vec/0", "vec/1"]
    assert asm.end_episode("vec") == [] and asm.pending() == 0


def test_vector_env_without_auto_truncate_is_env_major() -> None:
    n, steps = 3, 4
    asm = EpisodeAssembler(num_envs={"vec": n}, auto_truncate=False)
    for t in range(steps):
        # a done flag does not end a whole-vector episode
        assert asm.add_transition("vec", vstep(t, n, [t == 1] * n)) == []
    assert asm.pending("vec") == steps
    [ep] = asm.end_episode("vec")
    assert ep.num_sub_episodes == n and ep.length == steps and ep.env_id == "vec"
    assert ep.data.batch_size == torch.Size([n * steps])
    expected = [100.0 * e + t for e in range(n) for t in range(steps)]
    assert ep.data["obs"].squeeze(-1).tolist() == expected
    assert ep.data["terminated"].view(n, steps)[:, 1].all()


def test_vector_env_wrong_leading_dim_is_refused() -> None:
    asm = EpisodeAssembler(num_envs={"vec": 2})
    bad = {"obs": torch.zeros(3, 1), "terminated": torch.zeros(2, dtype=torch.bool)}
    with pytest.raises(SchemaError, match=r"'vec'.*num_envs=2.*obs"):
        asm.add_transition("vec", bad)
    asm2 = EpisodeAssembler(num_envs={"vec": 2}, auto_truncate=False)
    with pytest.raises(SchemaError, match=r"'vec'.*obs"):
        asm2.add_transition("vec", bad)
    assert asm.pending() == 0 and asm2.pending() == 0


def test_vector_split_shares_scalars_and_indexes_sequences() -> None:
    asm = EpisodeAssembler(num_envs=2)
    tr = {"obs": np.array([1.0, 2.0]), "k": 7, "seq": [10, 20], "terminated": [True, False]}
    [ep] = asm.add_transition("v", tr)
    assert ep.env_id == "v/0"
    assert ep.data["k"].tolist() == [7] and ep.data["seq"].tolist() == [10]


def test_int_num_envs_applies_to_every_env_and_unknown_ids_are_single() -> None:
    asm = EpisodeAssembler(num_envs=2)
    asm.add_transition("x", vstep(0, 2, [False, False]))
    asm.add_transition("y", vstep(0, 2, [False, False]))
    assert asm.pending("x") == 2 and asm.pending("y") == 2
    mapped = EpisodeAssembler(num_envs={"vec": 2})
    [ep] = mapped.add_transition("other", step(0, terminated=True))
    assert ep.env_id == "other" and ep.length == 1


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, {"a": 0}])
def test_bad_num_envs_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="num_envs"):
        EpisodeAssembler(num_envs=bad)


# -- postprocessing ------------------------------------------------------------------------------


def test_custom_postprocess_gets_lists_and_may_return_numpy() -> None:
    seen: list[dict[str, list[Any]]] = []

    def post(ep: dict[str, list[Any]]) -> dict[str, Any]:
        seen.append(ep)
        return {"r": np.asarray(ep["reward"], dtype=np.float32) * 2, "n": {"t": list(range(3))}}

    asm = EpisodeAssembler(postprocess_fn=post, device="cpu")
    for t in range(2):
        asm.add_transition("a", step(t))
    [ep] = asm.add_transition("a", step(2, terminated=True))
    assert set(seen[0]) == {"obs", "reward", "terminated", "truncated"}
    assert seen[0]["reward"] == [0.0, 1.0, 2.0]
    assert ep.data["r"].dtype == torch.float32 and ep.data["r"].tolist() == [0.0, 2.0, 4.0]
    assert ep.data["n", "t"].tolist() == [0, 1, 2]
    assert ep.data.device == torch.device("cpu")


def test_zero_length_episode_warns_and_is_dropped() -> None:
    """Seed regression: a zero-length episode crashed the registry."""
    asm = EpisodeAssembler(postprocess_fn=lambda ep: {"obs": torch.stack(ep["obs"])[:-1]})
    with pytest.warns(RuntimeWarning, match=r"env 'a'.*dropped"):
        assert asm.add_transition("a", step(0, terminated=True)) == []
    assert asm.pending("a") == 0
    asm.add_transition("b", step(0))
    with pytest.warns(RuntimeWarning, match="env 'b'"):
        assert asm.end_episode("b") == []
    assert asm.pending() == 0


def test_postprocess_with_uneven_lengths_is_refused_and_state_kept() -> None:
    asm = EpisodeAssembler(
        postprocess_fn=lambda ep: {"a": torch.zeros(len(ep["obs"])), "b": torch.zeros(1)}
    )
    asm.add_transition("e", step(0))
    with pytest.raises(SchemaError, match=r"'e'.*leading"):
        asm.add_transition("e", step(1, terminated=True))
    assert asm.pending("e") == 1  # the failed step was not kept, the earlier one was


def test_postprocess_error_in_end_all_keeps_every_episode() -> None:
    def post(ep: dict[str, list[Any]]) -> dict[str, Any]:
        if len(ep["obs"]) == 2:
            raise RuntimeError("boom")
        return stack_episode(ep)

    asm = EpisodeAssembler(postprocess_fn=post)
    asm.add_transition("a", step(0))
    asm.add_transition("b", step(0))
    asm.add_transition("b", step(1))
    with pytest.raises(RuntimeError, match="boom"):
        asm.end_all()
    assert asm.pending("a") == 1 and asm.pending("b") == 2


def test_non_numeric_values_under_default_stacking_name_the_key() -> None:
    asm = EpisodeAssembler()
    with pytest.raises(SchemaError, match="env_id"):
        asm.add_transition("a", {**step(0, terminated=True), "env_id": "a"})
    assert asm.pending() == 0


def test_nested_mappings_become_nested_keys() -> None:
    asm = EpisodeAssembler()
    tr = {"obs": {"img": torch.zeros(2, 2), "state": np.ones(3)}, "terminated": False}
    asm.add_transition("a", tr)
    [ep] = asm.add_transition("a", {**tr, "terminated": True})
    assert ep.data["obs", "img"].shape == (2, 2, 2)
    assert ep.data["obs", "state"].shape == (2, 3)


def test_read_only_numpy_arrays_are_fine() -> None:
    arr = np.arange(3.0)
    arr.flags.writeable = False
    asm = EpisodeAssembler(postprocess_fn=lambda ep: {"x": arr})
    [ep] = asm.add_transition("a", step(0, terminated=True))
    assert ep.data["x"].tolist() == [0.0, 1.0, 2.0]


# -- schema and aliasing -------------------------------------------------------------------------


def test_mismatched_key_set_is_refused() -> None:
    asm = EpisodeAssembler()
    asm.add_transition("a", step(0))
    extra = {**step(1), "extra": 1.0}
    with pytest.raises(SchemaError, match=r"'a'.*extra"):
        asm.add_transition("a", extra)
    missing = step(1)
    del missing["reward"]
    with pytest.raises(SchemaError, match=r"'a'.*reward"):
        asm.add_transition("a", missing)
    nested = {**step(1), "obs": {"x": torch.zeros(2)}}
    with pytest.raises(SchemaError, match=r"obs\.x"):
        asm.add_transition("a", nested)
    assert asm.pending("a") == 1
    # another env, or a new episode, may have other keys
    asm.add_transition("b", extra)
    asm.end_episode("a")
    asm.add_transition("a", extra)


def test_mismatched_key_set_in_sub_env_names_sub_env() -> None:
    asm = EpisodeAssembler(num_envs={"vec": 2})
    asm.add_transition("vec", vstep(0, 2, [False, False]))
    with pytest.raises(SchemaError, match=r"'vec/0'"):
        asm.add_transition("vec", {**vstep(1, 2, [False, False]), "x": torch.zeros(2)})


def test_caller_dicts_are_not_aliased() -> None:
    asm = EpisodeAssembler()
    tr: dict[str, Any] = {"obs": {"x": torch.zeros(1)}, "r": 1.0, "terminated": False}
    asm.add_transition("a", tr)
    tr["r"] = 99.0
    tr["obs"]["x"] = torch.ones(1)
    tr["new"] = 5
    [ep] = asm.add_transition("a", {"obs": {"x": torch.zeros(1)}, "r": 2.0, "terminated": True})
    assert ep.data["r"].tolist() == [1.0, 2.0]
    assert ep.data["obs", "x"].sum().item() == 0.0


def test_bad_arguments() -> None:
    asm = EpisodeAssembler()
    with pytest.raises(TypeError):
        asm.add_transition("a", [1, 2])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        asm.add_transition(3, step(0))  # type: ignore[arg-type]
    with pytest.raises(SchemaError, match="empty"):
        asm.add_transition("a", {})
    with pytest.raises(TypeError):
        EpisodeAssembler(done_keys="done")
