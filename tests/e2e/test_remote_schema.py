"""Remote clients over tcp, the lazy schema set by the first writer, and a declared schema."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from shmbuffer import Reader, Writer
from shmbuffer.cli.demo_loops import check_episode, check_rows, make_episode
from shmbuffer.errors import EmptyBufferError, SchemaError

LENGTH = 20
OBS = (4, 8, 8)


def test_remote_clients_over_tcp(daemon):
    d = daemon(capacity=2000, unit="episode", args=["--endpoint", "tcp://127.0.0.1:0"])
    assert d.endpoint.startswith("tcp://127.0.0.1:")
    assert int(d.endpoint.rsplit(":", 1)[1]) > 0  # the bound port, not 0
    with Writer(d.name, remote=True, timeout=10) as w:
        assert w.segment is None
        for e in range(12):
            w.add_episode(make_episode(e % 3, e, LENGTH, OBS))
        w.flush()
        assert w.episodes_committed == 12
    with Reader(d.name, remote=True, timeout=10) as r:
        with r.sample_episodes(6) as eps:
            assert len(eps) == 6
            for ep in eps:
                assert ep["obs"].shape == (LENGTH, *OBS)
                check_episode(ep)
        rows = r.sample(64)
        assert rows.batch_size == torch.Size([64])
        check_rows(rows)
        slices = r.sample_slices(4, 8)
        assert slices.batch_size == torch.Size([4, 8])
        check_rows(slices.reshape(-1))
        for s in slices.unbind(0):  # consecutive steps of one episode
            assert (s["episode"] == s["episode"][0]).all()
            assert torch.equal(s["step"], s["step"][0] + torch.arange(8))
        assert r.segment is None  # nothing came through shared memory
    stats = d.stats()
    assert stats["episodes_committed"] == 12
    assert stats["rows_committed"] == 12 * LENGTH


def _column(d, key: str) -> np.ndarray:
    from shmbuffer.storage.segment import Segment

    seg = Segment.attach(d.name, storage_dir=d.storage_dir)
    try:
        return seg.columns[(key,)].numpy().copy()
    finally:
        seg.close()


def test_lazy_schema_first_writer_defines_it(daemon):
    d = daemon(capacity=500, unit="episode")
    assert d.stats()["schema"] is None
    with Reader(d.name) as r:
        with pytest.raises(EmptyBufferError):
            r.sample(4)
        assert r.segment is None
    early = Writer(d.name)  # connected before any schema exists
    first = Writer(d.name)
    try:
        first.add_episode(make_episode(0, 0, LENGTH, OBS))
        first.flush()
        schema = d.stats()["schema"]
        assert schema["obs"] == {"dtype": "uint8", "shape": list(OBS)}
        before = d.stats()
        obs_before = _column(d, "obs")

        good = make_episode(1, 0, LENGTH, OBS)
        bad_batches = {
            "obs": {**good, "obs": good["obs"].astype(np.float64)},  # dtype
            "obs ": {**good, "obs": good["obs"][:, :, :, :4].copy()},  # shape
            "extra": {**good, "extra": np.zeros(LENGTH, np.float32)},  # unknown key
            "reward": {k: v for k, v in good.items() if k != "reward"},  # missing key
        }
        second = Writer(d.name)
        try:
            for key, batch in bad_batches.items():
                with pytest.raises(SchemaError, match=key.strip()):
                    second.add_episode(batch)
        finally:
            second.close()
        # a writer that only learns of the schema when it writes: refused as a whole
        with pytest.raises(SchemaError, match="obs"):
            early.add_episode({**good, "obs": good["obs"].astype(np.float64)})
        after = d.stats()
        for k in ("rows", "episodes", "rows_committed", "episodes_committed", "pointer"):
            assert after[k] == before[k], k
        assert after["reservations"] == 0
        assert np.array_equal(_column(d, "obs"), obs_before)
        assert after["schema"] == schema
    finally:
        first.close()
        early.close()


SCHEMA_TOML = """\
obs = {dtype = "float32", shape = [8]}
reward = {dtype = "float32", shape = []}
done = {dtype = "bool", shape = []}
"""


def test_declared_schema_file(daemon, e2e_env, tmp_path):
    path = tmp_path / "schema.toml"
    path.write_text(SCHEMA_TOML)
    d = daemon(capacity=300, unit="transition", args=["--schema", str(path)])
    expected = {
        "obs": {"dtype": "float32", "shape": [8]},
        "reward": {"dtype": "float32", "shape": []},
        "done": {"dtype": "bool", "shape": []},
    }
    status = e2e_env.cli("status", "--name", d.name)
    assert status.returncode == 0, status.stderr
    assert "float32" in status.stdout and "obs" in status.stdout
    assert "lazy" not in status.stdout
    assert d.stats()["schema"] == expected
    assert (d.segment_path / "manifest.json").is_file()  # allocated before any write

    with Reader(d.name) as r:
        with pytest.raises(EmptyBufferError):
            r.sample(4)
        assert r.segment is not None  # attached though nothing was written
        assert r.segment.columns[("obs",)].shape == (300, 8)
        with Writer(d.name) as w:
            with pytest.raises(SchemaError, match="obs"):
                w.extend(
                    {
                        "obs": np.zeros((5, 4), np.float32),
                        "reward": np.zeros(5, np.float32),
                        "done": np.zeros(5, bool),
                    }
                )
            obs = np.arange(40, dtype=np.float32).reshape(5, 8)
            w.extend({"obs": obs, "reward": obs[:, 0].copy(), "done": np.zeros(5, bool)})
            w.flush()
        batch = r.sample(32)
        assert torch.equal(batch["obs"][:, 0], batch["reward"])
        assert torch.equal(batch["obs"][:, 7], batch["reward"] + 7)
    assert d.stats()["rows_committed"] == 5


def test_small_writes_share_a_reservation_and_keep_their_episodes(daemon):
    """Small episodes of unequal lengths are gathered and stored with one round trip; each is
    still its own episode, in order, and visible after flush (or after commit_delay)."""
    from shmbuffer import Reader, Writer
    from shmbuffer.cli.demo_loops import check_episode, make_episode

    d = daemon(capacity=10_000, unit="episode")
    with Writer(d.name, commit_delay=0.05) as w, Reader(d.name) as r:
        lengths = [5, 9, 3, 12, 7]
        for e, n in enumerate(lengths):
            w.add_episode(make_episode(0, e, n, (2, 2)))
        assert w._pipe.staged is not None and w._pipe.staged.rows == sum(
            lengths
        )  # nothing sent yet: they share one reservation
        deadline = time.monotonic() + 5  # the ticker stores them once commit_delay passes
        while r.stats()["episodes_committed"] < len(lengths) and time.monotonic() < deadline:
            time.sleep(0.02)
        stats = r.stats()
        assert stats["episodes_committed"] == len(lengths) and stats["rows"] == sum(lengths)
        with r.sample_episodes(50) as episodes:
            seen = set()
            for ep in episodes:
                check_episode(ep)
                seen.add((int(ep["episode"][0]), len(ep["step"])))
        assert seen <= set(enumerate(lengths)) and len(seen) >= 3
