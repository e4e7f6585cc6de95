"""The write path's shortcuts give the results of the long way.

* ``Schema.validate`` checks a plain flat dict in one pass; anything else takes the full check.
  Both must agree: the same batch shape and leaves, and the same SchemaError for a bad batch.
* Eviction marks the use counters of rows it unpublishes once, filling again only for an
  episode reaching outside the evicted range: after any sequence of writes a row's counter is
  -1 exactly when no live episode holds it.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import numpy as np
import pytest
import torch

from shmbuffer import Buffer
from shmbuffer.errors import SchemaError
from shmbuffer.ring.container import Container
from shmbuffer.storage.schema import Schema

SPEC = {
    "obs": {"dtype": "float32", "shape": [3]},
    "action": {"dtype": "int64", "shape": []},
    "small": {"dtype": "uint8", "shape": []},
    "done": {"dtype": "bool", "shape": []},
}


def _batch(n: int = 4, **changes: Any) -> dict[str, Any]:
    batch: dict[str, Any] = {
        "obs": torch.zeros(n, 3),
        "action": np.arange(n, dtype=np.int64),
        "small": np.zeros(n, dtype=np.uint8),
        "done": torch.zeros(n, dtype=torch.bool),
    }
    for key, value in changes.items():
        if value is None:
            del batch[key]
        else:
            batch[key] = value
    return batch


CASES: dict[str, dict[str, Any]] = {
    "plain": _batch(),
    "numpy obs": _batch(obs=np.ones((4, 3), dtype=np.float32)),
    "zero rows": _batch(0),
    "float64 obs (value check)": _batch(obs=np.ones((4, 3))),
    "float64 obs overflowing": _batch(obs=np.full((4, 3), 1e300)),
    "int64 into uint8, fits": _batch(small=np.arange(4)),
    "int64 into uint8, too large": _batch(small=np.arange(4) * 100),
    "float into int": _batch(action=torch.zeros(4)),
    "bool into uint8": _batch(small=torch.zeros(4, dtype=torch.bool)),
    "list value": _batch(action=[1, 2, 3, 4]),
    "extra key": _batch(extra=np.zeros(4)),
    "missing key": _batch(done=None),
    "wrong row shape": _batch(obs=torch.zeros(4, 2)),
    "no batch dim": _batch(action=np.int64(3)),
    "one row without batch dim": _batch(obs=torch.zeros(3)),
    "lengths differ": _batch(done=torch.zeros(5, dtype=torch.bool)),
    "tensor subclass": _batch(obs=torch.nn.Parameter(torch.zeros(4, 3), requires_grad=False)),
    "non-str key": {**_batch(action=None), 7: np.zeros(4)},
    "nested value": _batch(obs={"x": torch.zeros(4, 3)}),
}


def _outcome(schema: Schema, batch: Any) -> tuple[Any, ...]:
    try:
        shape, leaves = schema.validate(batch)
    except SchemaError as exc:
        return ("error", str(exc))
    return ("ok", shape, [(key, id(value)) for key, value in leaves.items()])


@pytest.mark.parametrize("case", list(CASES))
def test_the_flat_shortcut_agrees_with_the_full_check(case: str) -> None:
    schema = Schema.from_spec(SPEC)
    batch = CASES[case]
    # Twice: the first full check of a dtype pair fills the caches the shortcut reads.
    for _ in range(2):
        # A mapping proxy is not a dict, so it always takes the full check.
        full = _outcome(schema, MappingProxyType(batch))
        assert _outcome(schema, batch) == full


def test_the_shortcut_takes_the_common_batch_and_refuses_the_rest() -> None:
    schema = Schema.from_spec(SPEC)
    schema.validate(MappingProxyType(_batch()))  # the dtype pairs are known now
    assert schema._validate_flat(_batch()) is not None
    for case in ("float64 obs (value check)", "extra key", "missing key", "lengths differ"):
        assert schema._validate_flat(CASES[case]) is None, case


def test_a_nested_schema_never_takes_the_shortcut() -> None:
    schema = Schema.from_spec({"obs": {"dtype": "float32", "shape": []}, "next": SPEC})
    assert schema._flat == {}
    batch = {"obs": torch.zeros(2), "next": _batch(2)}
    (rows,), leaves = schema.validate(batch)
    assert rows == 2 and ("next", "obs") in leaves


@pytest.mark.parametrize("unit", ["transition", "episode"])
@pytest.mark.parametrize("seed", range(6))
def test_use_counts_mark_exactly_the_rows_no_live_episode_holds(unit: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    capacity = 97
    c = Container(capacity, unit=unit)
    in_flight: list[int] = []
    for _ in range(300):
        num_sub = int(rng.integers(1, 4))
        length = int(rng.integers(1, 9))  # three in flight, early wrap too, fit the ring
        reservation = c.reserve_rows(num_sub * length, num_sub)
        in_flight.append(reservation.id)
        # Up to three open at once, committed in a random order (so out of order now and
        # then); none stays open long enough for the ring to lap it.
        if len(in_flight) == 3 or rng.random() < 0.5:
            for i in rng.permutation(len(in_flight)).tolist():
                c.commit(in_flight[i])
            in_flight.clear()
        held = np.zeros(capacity, dtype=bool)
        for ep in c.registry:
            held[ep.start : ep.end] = True
        for r in c.reservations.values():
            for start, stop in r.ranges:
                held[start:stop] = True  # reserved rows are counted 0 at commit, not before
        free = ~held
        assert np.all(c.use_counts[free] == -1)
        live = np.zeros(capacity, dtype=bool)
        for ep in c.registry:
            live[ep.start : ep.end] = True
        assert np.all(c.use_counts[live] >= 0)


def test_a_wrapped_chunk_lands_in_order_from_numpy_and_torch() -> None:
    buf = Buffer(10, unit="transition")
    for n, kind in ((7, "numpy"), (6, "torch"), (9, "numpy")):
        first = buf.num_rows and int(buf[-1]["action"]) + 1
        action = np.arange(first, first + n, dtype=np.int64)
        obs = np.stack([action, -action], axis=1).astype(np.float32)
        batch: dict[str, Any] = {"action": action, "obs": obs}
        if kind == "torch":
            batch = {k: torch.from_numpy(v) for k, v in batch.items()}
        buf.extend(batch)
    stored = buf[:]
    assert stored["action"].tolist() == list(range(12, 22))
    assert stored["obs"][:, 1].tolist() == [-float(a) for a in range(12, 22)]
