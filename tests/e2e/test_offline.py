"""Offline datasets in and out (``docs/offline.md``), through real daemons and the CLI: a live
buffer exported to Parquet and to Minari, loaded into a new daemon with ``start --import``,
exported again from a checkpoint folder, keeping every byte, every episode boundary and the
metadata; and an export while a writer and a reader run, with nothing torn."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from shmbuffer import Writer
from shmbuffer.cli.demo_loops import payload_value
from shmbuffer.clients.admin import checkpoint
from shmbuffer.offline.cut import BUILTIN, Episode

pytest.importorskip("pyarrow")

CAPACITY = 200  # rows: the episodes below wrap it, so one is split at its end
LENGTHS = [5 + (7 * e) % 9 for e in range(40)]


def episode(e: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Written episode ``e``: every key a different dtype or shape, a trajectory whose
    ``next.obs`` is its ``obs`` shifted (but for every 7th episode), and metadata of each
    kind, one name present on every other episode only."""
    n = LENGTHS[e]
    rng = np.random.default_rng(e)
    traj = rng.standard_normal((n + 1, 3)).astype(np.float32)
    nxt = traj[1:].copy()
    if e % 7 == 0:
        nxt[0] += 1.0  # not the next obs: the Minari export must keep it apart
    data = {
        "obs": traj[:-1],
        "next": {"obs": nxt},
        "image": rng.integers(0, 255, (n, 2, 4, 4), dtype=np.uint8),
        "action": rng.integers(-5, 5, n).astype(np.int64),
        "reward": rng.standard_normal(n).astype(np.float32),
        "done": np.arange(n) == n - 1,
        "half": rng.standard_normal(n).astype(np.float16),
        "ep": np.full(n, e, dtype=np.int64),
        "step": np.arange(n, dtype=np.int64),
    }
    meta: dict[str, Any] = {"ret": float(e) / 3, "env": f"env{e % 3}", "good": e % 2 == 0}
    if e % 2:
        meta["seed"] = 1000 + e
    return data, meta


def filled_source(daemon: Any) -> Any:
    """A daemon holding every episode of :data:`LENGTHS`, committed."""
    source = daemon(capacity=CAPACITY, unit="transition")
    with Writer(source.name, timeout=10) as writer:
        for e in range(len(LENGTHS)):
            data, meta = episode(e)
            writer.add_episode(data, meta=meta)
        writer.flush()
    return source


def flat(data: dict[str, Any], prefix: str = "") -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = np.asarray(value)
    return out


def read_dataset(spec: str) -> tuple[Any, list[Episode]]:
    from shmbuffer.offline.load import open_dataset

    dataset = open_dataset(spec)
    return dataset, [ep for batch in dataset.batches() for ep in batch]


def user_meta(ep: Episode) -> dict[str, Any]:
    return {k: v for k, v in ep.meta.items() if k not in BUILTIN and v is not None}


def check_against_written(episodes: list[Episode], written: int) -> None:
    """Every exported episode is the written one, byte for byte (the oldest may have lost
    its head to the ring), and they are the newest ones, in order, none missing."""
    numbers = [int(ep.columns["ep"][0]) for ep in episodes]
    assert numbers == list(range(numbers[0], written)), numbers
    for k, ep in enumerate(episodes):
        data, meta = episode(numbers[k])
        want = flat(data)
        start = int(ep.columns["step"][0])
        assert start == 0 or k == 0, f"episode {numbers[k]} torn: starts at step {start}"
        assert ep.length == LENGTHS[numbers[k]] - start
        for key, value in want.items():
            got = ep.columns[key]
            assert got.dtype == value.dtype and got.shape[1:] == value.shape[1:], key
            assert got.tobytes() == value[start:].tobytes(), f"episode {numbers[k]}: {key}"
        assert user_meta(ep) == meta
        assert ep.meta["length"] == ep.length


def same_episodes(a: list[Episode], b: list[Episode]) -> None:
    assert [ep.length for ep in a] == [ep.length for ep in b]
    for x, y in zip(a, b, strict=True):
        assert x.columns.keys() == y.columns.keys()
        for key in x.columns:
            assert x.columns[key].tobytes() == y.columns[key].tobytes(), key
        assert user_meta(x) == user_meta(y)


@pytest.mark.parametrize("kind", ["parquet", "minari"])
def test_round_trip_keeps_bytes_boundaries_and_metadata(
    kind, daemon, e2e_env, tmp_path, monkeypatch
):
    if kind == "minari":
        pytest.importorskip("minari")
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))
    first = f"parquet:{tmp_path / 'one'}" if kind == "parquet" else "minari:test/one-v0"
    again = f"parquet:{tmp_path / 'two'}" if kind == "parquet" else "minari:test/two-v0"

    source = filled_source(daemon)
    done = e2e_env.cli("export", "--name", source.name, "--to", first, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "exported" in done.stdout
    dataset, exported = read_dataset(first)
    check_against_written(exported, len(LENGTHS))
    assert sum(ep.length for ep in exported) == CAPACITY  # every live row, the split joined

    # the dataset as a new daemon's starting data, then out again from a checkpoint folder
    loaded = daemon(capacity=CAPACITY, unit="transition", args=["--import", first])
    checkpoint(loaded.name, tmp_path / "ckpt")
    done = e2e_env.cli("export", "--checkpoint", str(tmp_path / "ckpt"), "--to", again)
    assert done.returncode == 0, done.stderr
    _, round_trip = read_dataset(again)
    same_episodes(exported, round_trip)
    assert dataset.schema == read_dataset(again)[0].schema


def test_parquet_layout_is_what_datasets_loads(daemon, e2e_env, tmp_path):
    """One file per batch of episodes under data/, episode_index and frame_index, a column
    per flattened key (a vector as a list, an image as its bytes); the schema and metadata
    beside."""
    pq = pytest.importorskip("pyarrow.parquet")
    source = daemon(capacity=CAPACITY, unit="transition")
    with Writer(source.name, timeout=10) as writer:
        for e in range(5):
            data, meta = episode(e)
            writer.add_episode(data, meta=meta)
        writer.flush()
    done = e2e_env.cli("export", "--name", source.name, "--to", f"parquet:{tmp_path / 'd'}")
    assert done.returncode == 0, done.stderr
    info = json.loads((tmp_path / "d" / "shmbuffer.json").read_text())
    assert [f["path"] for f in info["files"]] == ["data/chunk-000000.parquet"]
    assert info["schema"]["image"] == {"dtype": "uint8", "shape": [2, 4, 4]}
    assert [ep["ret"] for ep in info["episodes"]] == [e / 3 for e in range(5)]
    table = pq.read_table(tmp_path / "d" / "data" / "chunk-000000.parquet")
    assert table.column_names[:2] == ["episode_index", "frame_index"]
    assert {"obs", "next.obs", "image", "action"} <= set(table.column_names)
    rows = table.slice(LENGTHS[0], 2).to_pylist()  # the second episode's first two steps
    assert [r["episode_index"] for r in rows] == [1, 1]
    assert [r["frame_index"] for r in rows] == [0, 1]
    assert rows[1]["obs"] == episode(1)[0]["obs"][1].tolist()  # a vector: a list
    image = np.frombuffer(rows[1]["image"], np.uint8).reshape(2, 4, 4)  # an image: its bytes
    assert image.tobytes() == episode(1)[0]["image"][1].tobytes()


def test_bad_targets_are_refused_by_name(daemon, e2e_env, tmp_path):
    source = daemon(capacity=CAPACITY, unit="transition")
    done = e2e_env.cli("export", "--name", source.name, "--to", "csv:/tmp/x")
    assert done.returncode != 0 and "parquet:DIR or minari:DATASET_ID" in done.stderr
    done = e2e_env.cli("start", "--name", "imp", "--import", f"parquet:{tmp_path}")
    assert done.returncode != 0 and "shmbuffer.json" in done.stderr


def test_a_failed_live_export_waits_for_the_cut_and_leaves_no_spool(daemon, e2e_env, tmp_path):
    """The conversion fails (the destination holds a dataset), the daemon's copy of the cut
    perhaps still running: the error names it, the spool is gone, and the daemon exports
    again at once (the export waited for its checkpoint: none is left running)."""
    source = filled_source(daemon)
    spool = tmp_path / "spool"
    target = f"parquet:{tmp_path / 'out'}"
    args = ["--name", source.name, "--spool", str(spool)]
    done = e2e_env.cli("export", *args, "--to", target, timeout=120)
    assert done.returncode == 0, done.stderr
    done = e2e_env.cli("export", *args, "--to", target, timeout=120)
    assert done.returncode != 0 and "holds a dataset already" in done.stderr
    assert list(spool.iterdir()) == []
    done = e2e_env.cli("export", *args, "--to", f"parquet:{tmp_path / 'again'}", timeout=120)
    assert done.returncode == 0, done.stderr
    _, exported = read_dataset(f"parquet:{tmp_path / 'again'}")
    check_against_written(exported, len(LENGTHS))


def check_untorn(ep: Episode, first: bool) -> None:
    """A demo writer's episode (``make_episode``): every row agrees with its (writer,
    episode, step); only the oldest may have lost its head."""
    steps = ep.columns["step"]
    writer, number = int(ep.columns["writer"][0]), int(ep.columns["episode"][0])
    assert (ep.columns["writer"] == writer).all() and (ep.columns["episode"] == number).all()
    assert np.array_equal(steps, np.arange(steps[0], steps[0] + ep.length)), "steps torn"
    assert first or steps[0] == 0, f"episode {number} starts at step {steps[0]}"
    assert bool(ep.columns["done"][-1]) and not ep.columns["done"][:-1].any(), "done torn"
    want = payload_value(writer, number, steps).astype(np.uint8)
    obs = ep.columns["obs"].reshape(ep.length, -1)
    assert (obs == want[:, None]).all(), f"episode {number}: obs torn"


def test_export_under_load_is_a_cut_with_nothing_torn(daemon, e2e_env, children, tmp_path):
    """A writer laps the ring and a learner samples (checking every episode it sees) while
    the buffer is exported three times: every exported episode is whole, consecutive in the
    writer's order, and the writer was never stopped."""
    source = daemon(capacity=2000, unit="transition")
    children.spawn("w", "write_episodes", source.name, 0, 4000, 10, (2, 3))
    children.spawn("l", "learn", source.name, 6.0)
    counts = []
    for k in range(3):
        to = tmp_path / f"x{k}"
        done = e2e_env.cli("export", "--name", source.name, "--to", f"parquet:{to}", timeout=60)
        assert done.returncode == 0, done.stderr
        _, exported = read_dataset(f"parquet:{to}")
        assert exported
        for i, ep in enumerate(exported):
            check_untorn(ep, first=i == 0)
        numbers = [int(ep.columns["episode"][0]) for ep in exported]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
        counts.append(numbers[-1])
    results = children.collect({"w", "l"}, timeout=120)
    assert results["w"] > counts[0]  # it went on writing past the first cut
    assert counts == sorted(counts)
