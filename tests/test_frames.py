"""Frame stacks stored once (api/frames.py, api/framegather.py) in the in-process Buffer: a
sampled stack and next stack equal the ones computed directly from the episode, at starts,
ends, done flags and across the ring's wrap, in both units and with both paddings; stacked
writes are checked and refused naming the row."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shmbuffer import Buffer
from shmbuffer.errors import SchemaError
from shmbuffer.storage.schema import Schema


def spec(k: int, pad: str, next_of: bool) -> dict[str, object]:
    # a frame is [step id, episode id]: every frame names where it came from
    out: dict[str, object] = {
        "obs": {"dtype": "int32", "shape": [2], "stack": k, "pad": pad},
        "terminated": {"dtype": "bool", "shape": []},
        "action": {"dtype": "int64", "shape": []},
    }
    if next_of:
        out["next.obs"] = {"next_of": "obs"}
    return out


class Episodes:
    """What was written, step by step: the reference the stacks are computed from."""

    def __init__(self) -> None:
        self.frames: dict[int, list[np.ndarray]] = {}  # episode -> its frames, then its last next
        self.where: dict[int, tuple[int, int]] = {}  # step id -> (episode, index)
        self.step = 0

    def episode(self, eid: int, length: int) -> dict[str, np.ndarray]:
        ids = np.arange(self.step, self.step + length + 1)
        self.step += length + 1  # the last next frame has an id of its own
        frames = np.stack([ids, np.full_like(ids, eid)], 1).astype(np.int32)
        self.frames[eid] = list(frames)
        for i, g in enumerate(ids[:-1]):
            self.where[int(g)] = (eid, i)
        term = np.zeros(length, bool)
        term[-1] = True
        return {
            "obs": frames[:-1],
            "next": {"obs": frames[1:]},
            "terminated": term,
            "action": ids[:-1].astype(np.int64),
        }

    def expected(self, g: int, first: int, k: int, pad: str, ahead: int) -> np.ndarray:
        eid, i = self.where[g]
        frames = self.frames[eid]
        out = []
        for j in range(k - 1, -1, -1):
            src = i + ahead - j
            if src >= first:
                out.append(frames[src])
            else:
                out.append(frames[first] if pad == "repeat" else np.zeros(2, np.int32))
        return np.stack(out)


def concat(parts: list[dict[str, np.ndarray]], next_of: bool) -> dict[str, object]:
    out: dict[str, object] = {
        key: np.concatenate([p[key] for p in parts]) for key in ("obs", "terminated", "action")
    }
    if next_of:
        out["next"] = {"obs": np.concatenate([p["next"]["obs"] for p in parts])}
    return out


def check(buffer: Buffer, ref: Episodes, k: int, pad: str, next_of: bool) -> None:
    # the first live step of each episode: a trimmed chunk's stacks start there (read from
    # every live row: a draw may miss the one row that says it)
    live = buffer[:]
    if isinstance(live, list):  # episode unit: a list of episodes
        live = {"action": torch.cat([ep["action"] for ep in live])}
    first: dict[int, int] = {}
    for g in live["action"].reshape(-1).tolist():
        eid, i = ref.where[g]
        first[eid] = min(first.get(eid, i), i)
    # every live row, not only those drawn: a trim's first row may be rare in draws
    for _ in range(4):
        batch = buffer.sample(128)
        for row in range(128):
            g = int(batch["action"][row])
            eid, _i = ref.where[g]
            start = min(first.get(eid, _i), _i)
            stack = batch["obs"][row].numpy()
            want = ref.expected(g, start, k, pad, 0)
            want = want[0] if k == 1 else want  # a plain column: one frame
            np.testing.assert_array_equal(stack, want, err_msg=f"step {g}")
            if next_of:
                nxt = batch["next", "obs"][row].numpy()
                want = ref.expected(g, start, k, pad, 1)
                want = want[0] if k == 1 else want
                np.testing.assert_array_equal(nxt, want, err_msg=f"next of step {g}")


@settings(max_examples=40, deadline=None, report_multiple_bugs=False)
@given(
    k=st.integers(1, 4),
    pad=st.sampled_from(["repeat", "zero"]),
    next_of=st.booleans(),
    unit=st.sampled_from(["transition", "episode"]),
    capacity=st.integers(24, 48),  # a write holds up to 3 * (7 + 1) rows
    writes=st.lists(st.lists(st.integers(1, 7), min_size=1, max_size=3), min_size=1, max_size=12),
    stacked=st.booleans(),
)
def test_stacks_equal_the_episodes(
    k: int,
    pad: str,
    next_of: bool,
    unit: str,
    capacity: int,
    writes: list[list[int]],
    stacked: bool,
) -> None:
    buffer = Buffer(capacity, unit=unit, schema=spec(k, pad, next_of), seed=1)
    ref = Episodes()
    eid = 0
    for given_lengths in writes:
        lengths = given_lengths[:1] if unit == "episode" else given_lengths  # one a write
        parts = []
        for length in lengths:
            parts.append(ref.episode(eid, length))
            eid += 1
        batch = concat(parts, next_of)
        if (
            stacked and k > 1
        ):  # what FrameStackObservation gives, checked and cut to its newest frame
            batch["obs"] = stacks_of(parts, k, pad, 0)
            if next_of:
                batch["next"] = {"obs": stacks_of(parts, k, pad, 1)}
        if unit == "episode":
            buffer.add_episode(batch)
        else:
            buffer.extend(batch)
    check(buffer, ref, k, pad, next_of)
    buffer.close()


def stacks_of(parts: list[dict[str, np.ndarray]], k: int, pad: str, ahead: int) -> np.ndarray:
    out = []
    for part in parts:
        frames = [*part["obs"], part["next"]["obs"][-1]]
        for i in range(len(part["obs"])):
            stack = []
            for j in range(k - 1, -1, -1):
                src = i + ahead - j
                if src >= 0:
                    stack.append(frames[src])
                else:
                    stack.append(frames[0] if pad == "repeat" else np.zeros(2, np.int32))
            out.append(np.stack(stack))
    return np.stack(out)


def test_the_schema_round_trips() -> None:
    schema = Schema.from_spec(spec(4, "zero", True))
    assert Schema.from_spec(schema.to_spec()) == schema
    assert schema.tail == 1 and schema.has_frames
    assert schema["obs"].stack == 4 and schema["obs"].pad == "zero"
    with pytest.raises(SchemaError, match="next_of 'nope' names no stored column"):
        Schema.from_spec({"a": {"dtype": "uint8", "shape": []}, "b": {"next_of": "nope"}})
    with pytest.raises(SchemaError, match="pad must be one of"):
        Schema.from_spec({"a": {"dtype": "uint8", "shape": [], "stack": 2, "pad": "edge"}})


def test_tail_rows_count_in_capacity_and_hold_the_last_next_frame() -> None:
    buffer = Buffer(20, schema=spec(2, "repeat", True))
    ref = Episodes()
    buffer.add_episode(ref.episode(0, 4))
    assert buffer.num_rows == 4  # the tail row is stored, not registered
    assert buffer._ring.pointer == 5
    tail = buffer.segment.arrays[("obs",)][4]
    np.testing.assert_array_equal(tail, ref.frames[0][-1])
    assert buffer.segment.arrays[("action",)][4] == 0  # other columns: zeros
    episodes = buffer.sample_episodes(1)  # single frames, no next_of column
    assert episodes["obs"].shape == (1, 4, 2) and ("next", "obs") not in episodes.keys(True)


def test_a_stack_that_disagrees_is_refused_naming_the_row() -> None:
    buffer = Buffer(20, schema=spec(3, "repeat", True))
    ref = Episodes()
    part = ref.episode(1, 5)  # episode 1: no frame is all zeros
    batch = concat([part], True)
    batch["obs"] = stacks_of([part], 3, "repeat", 0)
    batch["obs"][3, 0] += 1  # row 3's oldest frame is not row 1's
    with pytest.raises(SchemaError, match=r"'obs': row 3's stack disagrees.*row 1"):
        buffer.add_episode(batch)
    batch["obs"] = stacks_of([part], 3, "zero", 0)  # zeros where repeat pads
    with pytest.raises(SchemaError, match=r"row 0's stack .*padding \(repeat\)"):
        buffer.add_episode(batch)
    batch = concat([part], True)
    batch["next"]["obs"][2] += 1
    with pytest.raises(SchemaError, match=r"'next.obs': row 2's next observation"):
        buffer.add_episode(batch)
    assert buffer.num_rows == 0 and buffer._ring.pointer == 0  # nothing stored
