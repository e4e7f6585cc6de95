"""The arithmetic of shmbuffer.cluster (no Ray, no daemon): how a batch is split across shards,
what a shard's mass is, how PER weights carry over to the union, and the daemon options."""

from __future__ import annotations

import numpy as np
import pytest

from shmbuffer.cluster.options import check_options, shard_name, start_flags
from shmbuffer.cluster.split import apportion, rescale_weights, shard_mass, smallest_weight
from tests._stats import P_MIN, chi2_p


def test_apportion_sums_to_n_within_one_of_the_quota() -> None:
    rng = np.random.default_rng(0)
    masses = [40.0, 80.0, 120.0, 0.0]
    for n in (1, 7, 32, 1000):
        for _ in range(50):
            counts = apportion(n, masses, rng)
            assert counts.sum() == n and counts[3] == 0
            quota = n * np.array(masses) / sum(masses)
            assert np.all(np.abs(counts - quota) < 1)


def test_apportion_is_unbiased_for_small_batches() -> None:
    # n=1: each shard picked with its share; over many calls the counts follow it
    rng = np.random.default_rng(1)
    masses = np.array([1.0, 2.0, 7.0])
    totals = np.zeros(3)
    for _ in range(4_000):
        totals += apportion(1, masses, rng)
    assert chi2_p(totals, 4_000 * masses / masses.sum()) > P_MIN
    # n=3 over shares .1/.2/.7: 0/0/2 floors and one extra item, drawn by the fractions
    totals = np.zeros(3)
    for _ in range(2_000):
        totals += apportion(3, masses, rng)
    np.testing.assert_allclose(totals / 2_000, 3 * masses / masses.sum(), atol=0.05)


def test_apportion_refuses_nothing_to_draw_from() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="every mass is 0"):
        apportion(4, [0.0, 0.0], rng)
    with pytest.raises(ValueError, match="finite and >= 0"):
        apportion(4, [1.0, float("nan")], rng)


def _stats(kind: str = "uniform", rows: int = 100, episodes: int = 10, **figures: float) -> dict:
    return {"rows": rows, "episodes": episodes, "sampler": {"kind": kind, "figures": figures}}


def test_shard_mass_by_sampler_and_kind() -> None:
    assert shard_mass(_stats(), "rows") == 100
    assert shard_mass(_stats(), "episodes") == 10
    assert shard_mass(_stats(), "slices", length=5) == 100 - 10 * 4
    assert shard_mass(_stats(rows=20, episodes=10), "slices", 5) == 0
    assert shard_mass(_stats(rows=20, episodes=10), "slices", 5, strict=False) == 10
    prioritized = _stats("prioritized", priority_total=12.5, weight_min=0.5)
    assert shard_mass(prioritized, "rows") == shard_mass(prioritized, "episodes") == 12.5
    assert smallest_weight(prioritized) == 0.5
    assert smallest_weight(_stats()) is None
    assert smallest_weight(_stats("prioritized", priority_total=0.0, weight_min=None)) is None


def test_rescaled_weights_are_one_sampler_over_the_union() -> None:
    # shard A: item weights (p+eps)^alpha of 1 and 2; shard B: 4 and 8. beta = 0.5.
    beta = 0.5
    a, b = np.array([1.0, 2.0]), np.array([4.0, 8.0])
    shard_a = (a / a.min()) ** -beta  # what each daemon reports: over its own minimum
    shard_b = (b / b.min()) ** -beta
    union = np.concatenate([a, b])
    want = (union / union.min()) ** -beta
    got = np.concatenate(
        [rescale_weights(shard_a, 1.0, 1.0, beta), rescale_weights(shard_b, 4.0, 1.0, beta)]
    )
    np.testing.assert_allclose(got, want)
    assert rescale_weights(shard_b, None, 1.0, beta) is shard_b  # unknown: left alone


def test_daemon_options_become_start_flags() -> None:
    options = check_options({"sampler": "prioritized", "seed": 5, "insecure_tcp_admin": True})
    assert start_flags(options, 2) == [
        "start",
        "--insecure-tcp-admin",
        "--sampler",
        "prioritized",
        "--seed",
        "7",  # seed + shard index: shards never draw alike
    ]
    assert start_flags({"log_level": "DEBUG"}, 0) == ["--log-level", "DEBUG", "start"]
    with pytest.raises(ValueError, match="'endpoint' cannot be given"):
        check_options({"endpoint": "tcp://0.0.0.0:5555"})
    with pytest.raises(ValueError, match="unknown daemon option 'samplr'"):
        check_options({"samplr": "fifo"})
    with pytest.raises(ValueError, match="'seed' must be an int"):
        check_options({"seed": 1.5})
    assert shard_name("replay", "0123456789abcdef") == "replay.0123456789ab"
