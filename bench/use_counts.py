"""What the use count costs a uniform ``sample(256)``, and whether counting in bulk changes it:

    .venv/bin/python -m bench.use_counts [--sizes 1000000,10000000] [--reps 15]

At each size, one container filled as ``sampling.scaling`` fills it (episodes of 100-1000 rows,
compiled draws and counts loaded) has its table's ``sample_rows(256)`` timed with the draw's
rows counted four ways, interleaved (one repetition of each in turn) beside TorchRL's
``RandomSampler`` on the same rows:

* ``per draw``: as shipped, one compiled loop over the draw's 256 rows (``Table.count_use``);
* ``in bulk``: the rows appended to a buffer of 65,536 and applied in one compiled call when it
  fills (what counting in bulk would cost: the appends and the amortised applies);
* ``in bulk, sorted``: the same, the buffer sorted before it is applied (locality);
* ``not counted``: the lower bound, no count at all.

Prints, per size and way, microseconds per call: the median repetition, the first quartile
and the fastest. The use counts are what the bulk ways leave unapplied at the end; nothing is
checked here (``tests/test_draws.py`` holds the shipped count exact).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.sampling import Layout, _container, _torchrl_storage

BULK = 1 << 16


def bulk(table: Any, kernels: Any, ordered: bool) -> Callable[[np.ndarray], None]:
    """A ``count_use`` that defers the rows to one call per :data:`BULK` rows."""
    pending = np.empty(BULK, dtype=np.int64)
    filled = [0]

    def count(rows: np.ndarray) -> None:
        n = filled[0]
        if n + rows.size > BULK:
            held = np.sort(pending[:n]) if ordered else pending[:n]
            kernels.add_one(table.use_counts, held)
            n = 0
        pending[n : n + rows.size] = rows
        filled[0] = n + rows.size

    return count


def ways(size: int) -> dict[str, Callable[[], Any]]:
    from torchrl.data.replay_buffers.samplers import RandomSampler

    from shmbuffer.registry.spans import load_compiled_draws

    kernels = load_compiled_draws()
    layout = Layout.make(size)
    table = _container(layout, "uniform").table
    storage = _torchrl_storage(layout)
    uniform = RandomSampler()
    shipped = table.count_use
    counts: dict[str, Callable[[np.ndarray], None]] = {
        "per draw": shipped,
        "in bulk": bulk(table, kernels, False),
        "in bulk, sorted": bulk(table, kernels, True),
        "not counted": lambda rows: None,
    }

    def sample(count: Callable[[np.ndarray], None]) -> Callable[[], Any]:
        def call() -> Any:
            table.count_use = count  # the instance's, over the method
            return table.sample_rows(256)

        return call

    out = {name: sample(count) for name, count in counts.items()}
    out["TorchRL RandomSampler"] = lambda: uniform.sample(storage, 256)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1000000,10000000")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--calls", type=int, default=2000, help="calls per repetition")
    args = parser.parse_args()
    print("us per uniform sample(256): median repetition / first quartile / fastest")
    for size in (int(s) for s in args.sizes.split(",")):
        calls = ways(size)
        for call in calls.values():  # first-use work, and the bulk buffers filled once
            for _ in range(BULK // 256 + 1):
                call()
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.reps):
            for name, call in calls.items():
                gc.collect()
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    call()
                times[name].append((time.perf_counter() - t0) / args.calls * 1e6)
        for name, got in times.items():
            got.sort()
            print(
                f"  {size:>10,} rows  {name:22s} {statistics.median(got):6.2f} / "
                f"{got[len(got) // 4]:6.2f} / {got[0]:6.2f}"
            )
        del calls
        gc.collect()


if __name__ == "__main__":
    main()
