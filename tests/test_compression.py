"""Compressed columns in process: a column declared ``compress = "zstd"`` (or ``"lz4"``) is
stored one chunk per episode in a byte store beside the rows (``storage/packed.py``), counted
in rows and in bytes (``ring/packing.py``), and read back decompressed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shmbuffer import Buffer
from shmbuffer.daemon.state import Deferred
from shmbuffer.errors import CapacityError, InvalidArgumentError, SchemaError
from shmbuffer.storage import packed
from shmbuffer.storage.schema import Schema
from shmbuffer.wire.protocol import decode_i64, encode_i64
from tests.test_service import Harness

pytest.importorskip("zstandard")
pytest.importorskip("lz4")


def spec(codec: str = "zstd", **extra: object) -> dict[str, object]:
    return {
        "obs": {"dtype": "uint8", "shape": [84, 84], "compress": codec, **extra},
        "step": {"dtype": "int64", "shape": []},
    }


def frames(episode: int, length: int) -> np.ndarray:
    """Recorded-looking frames: a fixed background, a paddle and a ball that move."""
    obs = np.zeros((length, 84, 84), np.uint8)
    obs[:, :8, :] = 40 + episode % 7  # score bar
    obs[:, 8:12, :] = 142  # wall
    for t in range(length):
        x = (3 * t + episode) % 76
        obs[t, 78:80, x : x + 8] = 200  # paddle
        obs[t, 20 + (t * 5) % 50 : 22 + (t * 5) % 50, (x + 20) % 80 : (x + 20) % 80 + 2] = 255
    return obs


def write(buffer: Buffer, episode: int, length: int) -> None:
    step = episode * 1000 + np.arange(length, dtype=np.int64)
    buffer.add_episode({"obs": frames(episode, length), "step": step})


def expected(step: torch.Tensor) -> np.ndarray:
    """The frames the rows with these ``step`` values were written with."""
    return np.stack([frames(int(s) // 1000, 1000)[int(s) % 1000] for s in step.reshape(-1)])


def check_rows(batch: object) -> None:
    step, obs = batch["step"], batch["obs"]  # type: ignore[index]
    assert obs.dtype == torch.uint8 and obs.shape == (*step.shape, 84, 84)
    np.testing.assert_array_equal(obs.reshape(-1, 84, 84).numpy(), expected(step))


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_round_trip_sample_episodes_and_indexing(codec: str) -> None:
    with Buffer(200, unit="episode", schema=spec(codec), compressed_bytes=1 << 20, seed=1) as b:
        for episode in range(6):
            write(b, episode, 10 + episode)
        check_rows(b.sample(64))
        for ep in b.sample_episodes(4):
            check_rows(ep)
        check_rows(b[2])
        assert b[2]["obs"].shape == (12, 84, 84)
        stats = b.stats()["compressed"]
        raw = sum(10 + e for e in range(6)) * 84 * 84
        assert stats["ratio"] == pytest.approx(raw / stats["used"])
        assert stats["ratio"] > 10  # structured frames compress; random bytes would not
        assert stats["decompressed_bytes"] > 0 and stats["columns"] == {"obs": codec}


def test_rows_hold_chunk_references_not_frames() -> None:
    with Buffer(50, unit="episode", schema=spec(level=5), compressed_bytes=1 << 16) as b:
        write(b, 0, 5)
        assert b.segment is not None
        assert b.segment.columns[("obs",)].shape == (50, 3)  # 24 bytes a row, not 7056
        refs = b.segment.arrays[("obs",)][:5]
        assert (refs[:, packed.ROW] == np.arange(5)).all()
        assert len(set(refs[:, packed.OFFSET])) == 1  # one chunk for the episode


def test_eviction_by_bytes_agrees_with_the_rows() -> None:
    # Rows for 20 episodes of 10, bytes for far fewer: the byte store decides.
    with Buffer(200, unit="episode", schema=spec(), compressed_bytes=3000, seed=0) as b:
        for episode in range(30):
            write(b, episode, 10)
            assert b._packer is not None
            ring = b._packer.bytes
            assert ring.stored <= ring.capacity
            assert len(ring._live) == b.num_episodes  # an episode is live in both or neither
            assert {ep["step"][0].item() // 1000 for ep in b[:]} == set(
                range(episode - b.num_episodes + 1, episode + 1)
            )  # the oldest went first
        assert b.num_rows < 200  # evicted for bytes, not rows
        check_rows(b.sample(100))


def test_eviction_by_rows_frees_the_chunks() -> None:
    with Buffer(40, unit="episode", schema=spec(), compressed_bytes=1 << 20) as b:
        for episode in range(12):
            write(b, episode, 10)
        assert b.num_episodes == 4 and b._packer is not None
        assert len(b._packer.bytes._live) == 4
        check_rows(b.sample(32))


def test_an_episode_evicted_for_its_bytes_moves_its_stamps() -> None:
    # A reader that drew a row before its chunk's bytes were reused sees its stamp moved,
    # even though no writer was handed the row itself.
    with Buffer(1000, unit="episode", schema=spec(), compressed_bytes=2000) as b:
        write(b, 0, 10)
        assert b.segment is not None
        before = b.segment.generations[:10].copy()
        write(b, 1, 10)
        while b.num_episodes == 2 or 0 in {ep["step"][0].item() // 1000 for ep in b[:]}:
            write(b, 2, 10)
        assert (b.segment.generations[:10] > before).all()
        assert b.num_rows < 1000


def test_a_chunk_read_while_overwritten_is_refused() -> None:
    field = Schema.from_spec(spec())[("obs",)]
    compress, decompress = packed.codec(field)
    store = np.zeros(4096, np.uint8)
    chunk = compress(frames(0, 3).tobytes())
    store[: len(chunk)] = np.frombuffer(chunk, np.uint8)
    refs = np.array([[0, len(chunk), 1]], np.int64)
    out = packed.expand(field, decompress, refs, packed.fetch(refs, store), np.dtype(np.uint8))
    np.testing.assert_array_equal(out[0], frames(0, 3)[1])
    store[len(chunk) // 2 : len(chunk)] ^= 0x5A  # half rewritten by a later write
    with pytest.raises(InvalidArgumentError, match="'obs'"):
        packed.expand(field, decompress, refs, packed.fetch(refs, store), np.dtype(np.uint8))


def test_named_buffer_keeps_its_chunks_beside_the_rows(tmp_path: Path) -> None:
    options = {"compressed_bytes": 1 << 16, "name": "zrt", "storage_dir": tmp_path}
    with Buffer(30, unit="episode", schema=spec(), **options) as b:  # type: ignore[arg-type]
        write(b, 3, 7)
        assert b.segment is not None
        assert (b.segment.path / packed.STORE_FILE).stat().st_size == 1 << 16
        check_rows(b[0])


def test_schema_round_trip() -> None:
    schema = Schema.from_spec(spec("lz4", level=9))
    assert schema.to_spec()["obs"] == {
        "dtype": "uint8",
        "shape": [84, 84],
        "compress": "lz4",
        "level": 9,
    }
    assert Schema.from_spec(schema.to_spec()) == schema
    assert schema.row_nbytes == 24 + 8


@pytest.mark.parametrize(
    ("column", "match"),
    [
        ({"compress": "gzip"}, "compress='gzip'"),
        ({"compress": "zstd", "level": 99}, "level 99"),
        ({"level": 3}, "'level' without 'compress'"),
    ],
)
def test_schema_refusals_name_the_key(column: dict[str, object], match: str) -> None:
    with pytest.raises(SchemaError, match=f"'obs'.*{match}"):
        Schema.from_spec({"obs": {"dtype": "uint8", "shape": [4], **column}})


def test_refusals() -> None:
    with pytest.raises(InvalidArgumentError, match=r"'obs'.*unit='episode'"):
        Buffer(10, schema=spec(), compressed_bytes=1000)
    with pytest.raises(InvalidArgumentError, match=r"'obs'.*compressed_bytes"):
        Buffer(10, unit="episode", schema=spec())
    with pytest.raises(InvalidArgumentError, match="declares none"):
        Buffer(10, unit="episode", schema={"x": {"dtype": "int64"}}, compressed_bytes=100)
    with pytest.raises(InvalidArgumentError, match="compressed_bytes must be"):
        Buffer(10, unit="episode", schema=spec(), compressed_bytes=0)
    with Buffer(50, unit="episode", schema=spec(), compressed_bytes=1000) as b:
        write(b, 0, 3)
        noise = np.random.default_rng(0).integers(0, 255, (5, 84, 84), dtype=np.uint8)
        with pytest.raises(CapacityError, match="compressed_bytes"):
            b.add_episode({"obs": noise, "step": np.arange(5)})
        assert b.num_episodes == 1  # nothing changed
        check_rows(b[0])
        out = {"obs": torch.empty(3, 84, 84, dtype=torch.uint8), "step": torch.empty(3)}
        with pytest.raises(InvalidArgumentError, match="'obs' is stored compressed"):
            b.sample_episodes(1, out=out)


def test_a_daemon_needs_episode_unit_and_a_byte_store_for_a_compressed_column(
    tmp_path: Path,
) -> None:
    no_bytes, transitions = {"unit": "episode"}, {"unit": "transition", "compressed_bytes": 99}
    for config, words in ((no_bytes, "--compressed-bytes"), (transitions, "--unit episode")):
        harness = Harness(str(tmp_path), **config)
        try:
            harness.hello(b"w")
            with pytest.raises(SchemaError, match=f"'obs' is stored compressed.*{words}"):
                harness(b"w", "define_schema", schema=spec())
            assert harness.service.segment is None
        finally:
            harness.close()


def test_a_daemon_plans_chunks_bytes_with_the_rows(tmp_path: Path) -> None:
    """A reserve carries its chunks' sizes and gets their offsets; one without them is
    refused naming the field; a run over the chunks of a writer still copying waits; an abort
    frees its chunks; bytes evict the oldest episodes with their rows, stamps moved."""
    harness = Harness(str(tmp_path), unit="episode", capacity=64, compressed_bytes=1000)
    try:
        harness.hello(b"w")
        harness(b"w", "define_schema", schema=spec())
        with pytest.raises(InvalidArgumentError, match="field 'chunks'"):
            harness(b"w", "reserve", rows=4)
        with pytest.raises(InvalidArgumentError, match="field 'chunks': 1 sizes, expected 2"):
            harness(b"w", "reserve", rows=4, episodes=2, chunks=encode_i64(np.array([5])))
        with pytest.raises(InvalidArgumentError, match="never ahead"):
            harness(b"w", "reserve", rows=4, ahead=True, chunks=encode_i64(np.array([5])))
        with pytest.raises(CapacityError, match="compressed bytes"):
            harness(b"w", "reserve", rows=4, chunks=encode_i64(np.array([1001])))

        def reserve(rows: int, *sizes: int, **extra: Any) -> dict[str, Any]:
            chunks = encode_i64(np.array(sizes, np.int64))
            episodes = len(sizes)
            return harness(b"w", "reserve", rows=rows, episodes=episodes, chunks=chunks, **extra)

        first = reserve(8, 300, 300)
        assert decode_i64(first["offsets"]).tolist() == [0, 300]
        with pytest.raises(Deferred, match="still being written"):
            reserve(4, 500)  # wraps over the chunks of the first, not committed yet
        second = reserve(4, 300, commit=first["reservation"])
        assert decode_i64(second["offsets"]).tolist() == [600]
        stamps = harness.segment.generations[:8].copy()
        # wraps to byte 0: the first two episodes go for their bytes, their rows too
        third = reserve(4, 500, commit=second["reservation"])
        assert decode_i64(third["offsets"]).tolist() == [0]
        assert (harness.segment.generations[:8] > stamps).all()  # moved before any copy
        assert harness.service.container.num_episodes == 1
        harness(b"w", "abort", reservation=third["reservation"], written=0)
        assert harness.service.container.num_episodes == 1  # nothing comes back
        stats = harness(b"w", "stats")["stats"]["compressed"]
        assert stats["used"] == 300 and stats["bytes"] == 1000
        assert reserve(4, 300)["reservation"]  # the aborted run's bytes are free again
    finally:
        harness.close()
