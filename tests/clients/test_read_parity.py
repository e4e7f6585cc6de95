"""The in-process Buffer and the daemon's Reader check a read's arguments by the same rules
(shmbuffer/reads.py): the same class and words for each bad argument, before anything is drawn
or sent."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from shmbuffer import Buffer
from shmbuffer.clients.reader import Reader
from shmbuffer.protocol import MAX_SAMPLE
from tests.clients.conftest import MakeDaemon

CAPACITY = 16


def refusal(call: Callable[[], object]) -> tuple[type[BaseException], str]:
    """The class and words of what ``call`` raises (the parity tests compare them)."""
    try:
        call()
    except Exception as exc:
        return type(exc), str(exc)
    raise AssertionError("nothing was refused")


def episodes(api: Any, n: int) -> None:
    """``sample_episodes(n)`` as each API hands them out (the Reader's is a block)."""
    if isinstance(api, Reader):
        with api.sample_episodes(n):
            pass
    else:
        api.sample_episodes(n)


CALLS: dict[str, Callable[[Any], object]] = {
    "strict not a bool": lambda api: api.sample_slices(2, 3, strict=1),
    "n=0 slices": lambda api: api.sample_slices(0, 3),
    "length=0": lambda api: api.sample_slices(2, 0),
    "n a float": lambda api: api.sample_slices(2.0, 3),
    "too many slices": lambda api: api.sample_slices(MAX_SAMPLE + 1, 1),
    "too many rows": lambda api: api.sample(MAX_SAMPLE + 1),
    "beta < 0": lambda api: api.sample(4, beta=-1.0),
    "n=0 episodes": lambda api: episodes(api, 0),
    "too many episodes": lambda api: episodes(api, MAX_SAMPLE + 1),
    "batch_size=0": lambda api: api.iterate(0),
    "rank < 0": lambda api: api.iterate(2, rank=-1, world_size=2),
    "rank = world_size": lambda api: api.iterate(2, rank=2, world_size=2),
    "world_size=0": lambda api: api.iterate(2, rank=0, world_size=0),
    "index out of range": lambda api: api.update_priorities([CAPACITY], [1.0]),
    "index negative": lambda api: api.update_priorities([-1], [1.0]),
    "priority count": lambda api: api.update_priorities([1, 2], [1.0, 2.0, 3.0]),
    "priority NaN": lambda api: api.update_priorities([1, 2], [1.0, float("nan")]),
    "generation count": lambda api: api.update_priorities([1, 2], [1.0, 2.0], [7]),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_bad_read_argument_is_refused_alike(fake: MakeDaemon, call: str) -> None:
    daemon = fake(capacity=CAPACITY, sampler="prioritized")
    buf = Buffer(CAPACITY, sampler="prioritized")
    with Reader("fake", prefetch=False) as reader:
        expected = refusal(lambda: CALLS[call](buf))
        assert refusal(lambda: CALLS[call](reader)) == expected
    assert [r.op for r in daemon.log if r.op in ("sample", "iterate", "update_priorities")] == []
