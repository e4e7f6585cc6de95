"""TorchRL code that changes stored rows in place, over a ``DaemonStorage`` on a real daemon:
``rb[i] = x``, ``set_at_``/``set_``/``update_``, ``update_if_present`` with a writer that
tracks generations, ``TensorDictMaxValueWriter`` and ``ConsumingSampler``'s refills
(``write_at``). Each change reaches the daemon (another buffer over it reads it back), only
the rows named change, and what cannot be honoured is refused with nothing changed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("torchrl", reason="shmbuffer.torchrl needs the [torchrl] extra")

import torch
from tensordict import TensorDict
from torchrl.data import (
    ConsumingSampler,
    ReplayBuffer,
    TensorDictMaxValueWriter,
    TensorDictReplayBuffer,
    TensorDictRoundRobinWriter,
)

from shmbuffer.torchrl import DaemonStorage

pytestmark = pytest.mark.timeout(120)


def rows(first: int, n: int) -> TensorDict:
    obs = torch.arange(first, first + n, dtype=torch.float32)
    return TensorDict({"obs": obs, "pair": torch.stack([obs, -obs], 1)}, [n])


def buffer(name: str, **kwargs: Any) -> TensorDictReplayBuffer:
    return TensorDictReplayBuffer(storage=DaemonStorage(name), batch_size=4, **kwargs)


@contextlib.contextmanager
def opened(rb: Any) -> Iterator[Any]:
    """``rb``, its storage's clients closed at the end whatever happened."""
    try:
        yield rb
    finally:
        rb.storage.close()


def seen_elsewhere(name: str, key: str = "obs") -> list[float]:
    """The rows as a second buffer over the same daemon reads them."""
    with opened(buffer(name)) as other:
        return other[:][key].tolist()


def test_setitem_and_in_place_edits_reach_the_daemon(daemon: Any) -> None:
    name = daemon(capacity=8, unit="transition").name
    with opened(buffer(name)) as rb:
        rb.extend(rows(0, 6))
        rb[2] = TensorDict({"obs": torch.tensor(20.0), "pair": torch.tensor([1.0, 2.0])}, [])
        rb.set_at_("obs", torch.tensor([30.0, 40.0]), torch.tensor([3, 4]))
        assert seen_elsewhere(name) == [0.0, 1.0, 20.0, 30.0, 40.0, 5.0]
        rb.set_("pair", torch.full((6, 2), 7.0))
        rb.update_(TensorDict({"obs": torch.arange(6.0) * 10}, [6]))
        assert seen_elsewhere(name) == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0]
        assert seen_elsewhere(name, "pair") == [[7.0, 7.0]] * 6
        assert len(rb) == 6  # in place: no row was added


def test_set_writes_new_rows_at_the_pointer_and_changes_old_ones_at_once(daemon: Any) -> None:
    name = daemon(capacity=8, unit="transition").name
    with opened(buffer(name)) as rb:
        rb.extend(rows(0, 5))
        with pytest.raises(TypeError, match=r"row 5 next.*rows \[6\]"):
            rb.storage.set([1, 6], rows(200, 2))  # row 6 is not the ring's next row
        assert seen_elsewhere(name) == [0.0, 1.0, 2.0, 3.0, 4.0]  # nothing changed
        rb.storage.set([7, 1, 5, 6], rows(100, 4))  # rows 5, 6, 7 new; row 1 changed
        assert seen_elsewhere(name) == [0.0, 101.0, 2.0, 3.0, 4.0, 102.0, 103.0, 100.0]
        assert len(rb) == 8


def test_update_if_present_skips_records_a_writer_reached(daemon: Any) -> None:
    name = daemon(capacity=6, unit="transition").name
    with opened(buffer(name, writer=TensorDictRoundRobinWriter(track_generations=True))) as rb:
        index = rb.extend(rows(0, 6))
        generation = rb.writer.generations_of(index)
        rb.extend(rows(10, 2))  # rows 0 and 1 hold new records now
        result = rb.update_if_present(
            index=index, generation=generation, patch={"obs": torch.full((6,), -1.0)}
        )
        assert result.updated.tolist() == [False, False, True, True, True, True]
        assert seen_elsewhere(name) == [10.0, 11.0, -1.0, -1.0, -1.0, -1.0]
        again = rb.update_if_present(  # the handles still name the same records
            index=index[2:], generation=generation[2:], patch={"obs": torch.zeros(4)}
        )
        assert again.updated_count == 4
        with pytest.raises(KeyError):
            rb.update_if_present(index=index, generation=generation, patch={"nope": index})
        assert seen_elsewhere(name) == [10.0, 11.0, 0.0, 0.0, 0.0, 0.0]


def test_max_value_writer_keeps_the_best_rows(daemon: Any) -> None:
    name = daemon(capacity=5, unit="transition").name
    writer = TensorDictMaxValueWriter(rank_key="reward")
    rb = TensorDictReplayBuffer(storage=DaemonStorage(name), writer=writer, batch_size=5)
    with opened(rb):
        reward = torch.tensor([3.0, 9.0, 1.0, 7.0, 5.0, 8.0, 0.0, 6.0])
        rb.extend(TensorDict({"reward": reward, "obs": torch.arange(8.0)}, [8]))
        kept = sorted(seen_elsewhere(name, "reward"))
        assert kept == [5.0, 6.0, 7.0, 8.0, 9.0]


def test_consuming_sampler_refills_consumed_rows(daemon: Any) -> None:
    name = daemon(capacity=6, unit="transition").name
    rb = ReplayBuffer(storage=DaemonStorage(name), sampler=ConsumingSampler(), batch_size=3)
    with opened(rb):
        rb.extend(rows(0, 4))
        first = rb.sample()
        assert len(rb) == 1  # three of four consumed
        rb.extend(rows(100, 4))  # three refill the consumed rows, one goes to the pointer
        stored = seen_elsewhere(name)
        assert len(stored) == 5
        consumed = {float(v) for v in first["obs"]}
        assert set(stored) == ({0.0, 1.0, 2.0, 3.0} - consumed) | {100.0, 101.0, 102.0, 103.0}
