"""The rate limiter contract: may an insert of n rows, or a sample of n rows, proceed now?

Locking rule: like the samplers, a limiter is called by the container's owner with calls
serialised (the daemon loop, or an in-process Buffer's caller). It never blocks: the owner
asks ``can_insert`` / ``can_sample``, parks a refused request (inserts and samples in separate
queues, so a parked sample never holds up the insert that would let it through), retries when
counts change, and reports ``blocked_reason()`` in the ``WaitTimeoutError`` of a request that
waited past its deadline. Each check is O(1).

Counts are in rows: ``inserted`` rows committed, ``sampled`` rows handed out (a slice of L rows
counts L), ``deleted`` rows evicted; ``size = inserted - deleted``. The owner calls
``on_insert`` / ``on_sample`` / ``on_delete`` when each happens, and ``on_restore`` when an
aborted reservation publishes evicted rows again.

SampleToInsertRatio (Reverb's, counted in rows): with ratio ``R``, min size ``N`` and error
buffer ``E``, ``diff = inserted * R - sampled`` must stay in ``[R*N - E, R*N + E]``:

* a sample of n rows may proceed while ``size >= N`` (nothing samples before N rows exist)
  and ``diff - n >= R*N - E`` (Reverb's check, after the sample);
* an insert of n rows may proceed while ``size < N`` (samplers cannot run yet, so blocking it
  would deadlock), or ``(inserted + n) * R - sampled <= R*N + E`` (it fits the window), or
  ``diff < R*N - E + S`` with ``S`` the largest sample request seen (initially 1): then some
  sample of the size readers use cannot proceed, so the insert must, whatever its size.

The last rule is the rows-for-items difference. Reverb counts items, one at a time, so every
request fits a window of ``2E >= 2 * max(1, R)``; one reservation of rows can be larger than
the window, and then it is admitted at the window's lower edge, overshooting the upper edge by
at most its own size. No request can then wait on another forever: whenever a sample of size
``<= S`` is refused (``diff < R*N - E + size``), every insert is admitted. Validation follows
Reverb: ``samples_per_insert > 0``, ``min_size >= 0``, ``error_buffer >= max(1, R)``
(smaller windows could block single-row requests on both sides).

MinSize(N): samples wait until ``size >= N``; inserts always proceed. NoLimit: both always.

A limiter is bound to its buffer's capacity (:meth:`RateLimiter.bind`): a ``min_size`` above
it could never be met, so every sample would wait forever; it is refused when bound and by
every later :meth:`RateLimiter.configure`.
"""

from __future__ import annotations

import math
import operator
from abc import ABC, abstractmethod
from typing import Any, ClassVar

__all__ = ["MinSize", "NoLimit", "RateLimiter", "SampleToInsertRatio"]


def _min_size(value: int) -> int:
    if isinstance(value, bool):
        raise TypeError(f"min_size must be an int, got {value!r}")
    value = operator.index(value)
    if value < 0:
        raise ValueError(f"min_size must be >= 0, got {value}")
    return value


def _check_fits(min_size: Any, capacity: int) -> None:
    """A ``min_size`` above ``capacity`` rows is never met: refused (any other bad value is
    left to the limiter's own checks)."""
    if type(min_size) is int and min_size > capacity:
        raise ValueError(
            f"min_size={min_size} is above the buffer's capacity of {capacity} rows: samples "
            "would wait for more rows than it can ever hold"
        )


def _rows(n: int, what: str) -> int:
    n = operator.index(n)
    if n < 0:
        raise ValueError(f"{what} must be >= 0 rows, got {n}")
    return n


class RateLimiter(ABC):
    """Admission of inserts and samples by row counts; see the module docstring."""

    name: ClassVar[str]
    #: Options ``configure`` accepts for this limiter.
    options: ClassVar[tuple[str, ...]] = ()
    #: Whether its decisions depend on the sampled count (then the daemon journals every
    #: sample, so a resume keeps the count exactly; otherwise it is a figure for ``status``).
    counts_samples: ClassVar[bool] = False
    #: Whether ``can_insert`` depends on the rows asked for (then the owner adds the rows
    #: reserved and not committed yet: inserts are counted at commit).
    bounds_inserts: ClassVar[bool] = False
    #: Whether ``can_sample`` depends on the stored size alone, never on the rows asked for
    #: nor on what was sampled: then its answer changes only when rows come and go (or its
    #: settings do), and a reader that draws rows itself may go by the answer the daemon
    #: published with the live rows (``registry/shared_spans.py``).
    samples_by_size: ClassVar[bool] = False

    def __init__(self) -> None:
        #: The rows its buffer can hold (:meth:`bind`); None until bound.
        self.capacity: int | None = None
        self.inserted = 0
        self.sampled = 0
        self.deleted = 0
        #: Seconds requests spent parked; the owner adds to them (``record_blocked``).
        self.insert_blocked_s = 0.0
        self.sample_blocked_s = 0.0

    @property
    def size(self) -> int:
        return self.inserted - self.deleted

    @abstractmethod
    def can_insert(self, n: int) -> bool: ...

    @abstractmethod
    def can_sample(self, n: int) -> bool: ...

    def on_insert(self, n: int) -> None:
        self.inserted += _rows(n, "inserted")

    def on_sample(self, n: int) -> None:
        self.sampled += _rows(n, "sampled")

    def on_delete(self, n: int) -> None:
        self.deleted += _rows(n, "deleted")

    def on_restore(self, n: int) -> None:
        """``n`` rows counted deleted hold data again: an aborted reservation published back
        what it evicted. Not an insert: the ratio counts what writers added, once."""
        self.deleted -= min(_rows(n, "restored"), self.deleted)

    def record_blocked(self, kind: str, seconds: float) -> None:
        """Add ``seconds`` a parked ``"insert"`` or ``"sample"`` request waited."""
        if kind == "insert":
            self.insert_blocked_s += float(seconds)
        elif kind == "sample":
            self.sample_blocked_s += float(seconds)
        else:
            raise ValueError(f"kind must be 'insert' or 'sample', got {kind!r}")

    def blocked_reason(self) -> str:
        """One line naming the limiter, its settings and counts (for WaitTimeoutError)."""
        settings = ", ".join(f"{k}={v}" for k, v in self.settings().items())
        return (
            f"rate limiter {self.name}({settings}): inserted={self.inserted} "
            f"sampled={self.sampled} deleted={self.deleted} size={self.size}"
        )

    def settings(self) -> dict[str, Any]:
        return {}

    def bind(self, capacity: int) -> None:
        """Serve a buffer of ``capacity`` rows; ValueError, changing nothing, where its
        ``min_size`` could never be met there."""
        _check_fits(self.settings().get("min_size"), capacity)
        self.capacity = capacity

    def configure(self, **options: Any) -> None:
        """Change settings live (counts are kept); ValueError, changing nothing, if one is
        unknown for this limiter, out of range, or a ``min_size`` above the capacity."""
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            allowed = ", ".join(self.options) or "none"
            raise ValueError(f"rate limiter {self.name} has no option {unknown}; it has: {allowed}")
        if self.capacity is not None:
            _check_fits(options.get("min_size"), self.capacity)
        self._configure(**{**self.settings(), **options})

    def _configure(self, **options: Any) -> None:  # noqa: B027 (no settings: nothing to do)
        """Validate and apply a complete set of settings, all or nothing."""

    def state_dict(self) -> dict[str, Any]:
        return {
            "limiter": self.name,
            "settings": self.settings(),
            "inserted": self.inserted,
            "sampled": self.sampled,
            "deleted": self.deleted,
            "insert_blocked_s": self.insert_blocked_s,
            "sample_blocked_s": self.sample_blocked_s,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counts; settings stay as configured (the command line wins on restart)."""
        if state.get("limiter") != self.name:
            raise ValueError(f"limiter state is for {state.get('limiter')!r}, not {self.name!r}")
        counts = [_rows(state[k], k) for k in ("inserted", "sampled", "deleted")]
        if counts[2] > counts[0]:
            raise ValueError("limiter state deletes more rows than it inserted")
        self.inserted, self.sampled, self.deleted = counts
        self.insert_blocked_s = float(state.get("insert_blocked_s", 0.0))
        self.sample_blocked_s = float(state.get("sample_blocked_s", 0.0))

    def stats(self) -> dict[str, Any]:
        return {
            "limiter": self.name,
            **self.settings(),
            "inserted": self.inserted,
            "sampled": self.sampled,
            "deleted": self.deleted,
            "size": self.size,
            "insert_blocked_s": self.insert_blocked_s,
            "sample_blocked_s": self.sample_blocked_s,
        }


class NoLimit(RateLimiter):
    """Every request proceeds; counts are kept for ``status``."""

    name = "none"
    samples_by_size = True

    def can_insert(self, n: int) -> bool:
        return True

    def can_sample(self, n: int) -> bool:
        return True


class MinSize(RateLimiter):
    """Samples wait until ``min_size`` rows are stored."""

    name = "min-size"
    options = ("min_size",)
    samples_by_size = True

    def __init__(self, min_size: int = 1) -> None:
        super().__init__()
        self.min_size = _min_size(min_size)

    def can_insert(self, n: int) -> bool:
        return True

    def can_sample(self, n: int) -> bool:
        return self.size >= self.min_size

    def settings(self) -> dict[str, Any]:
        return {"min_size": self.min_size}

    def _configure(self, **options: Any) -> None:
        self.min_size = _min_size(options["min_size"])


class SampleToInsertRatio(RateLimiter):
    """Reverb's samples-per-insert window, in rows; see the module docstring for the maths."""

    name = "sample-to-insert"
    options = ("samples_per_insert", "min_size", "error_buffer")
    counts_samples = True
    bounds_inserts = True

    def __init__(self, samples_per_insert: float, min_size: int, error_buffer: float) -> None:
        super().__init__()
        self.largest_sample = 1
        self._configure(
            samples_per_insert=samples_per_insert, min_size=min_size, error_buffer=error_buffer
        )

    def _configure(self, **options: Any) -> None:
        ratio = float(options["samples_per_insert"])
        if not math.isfinite(ratio) or ratio <= 0:
            raise ValueError(f"samples_per_insert must be finite and > 0, got {ratio!r}")
        min_size = _min_size(options["min_size"])
        error = float(options["error_buffer"])
        if not math.isfinite(error) or error < max(1.0, ratio):
            raise ValueError(
                f"error_buffer must be >= max(1, samples_per_insert) = {max(1.0, ratio):g}, "
                f"got {error!r}: a smaller window could block single-row inserts or samples"
            )
        self.samples_per_insert, self.min_size, self.error_buffer = ratio, min_size, error

    @property
    def diff(self) -> float:
        return self.inserted * self.samples_per_insert - self.sampled

    @property
    def min_diff(self) -> float:
        return self.samples_per_insert * self.min_size - self.error_buffer

    @property
    def max_diff(self) -> float:
        return self.samples_per_insert * self.min_size + self.error_buffer

    def can_sample(self, n: int) -> bool:
        n = _rows(n, "sample")
        self.largest_sample = max(self.largest_sample, n)
        return self.size >= self.min_size and self.diff - n >= self.min_diff

    def can_insert(self, n: int) -> bool:
        n = _rows(n, "insert")
        if self.size < self.min_size:
            return True
        if (self.inserted + n) * self.samples_per_insert - self.sampled <= self.max_diff:
            return True
        return self.diff < self.min_diff + self.largest_sample

    def on_sample(self, n: int) -> None:
        super().on_sample(n)
        self.largest_sample = max(self.largest_sample, n)

    def settings(self) -> dict[str, Any]:
        return {
            "samples_per_insert": self.samples_per_insert,
            "min_size": self.min_size,
            "error_buffer": self.error_buffer,
        }

    def blocked_reason(self) -> str:
        return (
            f"{super().blocked_reason()} diff={self.diff:g} "
            f"window=[{self.min_diff:g}, {self.max_diff:g}]"
        )

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "largest_sample": self.largest_sample}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.largest_sample = max(1, _rows(state.get("largest_sample", 1), "largest_sample"))

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "diff": self.diff}
