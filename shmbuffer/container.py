"""Where the next rows go and which rows a read gets: the container, one object over its parts.

The container is metadata only. It never touches row data, so the same object serves the
in-process :class:`~shmbuffer.Buffer` (which copies right after reserving) and the daemon
(whose writers copy in their own processes between ``reserve`` and ``commit``).

:class:`Container` is its jobs together, each a module of its own over one shared state (the
daemon's service is split the same way):

- :mod:`shmbuffer.ringstate`: the fields they share (ring pointer, modes, units, registry,
  sampler, rate limiter, generator, use counters, open reservations) and the sizes;
- :mod:`shmbuffer.reservations`: two-phase writing (``reserve`` / ``commit`` / ``abort``),
  eviction, ``restore`` and ``clear``, each telling the sampler and the limiter;
- :mod:`shmbuffer.sampling`: ``sample_rows`` / ``sample_episodes`` / ``sample_slices``,
  priority updates, use counts, the limiter's ``sample_blocker``, ``rank_rows``, stats;
- :mod:`shmbuffer.persistence`: ``state()`` / ``from_state()`` and the ``replay_*`` methods
  the journal calls, running the same code as live requests.

This module also hands on the few names of those parts that its importers use (they need not
know the split).

Not thread-safe: the owner (buffer or daemon loop) serialises calls.
"""

from __future__ import annotations

from shmbuffer.persistence import PersistenceOps, decode_state
from shmbuffer.ringstate import Plan, Range, Reservation, SampleRecord, as_invalid_argument
from shmbuffer.sampling import EpisodeSample, RowSample, SliceSample

__all__ = [
    "Container",
    "EpisodeSample",
    "Plan",
    "Range",
    "Reservation",
    "RowSample",
    "SampleRecord",
    "SliceSample",
    "as_invalid_argument",
    "decode_state",
]


class Container(PersistenceOps):
    """The ring of ``capacity`` rows; see the module docstring.

    ``mode``: ``"circular"`` or ``"fixed"``; ``unit``: ``"transition"`` or ``"episode"``.
    ``sampler``: a :class:`~shmbuffer.samplers.Sampler` (None: uniform), ``rate_limiter`` a
    :class:`~shmbuffer.samplers.RateLimiter` (None: no limit); both belong to this container
    from now on. ``seed`` seeds ``rng``, the generator every draw uses.
    """
