"""The common adapter interface every implementation is driven through, and shmbuffer's adapters:
the in-process ``Buffer`` (private or shared memory) and a daemon filled by a ``Writer`` and
sampled by a ``Reader``.

An adapter owns one buffer of ``capacity`` rows. ``convert`` turns a numpy batch into the
implementation's native input once, outside the timed regions; the scenario then times
``write``/``read``/``read_index``/``sample``/``sample_episodes`` on the same data for every impl.
"""

from __future__ import annotations

import gc
import itertools
import os
import time
from collections import deque
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import numpy as np

from bench.data import Batch, Spec, schema
from bench.harness import running_daemon
from bench.registry import Context, Row


def missing_module(module: str) -> str | None:
    """Why ``module`` cannot be imported here, or None."""
    try:
        __import__(module)
    except Exception as exc:  # ImportError, or a broken compiled extension
        return f"{module} is not importable ({type(exc).__name__}: {exc})"
    return None


class Unsupported(Exception):
    """The implementation has no equivalent of this operation (reported as a note)."""


class Adapter:
    name = "?"

    @classmethod
    def missing(cls) -> str | None:
        """Why this implementation cannot run here (not installed...), or None."""
        return None

    def __init__(self, capacity: int, spec: Spec, unit: str, tmpdir: str) -> None:
        self.capacity, self.spec, self.unit, self.tmpdir = capacity, spec, unit, tmpdir
        self.notes: list[str] = []

    def convert(self, batch: Batch) -> Any:
        return batch

    def set_pass(self, pass_: str) -> None:
        """Told before each timed pass; only the copy limit cares (fresh vs reused output)."""

    def prepare_sampling(self) -> None:
        """Untimed hook before sampling (build samplers, probe support)."""

    def write(self, native: Any) -> None:
        raise NotImplementedError

    def read(self, start: int, stop: int) -> Any:
        raise Unsupported("no slice read")

    def read_index(self, idx: np.ndarray) -> Any:
        raise Unsupported("no index read")

    def sample(self, n: int) -> Any:
        raise NotImplementedError

    def sample_episodes(self, n: int, length: int) -> Any:
        raise Unsupported("no episode sampling")

    def close(self) -> None:
        pass


_names = itertools.count()


def _import_buffer() -> Any:
    from shmbuffer import Buffer

    return Buffer


class Shmbuffer(Adapter):
    """``shmbuffer.Buffer`` in private memory (``name=None``)."""

    name = "shmbuffer"
    shared = False

    @classmethod
    def missing(cls) -> str | None:
        try:
            _import_buffer()
        except (ImportError, AttributeError) as exc:
            return f"shmbuffer.Buffer is not importable ({exc})"
        return None

    def __init__(self, capacity: int, spec: Spec, unit: str, tmpdir: str) -> None:
        super().__init__(capacity, spec, unit, tmpdir)
        self._cls = _import_buffer()
        self.seg = f"bench-{os.getpid()}-{next(_names)}" if self.shared else None
        # The schema is declared, as a user who knows their rows would: the memory is then
        # allocated and pre-faulted at creation (timed as "create", like cpprb's), not
        # during the first pass of writes.
        self.buf = self._cls(
            capacity, unit=unit, mode="circular", name=self.seg, schema=schema(spec)
        )
        self.row_sampler = self.buf
        self._episode_out: dict[int, Any] = {}  # sample_episodes(n)'s reused out=, by n
        self._recent: deque[Any] = deque()
        self._recent_rows = 0

    def convert(self, batch: Batch) -> Any:
        import torch

        return {k: torch.from_numpy(v) for k, v in batch.items()}

    def write(self, native: Any) -> None:
        self.buf.extend(native)
        if self.unit == "episode":  # kept (references only) for a row-sampling fallback
            self._recent.append(native)
            self._recent_rows += len(native["done"])
            while self._recent_rows - len(self._recent[0]["done"]) >= self.capacity:
                self._recent_rows -= len(self._recent.popleft()["done"])

    def read(self, start: int, stop: int) -> Any:
        return self.buf[start:stop]

    def read_index(self, idx: np.ndarray) -> Any:
        return self.buf[idx]

    def prepare_sampling(self) -> None:
        if self.unit != "episode":
            return
        try:
            self.buf.sample(2)
        except Exception as exc:
            # No row sampling in episode unit: sample rows from a transition-unit Buffer
            # holding the same (most recent) rows, filled outside the timed region.
            self.notes.append(
                f"episode-unit Buffer.sample failed ({type(exc).__name__}: {exc}); "
                "rows are sampled from a transition-unit Buffer holding the same rows"
            )
            self.row_sampler = self._cls(self.capacity, unit="transition", mode="circular")
            for native in self._recent:
                self.row_sampler.extend(native)

    def sample(self, n: int) -> Any:
        return self.row_sampler.sample(n)

    def sample_episodes(self, n: int, length: int) -> Any:
        # The first call's copy is the out= of the next ones: warm pages, as a learner reusing
        # its batch and the copy limit's steady pass
        out = self._episode_out.get(n)
        got = self.buf.sample_episodes(n, out=out)
        if out is None and not isinstance(got, list):
            self._episode_out[n] = got
        return got

    def close(self) -> None:
        for buf in {id(b): b for b in (self.row_sampler, self.buf)}.values():
            close = getattr(buf, "close", None)
            if close is None:
                continue
            if buf is self.buf and self.seg is not None:
                close(unlink=True)
            else:
                close()


class ShmbufferShared(Shmbuffer):
    """``shmbuffer.Buffer`` in named shared memory (``/dev/shm/shmbuffer/<name>``)."""

    name = "shmbuffer-shm"
    shared = True


class DaemonBuffer(Adapter):
    """A daemon subprocess holding the buffer; filled by a ``Writer`` and sampled by a
    ``Reader`` in this process (shared memory both ways)."""

    name = "shmbuffer-daemon"
    prefetch: bool | int = False

    @classmethod
    def missing(cls) -> str | None:
        return missing_module("shmbuffer.clients.reader")

    def __init__(self, capacity: int, spec: Spec, unit: str, tmpdir: str) -> None:
        super().__init__(capacity, spec, unit, tmpdir)
        from shmbuffer import Reader, Writer

        # Closed in reverse (reader, writer, daemon) by close(), or here if a step fails.
        with ExitStack() as stack:
            self.target = stack.enter_context(running_daemon(tmpdir, capacity, unit, spec))
            self.writer = stack.enter_context(Writer(self.target))
            self.reader = stack.enter_context(Reader(self.target, prefetch=self.prefetch))
            self._stack = stack.pop_all()

    def write(self, native: Batch) -> None:
        if self.unit == "episode":
            self.writer.add_episode(native)
        else:
            self.writer.extend(native)

    def prepare_sampling(self) -> None:
        self.writer.flush()
        self.reader.sample(2)  # attaches the segment

    def sample(self, n: int) -> Any:
        return self.reader.sample(n)

    def sample_episodes(self, n: int, length: int) -> Any:
        with self.reader.sample_episodes(n) as episodes:
            for ep in episodes:  # touch one element of each view
                ep["obs"].flatten()[0].item()
        return len(episodes)

    def sample_slices(self, n: int, length: int) -> Any:
        return self.reader.sample_slices(n, length)

    def sample_n_step(self, n: int) -> Any:
        """``n`` rows with 3-step returns computed by the Reader (``docs/sampling.md``)."""
        return self.reader.sample(n, n_step=3, gamma=0.99, n_step_keys=N_STEP_KEYS)

    def close(self) -> None:
        self._stack.close()


#: The bench's specs end episodes with ``done`` and store no next observation: ``obs`` stands
#: in for it, so an n-step sample gathers an image row more per item, as it would the next one.
N_STEP_KEYS = {"terminated": "done", "truncated": None, "next_obs": "obs"}


#: Batches a shmbuffer learner's Reader fetches per request (``Reader(prefetch=4)``): with
#: small batches it halves the learner's and the daemon's CPU per batch, measured.
PREFETCH = 4


class DaemonPrefetch(DaemonBuffer):
    """The same daemon and Reader with ``prefetch=4`` (the README's advice for a learner
    that samples in a loop): the indices of the next four ``sample``/``sample_slices`` are
    asked for in one request while these gather, so the round trip overlaps the copies."""

    name = "shmbuffer-daemon-prefetch"
    prefetch = PREFETCH

    def sample_episodes(self, n: int, length: int) -> Any:
        raise Unsupported("prefetch covers sample and sample_slices, not leased episodes")


def run_each(
    ctx: Context,
    scenario_name: str,
    classes: list[type[Adapter]],
    body: Callable[[Adapter, float, list[Row]], None],
    **kwargs: Any,
) -> list[Row]:
    """Run ``body(adapter, seconds to create it, rows)`` (it appends its rows) for each
    available implementation, one at a time (``kwargs`` go to the constructor). A missing or
    failing implementation becomes a note, never a crash; each buffer is closed and freed
    before the next one is created."""
    rows: list[Row] = []
    for cls in classes:
        reason = cls.missing()
        if reason:
            ctx.note(scenario_name, f"{cls.name} skipped: {reason}")
            continue
        gc.collect()
        adapter = None
        try:
            t0 = time.perf_counter()
            adapter = cls(tmpdir=ctx.tmpdir, **kwargs)
            body(adapter, time.perf_counter() - t0, rows)
        except Exception as exc:
            ctx.note(scenario_name, f"{cls.name} failed: {type(exc).__name__}: {exc}")
        finally:
            if adapter is not None:
                for text in adapter.notes:
                    ctx.note(scenario_name, f"{cls.name}: {text}")
                try:
                    adapter.close()
                except Exception as exc:
                    ctx.note(scenario_name, f"{cls.name} close failed: {exc}")
            del adapter
            gc.collect()
    return rows
