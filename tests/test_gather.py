"""The read-side copies: ``rows.gather_columns`` picks numpy's fastest gather per
column and copies runs of consecutive rows run by run, and ``Buffer.sample_episodes(out=)``
copies into a caller's reused tensors. Every path must give exactly what
``torch.index_select`` gives, for every dtype (bfloat16 and bool included) and nested keys."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from shmbuffer import Buffer
from shmbuffer.errors import InvalidArgumentError
from shmbuffer.storage import rows
from shmbuffer.storage.schema import Schema
from shmbuffer.storage.segment import LocalSegment

SPEC = {
    "obs": {"dtype": "float32", "shape": [64]},
    "img": {"dtype": "uint8", "shape": [2, 8, 8]},
    "nested": {"bits": {"dtype": "bfloat16", "shape": [3]}},
    "action": {"dtype": "int64", "shape": []},
    "done": {"dtype": "bool", "shape": []},
}


def _filled(capacity: int = 500) -> LocalSegment:
    segment = LocalSegment(Schema.from_spec(SPEC), capacity)
    gen = torch.Generator().manual_seed(0)
    for key, column in segment.columns.items():
        if column.dtype == torch.bool:
            column.copy_(torch.rand(column.shape, generator=gen) > 0.5)
        elif column.dtype.is_floating_point:
            column.copy_(torch.randn(column.shape, generator=gen))
        else:
            column.copy_(torch.randint(0, 200, column.shape, generator=gen))
        assert column.float().abs().sum() > 0, key
    return segment


def _expected(segment: LocalSegment, physical: np.ndarray) -> dict[Any, torch.Tensor]:
    index = torch.from_numpy(physical)
    return {k: torch.index_select(c, 0, index) for k, c in segment.columns.items()}


def _same(got: dict[Any, torch.Tensor], want: dict[Any, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype, key
        assert torch.equal(got[key], tensor), key


@pytest.mark.parametrize("with_arrays", [True, False])
def test_gather_matches_index_select_for_every_dtype(with_arrays: bool) -> None:
    segment = _filled()
    physical = np.random.default_rng(1).integers(0, 500, 257)  # duplicates, any order
    arrays = segment.arrays if with_arrays else None
    _same(rows.gather_columns(segment.columns, physical, arrays), _expected(segment, physical))
    # an index list of another integer dtype is taken too
    small = physical.astype(np.int32)
    _same(rows.gather_columns(segment.columns, small, arrays), _expected(segment, physical))
    empty = rows.gather_columns(segment.columns, np.zeros(0, np.int64), arrays)
    assert all(t.shape[0] == 0 for t in empty.values())


def test_consecutive_runs_are_copied_exactly() -> None:
    segment = _filled()
    starts = np.array([300, 0, 40, 499, 40], dtype=np.int64)  # a repeat, a 1-row run at the end
    lengths = np.array([120, 7, 33, 1, 33], dtype=np.int64)
    physical = rows.episode_rows(starts, lengths)
    _same(
        rows.gather_columns(segment.columns, physical, segment.arrays), _expected(segment, physical)
    )
    whole = rows.read(segment.columns, np.arange(10, 90), segment.arrays)  # one range: a copy
    _same(
        dict(whole.flatten_keys(".").items()),
        {".".join(k): v for k, v in _expected(segment, np.arange(10, 90)).items()},
    )
    assert whole["obs"].data_ptr() != segment.columns[("obs",)][10].data_ptr()


def test_a_row_out_of_range_fails_before_anything_is_copied() -> None:
    segment = _filled(100)
    out, _, _ = rows.out_arrays(segment.schema, _out(segment.schema, 4))
    for bad in ([0, 100], [-1, 3]):
        for key in out:
            out[key][...] = 0
        with pytest.raises(IndexError, match=f"row {bad[-1] if bad[-1] == 100 else -1} "):
            rows.gather_columns(segment.columns, np.array(bad), segment.arrays, out=out)
        assert all(not a.any() for a in out.values())  # np.take's clip never got to clamp


def _out(schema: Schema, *lead: int) -> TensorDict:
    leaves = {f.key: torch.zeros((*lead, *f.shape), dtype=f.dtype) for f in schema}
    flat = TensorDict({}, batch_size=list(lead))
    for key, tensor in leaves.items():
        flat.set(key, tensor)
    return flat


# -- Buffer.sample_episodes(out=) ----------------------------------------------------------


def _episode(length: int, first: int) -> dict[str, Any]:
    steps = torch.arange(first, first + length)
    return {
        "obs": steps[:, None].float().expand(length, 64).clone(),
        "img": (steps % 251).to(torch.uint8)[:, None, None, None].expand(length, 2, 8, 8).clone(),
        "nested": {"bits": steps[:, None].to(torch.bfloat16).expand(length, 3).clone()},
        "action": steps,
        "done": steps == first + length - 1,
    }


def _buffer(lengths: list[int], **kw: Any) -> Buffer:
    buf = Buffer(2000, unit="episode", schema=SPEC, seed=3, **kw)
    first = 0
    for length in lengths:
        buf.extend(_episode(length, first))
        first += length
    return buf


def test_sample_episodes_into_out_reuses_its_memory_and_matches_a_fresh_copy() -> None:
    fresh, into = _buffer([50] * 8), _buffer([50] * 8)  # same seed: the same draws
    out = _out(fresh.schema, 6, 50)
    pointers = {k: out.get(k).data_ptr() for k in out.keys(include_nested=True, leaves_only=True)}
    for _ in range(4):
        want = fresh.sample_episodes(6)
        got = into.sample_episodes(6, out=out)
        assert isinstance(got, TensorDict) and got.batch_size == (6, 50)
        for key, ptr in pointers.items():
            assert got.get(key).data_ptr() == ptr, key  # the copy is in out, nothing fresh
            assert torch.equal(got.get(key), want.get(key)), key
        assert torch.equal(out["action"], want["action"])
        # an episode is whole and consecutive: its steps count up from its first
        steps = got["action"]
        assert (steps - steps[:, :1] == torch.arange(50)).all()
    assert np.array_equal(fresh.use_counts, into.use_counts)


def test_sample_episodes_of_different_lengths_into_a_flat_out() -> None:
    buf = _buffer([5, 40, 17, 60, 1])
    out = {
        "obs": torch.zeros(300, 64),
        "img": torch.zeros(300, 2, 8, 8, dtype=torch.uint8),
        "nested": {"bits": torch.zeros(300, 3, dtype=torch.bfloat16)},
        "action": torch.zeros(300, dtype=torch.int64),
        "done": torch.zeros(300, dtype=torch.bool),
        "extra": torch.ones(7),  # not in the schema: left alone
    }
    for _ in range(5):
        got = buf.sample_episodes(5, out=out)
        episodes = got if isinstance(got, list) else list(got.unbind(0))
        at = 0
        for ep in episodes:
            n = ep.batch_size[0]
            assert ep["obs"].data_ptr() == out["obs"][at].data_ptr()
            assert (ep["action"] - ep["action"][0] == torch.arange(n)).all()
            assert bool(ep["done"][-1]) and not ep["done"][:-1].any()
            assert torch.equal(ep["obs"][:, 0], ep["action"].float())
            assert torch.equal(ep["nested", "bits"][:, 1], ep["action"].to(torch.bfloat16))
            at += n
    assert torch.equal(out["extra"], torch.ones(7))


def test_an_out_that_does_not_fit_names_the_key_and_draws_nothing() -> None:
    buf = _buffer([10] * 4, sampler="fifo")
    schema = buf.schema
    assert schema is not None

    def out_with(key: str, tensor: Any) -> dict[str, Any]:
        out = _out(schema, 40).to_dict()
        out[key] = tensor
        return out

    bad = [
        (out_with("obs", torch.zeros(40, 63)), r"out\['obs'\].*shape \[40, 63\].*64"),
        (out_with("action", torch.zeros(40)), r"out\['action'\].*dtype torch.float32.*int64"),
        (out_with("obs", torch.zeros(64, 40).T), r"out\['obs'\].*not contiguous"),
        (out_with("obs", torch.zeros(40, 64, requires_grad=True)), r"out\['obs'\].*requires_grad"),
        (out_with("done", torch.zeros(39, dtype=torch.bool)), r"out\['done'\] holds 39 rows"),
        ({k: v for k, v in out_with("obs", None).items() if k != "obs"}, "key 'obs'"),
        (out_with("nested", {}), "key 'nested.bits'"),
        ([torch.zeros(3)], "TensorDict or a dict of tensors, got list"),
    ]
    for out, message in bad:
        with pytest.raises(InvalidArgumentError, match=message):
            buf.sample_episodes(2, out=out)
    # nothing was drawn: the FIFO sampler still hands out the oldest episodes first
    assert (buf.use_counts[:40] == 0).all()
    got = buf.sample_episodes(2, out=_out(schema, 20))
    assert got["action"][:, 0].tolist() == [0, 10]


def test_an_out_with_too_few_rows_says_how_many_the_draw_needs() -> None:
    buf = _buffer([30, 30])
    assert buf.schema is not None
    with pytest.raises(
        InvalidArgumentError, match=r"out holds 50 rows .* hold 60 \(the longest 30"
    ):
        buf.sample_episodes(2, out=_out(buf.schema, 50))


def test_slices_and_episode_indexing_copy_whole_runs() -> None:
    buf = _buffer([40, 25, 60])
    slices = buf.sample_slices(16, 10)
    assert (slices["action"] - slices["action"][:, :1] == torch.arange(10)).all()
    assert torch.equal(slices["obs"][..., 5], slices["action"].float())
    episodes = buf[[2, 0]]
    assert [ep.batch_size[0] for ep in episodes] == [60, 40]
    assert episodes[0]["action"][0] == 65 and episodes[1]["action"][-1] == 39
