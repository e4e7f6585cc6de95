"""A container's saved state: what a restart rebuilds it from, in the one format the journal's
snapshot (``state.json``) and a checkpoint both write, and where each table's use counters are
kept between daemons.

:func:`container_state` takes the state (:meth:`Container.state`: ring, registry, every
table's sampler, limiter and generator, plus the daemon's counters), :func:`restore_container`
rebuilds a container from it, refusing another format or a state that does not fit with
:class:`~shmbuffer.errors.JournalError`. ``journal.py`` hands these names on.
"""

from __future__ import annotations

from typing import Any

from shmbuffer.errors import JournalError
from shmbuffer.ring.container import Container
from shmbuffer.samplers import RateLimiter, Sampler

USE_COUNTS_FILE = "use_counts.bin"
STATE_FORMAT = 1


def use_counts_file(container: Container, name: str) -> str:
    """The file of table ``name``'s use counters: ``use_counts.bin`` for the default table
    (where it always was), ``use_counts.<name>.bin`` for another."""
    return (
        USE_COUNTS_FILE if container.tables[name] is container.table else f"use_counts.{name}.bin"
    )


def container_state(container: Container, counters: dict[str, int] | None = None) -> dict[str, Any]:
    """What a restart needs to rebuild ``container`` (:meth:`Container.state`: ring, registry,
    sampler, limiter, generator), plus the daemon's counters; JSON-able."""
    return {"format": STATE_FORMAT, **container.state(), "counters": dict(counters or {})}


def restore_container(
    state: dict[str, Any],
    container: Container | None = None,
    *,
    sampler: Sampler | None = None,
    rate_limiter: RateLimiter | None = None,
) -> Container:
    """A container in ``state`` with no open reservation (use counters restart at 0 for every
    committed row): ``container`` updated in place (its sampler must be of the saved kind), or
    a new one with ``sampler``/``rate_limiter`` (None: the saved kinds and settings)."""
    if state.get("format") != STATE_FORMAT:
        raise JournalError(f"state format {state.get('format')!r}, expected {STATE_FORMAT}")
    try:
        if container is None:
            return Container.from_state(state, sampler=sampler, rate_limiter=rate_limiter)
        container.load_state(state)
    except (KeyError, TypeError, ValueError) as exc:
        raise JournalError(f"saved state does not fit: {exc}") from exc
    return container
