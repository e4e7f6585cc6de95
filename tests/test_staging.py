"""Tests of the Writer's staging area (shmbuffer.clients.staging): order, copies, casts."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from shmbuffer.clients.staging import Staging
from shmbuffer.storage.schema import Schema

SCHEMA = Schema.from_batch(
    {"obs": np.zeros((1, 3), np.float32), "action": np.zeros(1, np.int32), "done": [False]}
)


def leaves(first: int, n: int) -> dict[Any, Any]:
    """Rows ``first..first+n`` of a stream whose row ``i`` holds ``i`` everywhere."""
    rows = np.arange(first, first + n)
    return {
        ("obs",): np.repeat(rows[:, None], 3, axis=1).astype(np.float64),  # cast on the way in
        ("action",): torch.as_tensor(rows, dtype=torch.int64),  # a CPU tensor: a numpy view
        ("done",): rows % 2 == 1,
    }


def stored(pieces: list[tuple[dict[Any, Any], int, int]]) -> dict[Any, np.ndarray]:
    """The rows the pieces hold, concatenated, as ``rows.write`` would store them."""
    return {
        key: np.concatenate([np.asarray(p[key][a : a + n]) for p, a, n in pieces])
        for key in pieces[0][0]
    }


def check(pieces: list[tuple[dict[Any, Any], int, int]], total: int) -> None:
    out = stored(pieces)
    want = np.arange(total)
    assert out[("obs",)].dtype == np.float32 and out[("action",)].dtype == np.int32
    np.testing.assert_array_equal(out[("obs",)], np.repeat(want[:, None], 3, axis=1))
    np.testing.assert_array_equal(out[("action",)], want)
    np.testing.assert_array_equal(out[("done",)], want % 2 == 1)


def test_writes_gather_into_one_run_in_the_columns_dtypes() -> None:
    area = Staging(SCHEMA, capacity=100)
    for first in range(0, 30, 10):
        area.add(leaves(first, 10), 0, 10)
    assert area.rows == 30
    pieces = area.take()
    assert len(pieces) == 1 and pieces[0][1:] == (0, 30)  # one store, not three
    check(pieces, 30)
    assert not area and area.rows == 0


def test_a_staged_write_is_a_copy_the_caller_may_reuse() -> None:
    area = Staging(SCHEMA, capacity=100)
    batch = leaves(0, 8)
    area.add(batch, 2, 6)  # rows 2..7 of the batch
    batch[("obs",)][:] = -1
    batch[("action",)].fill_(-1)
    out = stored(area.take())
    np.testing.assert_array_equal(out[("action",)], np.arange(2, 8))
    assert (out[("obs",)] >= 2).all()


def test_what_does_not_fit_is_kept_aside_in_order() -> None:
    area = Staging(SCHEMA, capacity=25)
    for first in range(0, 50, 10):  # the third write overflows the 25 preallocated rows
        area.add(leaves(first, 10), 0, 10)
    pieces = area.take()
    assert [p[2] for p in pieces] == [20, 10, 10, 10]
    check(pieces, 50)
    area.add(leaves(0, 10), 0, 10)  # the columns are free again after take
    assert len(area.take()) == 1


def test_bfloat16_columns_are_staged_as_copies() -> None:
    schema = Schema.from_batch({"x": torch.zeros(1, 2, dtype=torch.bfloat16)})
    area = Staging(schema, capacity=100)
    area.add({("x",): torch.full((4, 2), 1.5, dtype=torch.bfloat16)}, 1, 3)
    area.add({("x",): torch.full((4, 2), 2.5, dtype=torch.bfloat16)}, 0, 2)
    pieces = area.take()
    assert [p[2] for p in pieces] == [3, 2]
    values = torch.cat([p[("x",)][a : a + n] for p, a, n in pieces])
    assert values.dtype == torch.bfloat16
    assert values[:, 0].tolist() == [1.5] * 3 + [2.5] * 2
