"""Deterministic data for the scenarios (``np.random.default_rng(0)``), as numpy batches, and the
specs that describe it."""

from __future__ import annotations

import numpy as np

Batch = dict[str, np.ndarray]
Spec = dict[str, tuple[tuple[int, ...], np.dtype]]

TRANSITION_SPEC: Spec = {
    "obs": ((64,), np.dtype(np.float32)),
    "action": ((), np.dtype(np.int64)),
    "reward": ((), np.dtype(np.float32)),
    "done": ((), np.dtype(np.bool_)),
}

ATARI_SPEC: Spec = {
    "obs": ((4, 84, 84), np.dtype(np.uint8)),
    "action": ((), np.dtype(np.int64)),
    "reward": ((), np.dtype(np.float32)),
    "done": ((), np.dtype(np.bool_)),
}


def row_bytes(spec: Spec) -> int:
    return sum(
        int(np.prod(shape, dtype=np.int64)) * dtype.itemsize for shape, dtype in spec.values()
    )


def transitions(n: int, seed: int = 0) -> Batch:
    """``n`` transitions of :data:`TRANSITION_SPEC`; ``done`` every 200 steps."""
    rng = np.random.default_rng(seed)
    done = np.zeros(n, dtype=np.bool_)
    done[199::200] = True
    return {
        "obs": rng.standard_normal((n, 64), dtype=np.float32),
        "action": rng.integers(0, 18, n, dtype=np.int64),
        "reward": rng.standard_normal(n, dtype=np.float32),
        "done": done,
    }


def chunks(batch: Batch, size: int) -> list[Batch]:
    """Contiguous views of ``batch`` in chunks of ``size`` rows."""
    n = len(next(iter(batch.values())))
    return [{k: v[i : i + size] for k, v in batch.items()} for i in range(0, n, size)]


def episodes(count: int, length: int, seed: int = 0) -> list[Batch]:
    """``count`` distinct Atari-like episodes of ``length`` steps (the last step is done)."""
    rng = np.random.default_rng(seed)
    done = np.zeros(length, dtype=np.bool_)
    done[-1] = True
    return [
        {
            "obs": rng.integers(0, 256, (length, 4, 84, 84), dtype=np.uint8),
            "action": rng.integers(0, 18, length, dtype=np.int64),
            "reward": rng.standard_normal(length, dtype=np.float32),
            "done": done.copy(),
        }
        for _ in range(count)
    ]


SPECS: dict[str, Spec] = {"images": ATARI_SPEC, "small": TRANSITION_SPEC}  # by kind name


def pool(kind: str, count: int, length: int, seed: int = 0) -> list[Batch]:
    """``count`` distinct episodes of ``length`` steps of the ``kind`` spec (see :data:`SPECS`),
    each ending with ``done``."""
    if kind == "images":
        return episodes(count, length, seed=seed)
    batch = transitions(count * length, seed=seed)
    batch["done"][:] = False
    batch["done"][length - 1 :: length] = True
    return chunks(batch, length)


def schema(spec: Spec) -> dict[str, dict[str, object]]:
    """``spec`` as the JSON schema shmbuffer takes (``Buffer(schema=)``, ``start --schema``)."""
    return {k: {"dtype": dt.name, "shape": list(shape)} for k, (shape, dt) in spec.items()}
