"""Large samples and copies into a caller's ``out`` through a real daemon.

``sample_episodes(32)`` of 400-step episodes, and samples of 12,800 rows whose stamps make a
reply header of 200 KiB (over the 64 KiB request cap, which replies do not have: the arrays
travel as packed bytes, docs/protocol.md, Framing); ``Reader.sample_episodes(n, out=)`` copies
locally under the lease, lets the lease go before the block starts (a writer may overwrite the
episodes at once) and remotely copies the frames into ``out``; a bad ``out`` names the key
before anything is asked of the daemon. Rows are small (f32[4] + i64): the ring is 1.2 MB.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from shmbuffer import Reader, Writer
from shmbuffer.errors import InvalidArgumentError
from shmbuffer.wire.protocol import MAX_HEADER_BYTES, decode_i64, encode

pytestmark = pytest.mark.timeout(60)

LENGTH = 400
RING = 40  # episodes


def _episode(index: int) -> dict[str, torch.Tensor]:
    steps = torch.arange(index * LENGTH, (index + 1) * LENGTH)
    return {"obs": steps[:, None].float().expand(LENGTH, 4).clone(), "step": steps}


def _whole(episode: TensorDict) -> None:
    """One whole episode of ``_episode``: consecutive steps from a multiple of LENGTH."""
    steps = episode["step"]
    assert steps.shape == (LENGTH,) and int(steps[0]) % LENGTH == 0
    assert torch.equal(steps - steps[0], torch.arange(LENGTH))
    assert torch.equal(episode["obs"], steps[:, None].float().expand(LENGTH, 4))


def _out(n: int = 32) -> TensorDict:
    return TensorDict(
        {"obs": torch.zeros(n, LENGTH, 4), "step": torch.zeros(n, LENGTH, dtype=torch.int64)},
        batch_size=[n, LENGTH],
    )


@pytest.fixture
def ring(daemon: Any) -> Any:
    d = daemon(capacity=RING * LENGTH, unit="episode")
    with Writer(d.name, timeout=10) as writer:
        for e in range(RING):
            writer.add_episode(_episode(e))
    return d


def test_samples_of_400_step_episodes_work_whatever_their_reply_header_size(ring: Any) -> None:
    with Reader(ring.name, timeout=10) as reader:
        with reader.sample_episodes(32) as episodes:  # zero-copy views under a lease
            assert len(episodes) == 32
            for episode in episodes:
                _whole(episode)
        rows = reader.sample(32 * LENGTH)
        assert rows["step"].shape == (32 * LENGTH,)
        assert torch.equal(rows["obs"][:, 3], rows["step"].float())
        slices = reader.sample_slices(32, LENGTH)
        for episode in slices.unbind(0):
            _whole(episode)
        # the reply that carried those 12,800 rows: a header over the request cap
        reply = reader.conn.call("sample", kind="rows", n=32 * LENGTH)
        assert len(decode_i64(reply["gens"])) == 32 * LENGTH
        assert len(encode(reply)) > 3 * MAX_HEADER_BYTES
        _refusals(reader)
    with Reader(ring.name, remote=True, timeout=10) as remote:
        with remote.sample_episodes(32) as episodes:
            for episode in episodes:
                _whole(episode)
        _refusals(remote)


def test_sample_episodes_into_out_copies_into_it_and_holds_no_lease(ring: Any) -> None:
    out = _out()
    pointers = (out["obs"].data_ptr(), out["step"].data_ptr())
    first = RING
    for remote in (False, True, False):
        reader = Reader(ring.name, remote=remote, timeout=10)
        with reader, reader.sample_episodes(32, out=out) as episodes:
            assert episodes.lease is None and episodes.valid()
            assert len(episodes) == 32
            for i, episode in enumerate(episodes):
                _whole(episode)
                assert episode["step"].data_ptr() == out["step"][i].data_ptr()
            assert (out["obs"].data_ptr(), out["step"].data_ptr()) == pointers
            kept = out["step"].clone()
            assert reader.stats()["leases"] == 0  # released before the block began
            # so a writer overwrites the whole ring now, without waiting for any lease,
            # and the copies stay as they were
            with Writer(ring.name, timeout=10, reserve_timeout=5) as writer:
                for e in range(first, first + RING):
                    writer.add_episode(_episode(e))
            first += RING
            assert torch.equal(out["step"], kept)


def _refusals(reader: Reader) -> None:
    """A bad ``out`` is refused naming the key before the request; too few rows after it."""
    reader.sample(1)  # the schema is known from here on
    served = reader.stats()["samples"]
    bad = _out()
    bad["step"] = torch.zeros(32, LENGTH, dtype=torch.int32)
    wide = {"obs": torch.zeros(32 * LENGTH, 5), "step": torch.zeros(32 * LENGTH)}
    short = _out(31)
    refusals = [
        (bad, r"out\['step'\].*int32.*int64"),
        (wide, r"out\['obs'\].*shape \[12800, 5\]"),
        (short, r"out holds 12400 rows .* hold 12800"),
    ]
    for out, message in refusals:
        with pytest.raises(InvalidArgumentError, match=message):  # noqa: SIM117
            with reader.sample_episodes(32, out=out):
                pytest.fail("the block must not start")
        if out is not short:
            assert reader.stats()["samples"] == served
    assert reader.stats()["samples"] == served + 1  # only the short one was drawn
    assert reader.stats()["leases"] == 0


@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
def test_read_copies_listed_rows_and_flags_those_a_writer_reached(ring: Any, remote: bool) -> None:
    """``Reader.read(rows, generations)``: the rows ``committed_rows`` listed, whole while their
    stamps hold; once a writer laps some, locally those are flagged, remotely the daemon refuses
    the read; bad input names the argument."""
    from shmbuffer.errors import TornReadError

    with Reader(ring.name, timeout=10, remote=remote) as reader:
        rows, gens = reader.committed_rows()
        assert sorted(rows.tolist()) == list(range(RING * LENGTH))
        at = np.searchsorted(rows, [0, 5, 3 * LENGTH + 7])
        data, moved = reader.read(rows[at], gens[at])
        # episode e fills rows e*LENGTH.. with steps e*LENGTH..: a row holds its own number
        assert data["step"].tolist() == [0, 5, 3 * LENGTH + 7] and not moved.any()
        with Writer(ring.name, timeout=10) as writer:
            writer.add_episode(_episode(RING))  # overwrites episode 0: rows 0..LENGTH-1
        if remote:
            with pytest.raises(TornReadError):
                reader.read(rows[at], gens[at])
        else:
            _, moved = reader.read(rows[at], gens[at])
            assert moved.tolist() == [True, True, False]
        with pytest.raises(InvalidArgumentError, match="rows"):
            reader.read([RING * LENGTH], [0])
        with pytest.raises(InvalidArgumentError, match="generations"):
            reader.read(rows[:2], gens[:1])
