"""TorchRL pytree rows (lists and tuples of tensors inside mappings, int keys) through a real
daemon: stored as one column per leaf, rebuilt on read in every process
(``shmbuffer/torchrl/pytrees.py``)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torchrl", reason="shmbuffer.torchrl needs the [torchrl] extra")

import torch
from torch.utils._pytree import tree_flatten, tree_structure
from torchrl.data import ReplayBuffer

from shmbuffer.errors import SchemaError
from shmbuffer.torchrl import DaemonSampler, DaemonStorage, DaemonWriter

pytestmark = pytest.mark.timeout(120)


def tree(n: int, first: int = 0) -> dict[Any, Any]:
    ids = torch.arange(first, first + n)
    return {
        "a": ids[:, None],
        "b": {"c": [ids[:, None].float().expand(n, 3), (ids[:, None].double().expand(n, 2),)]},
        30: -ids[:, None],
    }


def test_pytree_rows_read_back_in_their_own_shape_in_every_process(daemon: Any) -> None:
    name = daemon(capacity=8, unit="transition", args=["--sampler", "prioritized"]).name
    rb = ReplayBuffer(storage=DaemonStorage(name), writer=DaemonWriter(), batch_size=3)
    other = DaemonStorage(name)  # another process's storage learns the shape from the schema
    try:
        rb.extend(tree(4))
        rb.add(
            {
                "a": torch.tensor([4]),
                "b": {"c": [torch.full((3,), 4.0), (torch.full((2,), 4.0, dtype=torch.float64),)]},
                30: torch.tensor([-4]),
            }
        )
        rb.extend(tree(1, 5))
        want = tree(6)
        got = other[:]
        assert tree_structure(got) == tree_structure(want)  # dicts, a list, a tuple, an int key
        for leaf, expected in zip(tree_flatten(got)[0], tree_flatten(want)[0], strict=True):
            assert leaf.dtype == expected.dtype and torch.equal(leaf, expected)
        row = other[2]
        assert row["b"]["c"][1][0].tolist() == [2.0, 2.0] and row[30].tolist() == [-2]
        rb.set_sampler(DaemonSampler())
        sample, info = rb.sample(return_info=True)
        assert torch.equal(sample[30], -sample["a"]) and isinstance(sample["b"]["c"][1], tuple)
        assert torch.equal(sample["a"][:, 0], torch.as_tensor(info["index"]))
        # A list of pytree rows is stacked leaf by leaf.
        rb.extend(
            [
                {
                    "a": torch.tensor([7]),
                    "b": {
                        "c": [torch.full((3,), 7.0), (torch.full((2,), 7.0, dtype=torch.float64),)]
                    },
                    30: torch.tensor([-7]),
                }
            ]
        )
        assert other[6]["b"]["c"][0].tolist() == [7.0, 7.0, 7.0]
        # Another shape of tree is another schema: refused, naming the keys.
        with pytest.raises(SchemaError, match="missing keys"):
            rb.extend({"a": torch.zeros(2, 1, dtype=torch.long), "b": {"c": [torch.zeros(2, 3)]}})
        with pytest.raises(SchemaError, match=r"key 'b\.c': an empty list"):
            rb.extend({"a": torch.zeros(2, 1), "b": {"c": []}})
    finally:
        rb.storage.close()
        other.close()


def test_rows_that_are_tuples_and_lists_read_back_as_such(daemon: Any) -> None:
    """TorchRL's ``extend`` of a list of tuple rows, and ``add`` of a list row."""
    rb = ReplayBuffer(storage=DaemonStorage(daemon(capacity=8, unit="transition").name))
    other = ReplayBuffer(storage=DaemonStorage(daemon(capacity=8, unit="transition").name))
    try:
        rb.extend(
            [
                (torch.full((2,), i), {"a": torch.full((1,), -i)}, [torch.tensor(i)])
                for i in range(3)
            ]
        )
        got = rb.storage[:]
        assert isinstance(got, tuple) and got[0][:, 0].tolist() == [0, 1, 2]
        assert got[1]["a"][:, 0].tolist() == [0, -1, -2] and got[2][0].tolist() == [0, 1, 2]
        other.add([torch.ones(2), (torch.zeros(1),)])
        row = other.storage[0]
        assert isinstance(row, list) and isinstance(row[1], tuple) and row[0].tolist() == [1.0, 1.0]
        with pytest.raises(RuntimeError, match="Stacking the elements of the list"):
            rb.extend(
                [
                    (torch.zeros(2), {"a": torch.zeros(1)}, [torch.tensor(0)]),
                    (torch.zeros(3), {"a": torch.zeros(1)}, [torch.tensor(0)]),
                ]
            )
        assert len(rb) == 3
    finally:
        rb.storage.close()
        other.storage.close()
