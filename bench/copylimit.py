"""The copy limit: the fastest single-thread copy of the same bytes found.

Every copy is the fastest single-thread copy found for its rows: where rows are 4 KiB or more
it goes through ``shmbuffer/storage/streamcopy.py``, the copy shmbuffer itself makes: ranges stream
(non-temporal stores: 25-40% faster than ``np.copyto`` for image rows on an AMD VM, level on an
Intel one), and gathers take whichever way, streamed or ``np.take``, its trial found faster in
this process (``GatherTrial``), so a limit made with numpy alone would sit below shmbuffer.
Otherwise contiguous copies are ``numpy.copyto`` into a preallocated destination, and gathers
are fancy indexing ``src[idx]`` for a column of one value per row (numpy's 1-D fast path, ~1 us
for 256 rows against ~2.5 us for ``np.take``) and ``np.take(src, idx, axis=0, out=dst,
mode="clip")`` for wider rows (torch's ``index_select(out=)`` and fancy indexing were slower on
f32[64] rows; sorted indices and per-run copies did not pay). On the ``first`` pass every
destination is fresh (``np.empty``: its pages are faulted in by the copy); on ``steady`` it is
reused.

Random indices are drawn outside the timed calls, from a pool of draws large enough that the
rows they name are not in the CPU caches (:data:`POOL_BYTES`), as a sampler's fresh draws are
not: a pool of 64 draws of 256 small rows is 4.4 MB of rows, cache resident after one cycle,
which made the bound a cache copy instead of a gather from memory.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bench.adapters import Adapter
from bench.data import Batch, Spec, row_bytes
from shmbuffer.storage.streamcopy import copy_into, gather_into, warm

#: Bytes of rows the pool of draws names at least (a few times the 32 MiB L3 measured).
POOL_BYTES = 128 * 2**20
POOL_DRAWS = (64, 4096)  # at least, at most


class CopyLimit(Adapter):
    name = "copy-limit"

    def __init__(self, capacity: int, spec: Spec, unit: str, tmpdir: str) -> None:
        super().__init__(capacity, spec, unit, tmpdir)
        self.dst = {k: np.empty((capacity, *shape), dtype) for k, (shape, dtype) in spec.items()}
        self.pos = self.size = 0
        self.fresh = True
        self.outs: dict[tuple[int, ...], dict[str, np.ndarray]] = {}
        self.rng = np.random.default_rng(1)
        self.pools: dict[tuple[int, int], tuple[np.ndarray, list[int]]] = {}
        self.row_bytes = row_bytes(spec)
        warm(self.row_bytes)  # large rows stream, as shmbuffer's do

    def set_pass(self, pass_: str) -> None:
        self.fresh = pass_ == "first"

    def _out(self, *lead: int) -> dict[str, np.ndarray]:
        if self.fresh or lead not in self.outs:
            out = {k: np.empty((*lead, *shape), dtype) for k, (shape, dtype) in self.spec.items()}
            if self.fresh:
                return out
            self.outs[lead] = out
        return self.outs[lead]

    def _draw(self, n: int, high: int, scale: int = 1) -> np.ndarray:
        found = self.pools.get((n, scale))
        if found is None:  # drawn once, untimed, then cycled (see POOL_BYTES)
            lo, hi = POOL_DRAWS
            draws = min(hi, max(lo, -(-POOL_BYTES // (n * scale * self.row_bytes))))
            found = self.pools[(n, scale)] = (self.rng.integers(0, high, (draws, n)) * scale, [0])
        pool, at = found
        at[0] = (at[0] + 1) % len(pool)
        draw: np.ndarray = pool[at[0]]
        return draw

    def write(self, native: Batch) -> None:
        n = len(native["done"])
        if self.pos + n > self.capacity:
            self.pos = 0  # episodes go whole, like an episode-unit buffer's early wrap
        for k, v in native.items():
            copy_into(self.dst[k][self.pos : self.pos + n], v)
        self.pos = (self.pos + n) % self.capacity
        self.size = min(self.capacity, self.size + n)

    def read(self, start: int, stop: int) -> Any:
        out = self._out(stop - start)
        for k, v in out.items():
            copy_into(v, self.dst[k][start:stop])
        return out

    def read_index(self, idx: np.ndarray) -> Any:
        got = {}
        for k, v in self._out(len(idx)).items():
            src = self.dst[k]
            if src.ndim == 1:
                got[k] = src[idx]  # fancy indexing: the 1-D fast path (fresh, and still faster)
            else:
                got[k] = gather_into(src, idx, v)  # np.take, or streamed for large rows
        return got

    def prepare_sampling(self) -> None:
        self.pools.clear()

    def sample(self, n: int) -> Any:
        return self.read_index(self._draw(n, self.size))

    def sample_episodes(self, n: int, length: int) -> Any:
        starts = self._draw(n, self.size // length, scale=length)
        out = self._out(n, length)
        for k, v in out.items():
            src = self.dst[k]
            for j, s in enumerate(starts):
                copy_into(v[j], src[s : s + length])
        return out
