"""Frame stacks through a real daemon: a Writer stores one frame a row (stacks given whole are
checked and cut), a local Reader builds the stacks and next stacks from the shared rows
(``clients/framereads.py``), checked against every row's stamp; a writer lapping the reader
on a small ring never yields a stack mixing two episodes; a remote reader is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shmbuffer import Reader, Writer
from shmbuffer.errors import InvalidArgumentError, SchemaError

K = 3
SCHEMA = f"""
obs = {{ dtype = "int64", shape = [2], stack = {K} }}
"next.obs" = {{ next_of = "obs" }}
terminated = {{ dtype = "bool", shape = [] }}
"""


def _episode(eid: int, first_step: int, length: int, stacked: bool) -> dict[str, Any]:
    """Frames ``[step id, episode id]``; the last next frame is step ``first + length``."""
    steps = np.arange(first_step, first_step + length + 1)
    frames = np.stack([steps, np.full_like(steps, eid)], 1)
    term = np.zeros(length, bool)
    term[-1] = True
    if not stacked:
        return {"obs": frames[:-1], "next": {"obs": frames[1:]}, "terminated": term}
    j = np.arange(K - 1, -1, -1)
    obs = frames[np.maximum(np.arange(length)[:, None] - j, 0)]  # pad: the first repeated
    nxt = frames[np.maximum(np.arange(1, length + 1)[:, None] - j, 0)]
    return {"obs": obs, "next": {"obs": nxt}, "terminated": term}


def _check(obs: np.ndarray, nxt: np.ndarray) -> None:
    """Each stack is one episode's frames, consecutive, padded by repeating its first."""
    for stack, following in zip(obs, nxt, strict=True):
        assert (stack[:, 1] == stack[-1, 1]).all(), f"a stack mixes episodes: {stack.tolist()}"
        assert (following[:, 1] == stack[-1, 1]).all(), f"next mixes: {following.tolist()}"
        steps = stack[:, 0]
        assert (np.diff(steps) >= 0).all() and (np.diff(steps) <= 1).all(), steps
        assert (np.diff(steps) == 1).all() or steps[0] == steps[1], steps  # pad at the front
        np.testing.assert_array_equal(following[:-1], stack[1:])  # next: one frame on
        assert following[-1, 0] == stack[-1, 0] + 1


def _schema_file(tmp_path: Path) -> str:
    path = tmp_path / "schema.toml"
    path.write_text(SCHEMA)
    return str(path)


def test_stacks_through_the_daemon(daemon: Any, tmp_path: Path) -> None:
    d = daemon(capacity=64, unit="transition", args=["--schema", _schema_file(tmp_path)])
    with Writer(d.name) as writer:
        writer.add_episode(_episode(0, 0, 5, stacked=True))
        writer.extend(_episode(1, 100, 4, stacked=False))
        bad = _episode(2, 200, 4, stacked=True)
        bad["obs"][2, 0, 0] += 7
        with pytest.raises(SchemaError, match="row 2's stack disagrees"):
            writer.add_episode(bad)
        writer.flush()
    with Reader(d.name) as reader:
        assert reader.schema is None or reader.schema.tail == 1
        batch = reader.sample(200)
        assert batch["obs"].shape == (200, K, 2) and batch["next", "obs"].shape == (200, K, 2)
        _check(batch["obs"].numpy(), batch["next", "obs"].numpy())
        newest = batch["obs"][:, -1].tolist()
        seen = {(e, s) for s, e in newest}
        assert seen <= {(0, s) for s in range(5)} | {(1, 100 + s) for s in range(4)}
        assert reader.schema is not None and reader.schema["obs"].stack == K
        with reader.sample_episodes(1) as episodes:  # zero-copy views: single frames
            views = episodes[0]
            assert views["obs"].shape[-1:] == (2,) and ("next", "obs") not in views.keys(True)


def test_a_writer_lapping_the_reader_never_mixes_episodes(
    daemon: Any, children: Any, tmp_path: Path
) -> None:
    """A writer process laps a 64-row ring of 16 KiB frames (``_workers.write_framed_episodes``)
    while this process samples stacks: every frame is whole, every stack and next stack one
    episode's consecutive frames (padded at its start), whatever the writer overwrote."""
    width = 2048
    path = tmp_path / "wide.toml"
    wide = SCHEMA.replace("shape = [2]", f"shape = [{width}]")
    path.write_text(wide + 'episode = { dtype = "int64", shape = [] }\n')
    d = daemon(capacity=64, unit="transition", args=["--schema", str(path)])
    with Writer(d.name) as first:  # rows to draw from the start
        frames = np.repeat(np.arange(7, dtype=np.int64)[:, None], width, axis=1)
        first.add_episode(
            {
                "obs": frames[:-1],
                "next": {"obs": frames[1:]},
                "terminated": np.arange(6) == 5,
                "episode": np.zeros(6, np.int64),
            }
        )
    proc = children.spawn("writer", "write_framed_episodes", d.name, 3000, width)
    batches = 0
    with Reader(d.name, timeout=10.0, prefetch=False) as reader:
        while proc.is_alive() or batches < 5:
            batch = reader.sample(32)
            batches += 1
            obs, nxt = batch["obs"].numpy(), batch["next", "obs"].numpy()
            assert (obs == obs[..., :1]).all() and (nxt == nxt[..., :1]).all()  # whole frames
            values, following = obs[..., 0], nxt[..., 0]
            pairs = np.stack([values % 1_000_000, values // 1_000_000], -1)  # [step, episode]
            _check(pairs, np.stack([following % 1_000_000, following // 1_000_000], -1))
            # the row the frames were read from is the row the other columns were read from
            np.testing.assert_array_equal(values[:, -1] // 1_000_000, batch["episode"].numpy())
        resamples = reader.resamples
    assert children.collect({"writer"}, timeout=60.0)["writer"] == 3000
    print(f"{batches} batches, {resamples} items drawn again")


def test_a_remote_reader_is_refused(daemon: Any, tmp_path: Path) -> None:
    d = daemon(capacity=32, unit="transition", args=["--schema", _schema_file(tmp_path)])
    with Writer(d.name) as writer:
        writer.add_episode(_episode(0, 0, 4, stacked=False))
    with Reader(d.name, remote=True) as reader, pytest.raises(InvalidArgumentError):
        reader.sample(4)
