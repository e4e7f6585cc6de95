"""``Storage(daemon=...)`` against a real daemon: its settings are the daemon's, and a setting
asked for that the daemon does not have is refused."""

from __future__ import annotations

import pytest
import torch

from shmbuffer import Reader
from shmbuffer.clients.storage import Storage


def _episode(length: int) -> dict[str, torch.Tensor]:
    return {"x": torch.arange(length, dtype=torch.float32), "t": torch.arange(length)}


def test_storage_refuses_a_daemon_configured_otherwise(daemon):
    """A million rows in episode unit asked of a 200-row transition-unit daemon is refused
    (it ran on silently with the daemon's settings, an INFO log only)."""
    d = daemon(capacity=200, unit="transition")
    with pytest.raises(ValueError) as info:
        Storage(capacity=10**6, unit="episode", daemon=d.name)
    message = str(info.value)
    assert "capacity: requested 1000000, daemon has 200" in message
    assert "unit: requested episode, daemon has transition" in message
    assert "mode:" not in message  # not asked for, so not compared
    assert "start the daemon with --capacity 1000000 --unit episode." in message
    with pytest.raises(ValueError, match="mode: requested fixed, daemon has circular"):
        Storage(200, "fixed", "transition", daemon=d.name)
    stats = d.stats()
    assert stats["writers"] == 0  # the refused Storages said bye: no Writer left connected
    assert stats["rows"] == 0  # and nothing was written


def test_storage_takes_or_matches_the_daemons_settings(daemon):
    d = daemon(capacity=200, unit="transition")
    with Storage(daemon=d.name) as s:  # nothing asked: whatever the daemon has
        assert (s.capacity, s.unit, s.mode) == (200, "transition", "circular")
        s.add_episode(_episode(5))
    with Storage(200, "circular", "transition", daemon=d.name) as s:  # the same: accepted
        s.add_episode(_episode(7))
        s.flush()
    with Reader(d.name, timeout=10) as r:
        assert r.sample(8)["x"].shape == (8,)
    stats = d.stats()
    assert (stats["rows"], stats["episodes"], stats["writers"]) == (12, 2, 0)
