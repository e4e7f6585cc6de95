"""``Reader(prefetch=k)`` through a real daemon: one sample request per ``k`` batches, each
batch whole and right (its rows, stamps and info line up), a change of request dropping what
was fetched, slices cut per slice, and prefetch never used where samples consume."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from shmbuffer import Reader, Writer

pytestmark = pytest.mark.timeout(60)


def _requests(reader: Reader) -> int:
    return int(reader.stats()["samples"])  # after what this connection sent before it


def test_one_request_draws_k_batches_and_each_is_whole(daemon: Any) -> None:
    d = daemon(capacity=512, unit="transition", args=["--sampler", "prioritized", "--seed", "1"])
    with Writer(d.name) as writer:
        writer.extend({"id": torch.arange(512)})  # row i holds id i
    with Reader(d.name, prefetch=4) as reader:
        assert reader.prefetch == 4
        before = _requests(reader)
        seen = []
        for _ in range(12):
            batch, info = reader.sample(64, return_info=True)
            assert batch.batch_size == torch.Size([64])
            assert (batch["id"] == info["index"]).all(), "a batch's rows and its info differ"
            for name in ("generation", "probability", "weight"):
                assert info[name].shape == (64,), name
            seen.append(info["index"])
        # 12 batches: 3 requests of 4 batches, and the next 4 asked for ahead
        assert _requests(reader) - before == 4
        drawn = torch.cat(seen)
        assert len(torch.unique(drawn)) > 400, "batches of one request repeat each other"
        # what it hands out updates priorities like any sample
        assert reader.update_priorities(info["index"], np.full(64, 5.0), info["generation"]) == 64


def test_a_different_request_drops_what_was_fetched(daemon: Any) -> None:
    d = daemon(capacity=256, unit="transition")
    with Writer(d.name) as writer:
        writer.extend({"id": torch.arange(256)})
    with Reader(d.name, prefetch=3, local_draws=False) as reader:  # the daemon's draws
        assert reader.sample(8).batch_size == torch.Size([8])
        assert reader.sample(5).batch_size == torch.Size([5])  # not a piece of the 8s
        assert reader.sample(8).batch_size == torch.Size([8])
        batch, info = reader.sample(8, return_info=True)  # info asked now: fetched anew
        assert (batch["id"] == info["index"]).all()


def test_slices_are_cut_per_slice(daemon: Any) -> None:
    d = daemon(capacity=256, unit="episode", args=["--seed", "2"])
    with Writer(d.name) as writer:
        for ep, length in enumerate([20, 30, 3, 40]):
            writer.add_episode({"ep": torch.full((length,), ep), "step": torch.arange(length)})
    with Reader(d.name, prefetch=4) as reader:
        for strict in (True, False):
            for _ in range(6):
                s = reader.sample_slices(16, 5, strict=strict)
                assert s.batch_size == torch.Size([16, 5])
                ep, step = s["ep"], s["step"]
                if strict:
                    assert (ep == ep[:, :1]).all(), "a slice crossed an episode end"
                    assert (step == step[:, :1] + torch.arange(5)).all()
                else:
                    mask = s["mask"]
                    real = mask.sum(dim=1)
                    assert (mask == (torch.arange(5) < real[:, None])).all()
                    assert ((ep[:, 0] == 2) == (real == 3)).all(), "lengths cut wrongly"


def test_prefetch_values(daemon: Any) -> None:
    d = daemon(capacity=64, unit="transition", args=["--sampler", "fifo"])
    with Reader(d.name, prefetch=8) as reader:
        assert reader.prefetch == 0, "a consume-once sampler must never be sampled ahead"
    with pytest.raises(ValueError, match="prefetch"):
        Reader(d.name, prefetch=-1)
    with pytest.raises(TypeError, match="prefetch"):
        Reader(d.name, prefetch="4")


def test_a_fetched_batch_overwritten_meanwhile_is_redrawn_and_prefetch_backs_off(
    daemon: Any,
) -> None:
    d = daemon(capacity=64, unit="transition")
    # prefetch is a daemon draw's: a reader drawing itself draws fresh rows every call
    with Writer(d.name) as writer, Reader(d.name, prefetch=4, local_draws=False) as reader:
        writer.extend({"id": torch.arange(64)})
        writer.flush()
        assert (reader.sample(16)["id"] < 64).all()  # 3 more batches of these rows wait
        writer.extend({"id": torch.arange(100, 164)})  # the whole ring, overwritten
        writer.flush()
        batch = reader.sample(16)
        assert (batch["id"] >= 100).all(), "a batch fetched before the overwrite was torn"
        assert reader.resamples > 0
        before = _requests(reader)
        for _ in range(4):
            assert (reader.sample(16)["id"] >= 100).all()
        # after a stale batch, one batch per request: the 4 fetched ahead of it are dropped
        # (older still), then each call takes one and asks for the next
        assert _requests(reader) - before == 5
