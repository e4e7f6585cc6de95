"""A ring listener that keeps the ring's live runs published for readers that draw rows
themselves (``registry/shared_spans.py``), and says whether they may.

Told that rows stopped being live (each evicted range, a clear) or changed otherwise (a
restore, a load) it publishes the runs at once, inside the ring's call: an eviction is
therefore published before the ring's ``reserve`` returns, so before its owner bumps the
reserved rows' stamps and hands them to a writer. That order is what makes a reader's draw safe
(``docs/architecture.md``, "Why it is safe"). Rows that become live (a commit) may wait: the
runs published meanwhile hold only live rows, fewer than there are. So a commit only marks the
publication ``stale``, and the owner calls :meth:`SpansPublisher.flush` once its request is
done: a writer's reserve that commits its previous write first (the usual case) publishes
once, at its eviction, instead of twice.

Whether readers may draw themselves is the table's to say, published with the runs: its
sampler must draw rows uniformly over the runs and change nothing
(``Sampler.rows_uniform_over_spans``), and its rate limiter must decide by the stored size
alone (``RateLimiter.samples_by_size``) and admit a sample now. Its owner calls
:meth:`SpansPublisher.publish` itself after anything else that changes that answer (a
limiter's settings).

Calling rule: a :class:`~shmbuffer.ring.listeners.RingListener`'s; a publication is a handful of
word stores into a mapped file, no system call.
"""

from __future__ import annotations

from collections.abc import Sequence

from shmbuffer.registry.intervals import Episode
from shmbuffer.registry.shared_spans import SpansFile
from shmbuffer.ring.listeners import F64, Range, RingListener
from shmbuffer.ring.members import Members
from shmbuffer.ring.ring import Ring
from shmbuffer.ring.table import Table


class SpansPublisher(RingListener):
    """Publishes ``table``'s ring's live runs into ``out`` after every change, from now on
    (it listens to the ring, after the tables made before it, and publishes once now)."""

    def __init__(self, table: Table, out: SpansFile) -> None:
        self.table = table
        self.ring: Ring = table.ring
        self.out = out
        #: Rows were committed since the last publication (see :meth:`flush`).
        self.stale = False
        #: Whether readers may ever draw over this table's runs: its sampler and its
        #: limiter's kind do not change. If not, the file says so once and is left alone.
        self.eligible = table.sampler.rows_uniform_over_spans and table.rate_limiter.samples_by_size
        self.ring.listen(self)
        self.publish()

    def open(self) -> bool:
        """Whether a reader may draw rows itself now (see the module docstring)."""
        return self.eligible and self.table.rate_limiter.can_sample(1)

    def publish(self) -> None:
        """Publish the registry's runs as they are now."""
        registry = self.table.registry  # the episodes its table holds, no other
        starts, ends = registry.spans.runs()
        self.out.publish(starts, ends, registry.num_rows, self.open())
        self.stale = False

    def flush(self) -> None:
        """Publish the commits not published yet (the owner's call after a request)."""
        if self.stale:
            self.publish()

    def on_commit(
        self,
        episodes: Sequence[Episode],
        ranges: Sequence[Range],
        priority: F64 | None,
        members: Members = None,
    ) -> None:
        self.stale = self.eligible

    def on_evict(self, start: int, stop: int, evicted: Sequence[Episode], rows: int) -> None:
        if self.eligible:
            self.publish()

    def on_restore(self, episodes: Sequence[Episode], rows: int) -> None:
        if self.eligible:
            self.publish()

    def on_clear(self, rows: int) -> None:
        if self.eligible:
            self.publish()

    def on_load(self) -> None:
        self.publish()
