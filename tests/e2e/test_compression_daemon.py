"""Compressed columns through a real daemon: a Writer compresses each episode, reserves its
chunks' bytes with its rows and copies them into ``bytes.bin``; a Reader copies the chunks its
rows name before the stamp check and decompresses after. Eviction by bytes, a writer lapping
a reader, the refusals (remote clients, ``out=``, --resume, checkpoints, a missing
--compressed-bytes) and ``status``."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from shmbuffer import Reader, Writer
from shmbuffer.errors import InvalidArgumentError, SchemaError, ShmBufferError
from tests.test_compression import check_rows, frames

pytest.importorskip("zstandard")
pytest.importorskip("lz4")

SCHEMA = """[schema]
obs = { dtype = "uint8", shape = [84, 84], compress = "zstd" }
step = { dtype = "int64", shape = [] }
"""


def start(daemon, e2e_env, nbytes: int = 1 << 20, capacity: int = 400, *extra: str):
    path = e2e_env.runtime_dir / "schema.toml"
    path.write_text(SCHEMA)
    args = ["--schema", str(path), "--compressed-bytes", str(nbytes), *extra]
    return daemon(capacity=capacity, unit="episode", args=args)


def episode(number: int, length: int) -> dict[str, torch.Tensor]:
    step = number * 1000 + np.arange(length, dtype=np.int64)
    return {"obs": torch.from_numpy(frames(number, length)), "step": torch.from_numpy(step)}


def test_writer_reader_round_trip_of_every_read(daemon, e2e_env):
    d = start(daemon, e2e_env)
    with Writer(d.name, timeout=5) as w:
        for i in range(6):
            w.add_episode(episode(i, 20 + i))
        w.flush()
    with Reader(d.name, timeout=5) as r:
        check_rows(r.sample(64))
        check_rows(r.sample_slices(8, 5))
        with r.sample_episodes(4) as eps:
            for ep in eps:
                check_rows(ep)
        with pytest.raises(InvalidArgumentError, match="'obs' is stored compressed"):
            out = {"obs": torch.zeros(200, 84, 84, dtype=torch.uint8)}
            with r.sample_episodes(2, out=out):
                pass
        rows, gens = r.committed_rows()
        data, moved = r.read(rows, gens)
        assert not moved.any()
        check_rows(data)
        stats = r.stats()["compressed"]
        assert stats["columns"] == {"obs": "zstd"} and stats["ratio"] > 10
        assert 0 < stats["used"] < stats["bytes"] == 1 << 20
        assert stats["decompressed_bytes"] > 0 and stats["decompress_s"] > 0
    status = e2e_env.cli("status", "--name", d.name, "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["compressed"]["ratio"] > 10
    status = e2e_env.cli("status", "--name", d.name)
    assert "compressed  obs (zstd):" in status.stdout and "raw/stored" in status.stdout


def test_eviction_by_bytes_keeps_rows_and_chunks_in_step(daemon, e2e_env):
    # Rows for 400 steps, bytes for a few episodes' chunks only: bytes evict first.
    import zstandard  # the chunk size is measured, not assumed

    one = len(zstandard.ZstdCompressor(level=3).compress(frames(0, 30).tobytes()))
    d = start(daemon, e2e_env, nbytes=one * 4 + one // 2)
    with Writer(d.name, timeout=5) as w:
        for i in range(12):
            w.add_episode(episode(i, 30))
        w.flush()
    stats = d.stats()
    assert stats["episodes"] <= 4 and stats["rows"] == 30 * stats["episodes"]
    assert stats["compressed"]["used"] <= stats["compressed"]["bytes"]
    with Reader(d.name, timeout=5) as r:
        batch = r.sample(128)
        check_rows(batch)
        assert set((batch["step"] // 1000).tolist()) <= set(range(12 - stats["episodes"], 12))
    # A chunk larger than the whole store is refused whole.
    with Writer(d.name, timeout=5) as w, pytest.raises(Exception, match="compressed bytes"):
        noisy = np.random.default_rng(0).integers(0, 255, (30, 84, 84), dtype=np.uint8)
        w.add_episode({"obs": torch.from_numpy(noisy), "step": torch.arange(30)})
        w.flush()


def test_a_writer_lapping_a_reader_never_yields_a_torn_chunk(daemon, e2e_env):
    import zstandard

    one = len(zstandard.ZstdCompressor(level=3).compress(frames(0, 10).tobytes()))
    d = start(daemon, e2e_env, nbytes=one * 6)  # the bytes lap far sooner than the rows
    stop = threading.Event()

    def writing() -> None:
        with Writer(d.name, timeout=5, commit_delay=0) as w:
            i = 0
            while not stop.is_set():
                w.add_episode(episode(i % 900, 10))
                i += 1

    with Writer(d.name, timeout=5) as w:
        for i in range(6):
            w.add_episode(episode(i, 10))
    thread = threading.Thread(target=writing, daemon=True)
    thread.start()
    try:
        with Reader(d.name, timeout=5, prefetch=False) as r:
            for _ in range(60):
                check_rows(r.sample(32))
                check_rows(r.sample_slices(4, 3))
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()


def test_refusals(daemon, e2e_env):
    d = start(daemon, e2e_env)
    remote = Writer(d.name, timeout=5, remote=True)
    with remote, pytest.raises(SchemaError, match="'obs' is stored compressed"):
        remote.add_episode(episode(0, 5))
    with Writer(d.name, timeout=5) as w:
        w.add_episode(episode(0, 5))
    with (
        Reader(d.name, timeout=5, remote=True) as r,
        pytest.raises(SchemaError, match="'obs' is stored compressed"),
    ):
        r.sample(4)
    admin = d.admin()
    try:
        with pytest.raises(ShmBufferError, match="'obs' is stored compressed"):
            admin.call("checkpoint", to=str(e2e_env.runtime_dir / "ckpt"))
    finally:
        admin.close()
    d.process.kill()  # its segment and journal left behind, as a crash leaves them
    d.process.wait(10)
    resumed = e2e_env.cli(
        "start", "--name", d.name, "--storage-dir", str(e2e_env.storage_dir), "--resume"
    )
    assert resumed.returncode != 0 and "stored compressed" in resumed.stderr
    no_bytes = e2e_env.cli(
        "start",
        "--name",
        "nobytes",
        "--unit",
        "episode",
        "--storage-dir",
        str(e2e_env.storage_dir),
        "--schema",
        str(Path(e2e_env.runtime_dir / "schema.toml")),
    )
    assert no_bytes.returncode != 0 and "--compressed-bytes" in no_bytes.stderr
