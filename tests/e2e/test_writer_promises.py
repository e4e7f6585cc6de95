"""What a Writer's returned call promises, through a real daemon: a write that returned is
stored (or its own call raised), a refused first batch leaves the lazy schema open, and the
``episodes_committed`` counter counts episodes, not the registry entries a wrap splits them
into."""

from __future__ import annotations

import numpy as np
import pytest

from shmbuffer import Writer
from shmbuffer.errors import CapacityError, LimitExceededError, SchemaError

LENGTH = 30


def _episode(writer: int, episode: int, length: int = LENGTH) -> dict[str, np.ndarray]:
    return {
        "obs": np.full((length, 4), episode, dtype=np.float32),
        "writer": np.full(length, writer, dtype=np.int64),
        "episode": np.full(length, episode, dtype=np.int64),
    }


@pytest.mark.parametrize("unit", ["transition", "episode"])
def test_fixed_mode_a_write_that_returned_is_stored(daemon, unit):
    """Two writers of small episodes fill a fixed buffer: every ``add_episode`` that returned
    is stored, and the first that does not fit raises in its own call."""
    capacity = 1000
    d = daemon(capacity=capacity, unit=unit, args=["--mode", "fixed"])
    writers = [Writer(d.name, timeout=10), Writer(d.name, timeout=10)]
    returned = [0, 0]
    refused = [False, False]
    try:
        episode = 0
        while not all(refused):
            for i, w in enumerate(writers):
                if refused[i]:
                    continue
                try:
                    w.add_episode(_episode(i, episode))
                except CapacityError:
                    refused[i] = True
                    continue
                returned[i] += 1
                episode += 1
        for w in writers:
            w.flush()  # nothing of what returned is left to fail here
    finally:
        for w in writers:
            w.close()
    stats = d.stats()
    assert stats["rows_committed"] == LENGTH * sum(returned)
    assert stats["episodes_committed"] == sum(returned)
    # Every row that could hold a whole episode does: the first refusal came when less than
    # one episode's rows were left.
    assert sum(returned) == capacity // LENGTH


def test_a_refused_first_batch_leaves_the_lazy_schema_open(daemon):
    d = daemon(capacity=100, unit="transition")
    with Writer(d.name, timeout=10) as w:
        with pytest.raises(SchemaError, match="batch dims"):
            w.extend({"a": np.zeros((5, 1)), "b": np.zeros((3, 2))})
        assert d.stats()["schema"] is None
        w.extend({"x": np.arange(4, dtype=np.float32)})
        w.flush()
    stats = d.stats()
    assert stats["rows_committed"] == 4
    assert list(stats["schema"]) == ["x"]


def test_a_first_batch_too_large_for_a_fixed_buffer_leaves_the_schema_open(daemon):
    d = daemon(capacity=10, unit="transition", args=["--mode", "fixed"])
    with Writer(d.name, timeout=10) as w:
        with pytest.raises(CapacityError):
            w.extend({"a": np.zeros((15, 2), dtype=np.float32)})
        assert d.stats()["schema"] is None
        w.extend({"x": np.arange(4, dtype=np.float32)})
    assert list(d.stats()["schema"]) == ["x"]


def test_a_remote_writers_refused_first_batch_leaves_the_schema_open(daemon):
    d = daemon(capacity=100, unit="transition")
    with Writer(d.name, remote=True, timeout=10) as w:
        with pytest.raises(SchemaError, match="batch dims"):
            w.extend({"a": np.zeros((5, 1)), "b": np.zeros((3, 2))})
        assert d.stats()["schema"] is None
        w.extend({"x": np.arange(4, dtype=np.float32)})
    assert list(d.stats()["schema"]) == ["x"]


def test_a_remote_first_batch_over_the_payload_limit_leaves_the_schema_open(daemon, tmp_path):
    config = tmp_path / "daemon.toml"
    config.write_text("max_payload_bytes = 4096\n")
    d = daemon(capacity=1000, unit="transition", args=["--config", str(config)])
    with Writer(d.name, remote=True, timeout=10) as w:
        with pytest.raises(LimitExceededError, match="max_payload_bytes"):
            w.extend({"a": np.zeros((100, 16), dtype=np.float32)})  # 6,400 bytes
        assert d.stats()["schema"] is None
        w.extend({"x": np.arange(4, dtype=np.float32)})
    assert list(d.stats()["schema"]) == ["x"]


@pytest.mark.parametrize("remote", [False, True])
def test_episodes_committed_counts_an_episode_the_ring_wrapped_once(daemon, remote):
    """Three 10-step episodes into 25 rows: 4 registry entries (the third wraps), and the
    counter says 3, in the daemon and in the Writer."""
    d = daemon(capacity=25, unit="transition")
    with Writer(d.name, remote=remote, timeout=10) as w:
        for e in range(3):
            w.add_episode(_episode(0, e, 10))
        w.flush()
        assert w.episodes_committed == 3
    stats = d.stats()
    assert stats["episodes"] == 4  # the entries, as the README says
    assert stats["episodes_committed"] == 3


def test_episodes_committed_counts_a_gathered_episode_the_ring_wrapped(daemon):
    """Small episodes gathered into one reservation, one of them across the ring's end."""
    d = daemon(capacity=100, unit="transition")
    with Writer(d.name, timeout=10) as w:  # gathers two 7-step episodes per reservation
        for e in range(16):  # the eighth reservation, rows 98-112, wraps inside an episode
            w.add_episode(_episode(0, e, 7))
        w.flush()
        assert w.episodes_committed == 16
    assert d.stats()["episodes_committed"] == 16
