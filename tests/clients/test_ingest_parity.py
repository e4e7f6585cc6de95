"""The in-process Buffer and the daemon's Writer take a write's priority by the same rules
(shmbuffer/api/writeplan.py): the same refusals, with the same words, before anything is stored or
sent; and the same per-item priorities for what a batch too large for the ring keeps."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import numpy as np
import pytest

from shmbuffer import Buffer
from shmbuffer.clients.writer import Writer
from shmbuffer.wire.protocol import decode_f64
from tests.clients.conftest import MakeDaemon


def batch(n: int) -> dict[str, np.ndarray]:
    return {"obs": np.zeros((n, 3), np.float32), "step": np.arange(n)}


def refusal(call: Callable[[], object]) -> tuple[type[BaseException], str]:
    """The class and words of what ``call`` raises (the parity tests compare them)."""
    try:
        call()
    except Exception as exc:
        return type(exc), str(exc)
    raise AssertionError("nothing was refused")


@pytest.mark.parametrize("sampler", ["uniform", "fifo"])
def test_a_priority_for_a_sampler_without_priorities_is_refused_alike(
    fake: MakeDaemon, sampler: str
) -> None:
    fake(sampler=sampler)
    buf = Buffer(16, sampler=sampler)
    with Writer("fake", batch_bytes=0) as writer:
        expected = refusal(lambda: buf.extend(batch(4), priority=1.0))
        assert refusal(lambda: writer.extend(batch(4), priority=1.0)) == expected
        assert "keeps no priorities" in expected[1]
    assert len(buf) == 0


@pytest.mark.parametrize(
    "priority",
    [[1.0, 2.0, 3.0], -1.0, [1.0, math.nan, 1.0, 1.0], [[1.0, 2.0], [3.0, 4.0]], "high"],
)
def test_a_bad_priority_is_refused_alike(fake: MakeDaemon, priority: object) -> None:
    daemon = fake(sampler="prioritized")
    buf = Buffer(16, sampler="prioritized")
    with Writer("fake", batch_bytes=0) as writer:
        kind, words = refusal(lambda: buf.extend(batch(4), priority=priority))
        got_kind, got_words = refusal(lambda: writer.extend(batch(4), priority=priority))
        # the same class and the same words up to the rule: the Buffer also knows its
        # sampler's largest priority, which the Writer leaves to the daemon
        assert got_kind is kind
        assert got_words.split(": priorities must")[0] == words.split(": priorities must")[0]
    assert len(buf) == 0 and daemon.ops("reserve") == []


def test_what_a_ring_keeps_of_a_batch_carries_the_same_priorities(fake: MakeDaemon) -> None:
    daemon = fake(capacity=9, sampler="prioritized")
    buf = Buffer(9, sampler="prioritized", priority_exponent=1.0, priority_eps=0.0)
    priority = np.arange(1.0, 13.0).reshape(4, 3)  # [L, num_envs], one per row
    episode = {"obs": np.zeros((4, 3, 3), np.float32), "step": np.zeros((4, 3), np.int64)}
    with Writer("fake", batch_bytes=0) as writer, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the trim's warning
        buf.add_episode(episode, num_envs=3, priority=priority)
        writer.add_episode(episode, num_envs=3, priority=priority)
        (reserve,) = daemon.ops("reserve")
    sent = decode_f64(reserve["priority"])
    # sub-envs 1 and 2 fit 9 rows: their rows, env-major
    np.testing.assert_array_equal(sent, [2, 5, 8, 11, 3, 6, 9, 12])
    stored = buf.sampler.stats()["priority_total"]
    assert stored == pytest.approx(sent.sum())
