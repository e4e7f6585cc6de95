"""The container across restarts: ``state()`` / ``from_state()`` and the journal's replay.

A state holds the registry, the ring, the sampler (its kind, settings and state), the limiter
counts and the generator's state, as plain values; the ``replay_*`` methods the journal calls
run the same code as the live requests (:mod:`shmbuffer.reservations`,
:mod:`shmbuffer.sampling`: that is why this part is built on both), so whatever a commit or
eviction does to the sampler is redone on ``--resume`` too, and :meth:`replay_sample` draws a
journaled sample again (the generator set as it was), so what samples changed (consumption,
epochs, ``max_times_sampled`` counts, the limiter's sampled count) comes back as well.
"""

from __future__ import annotations

import base64
import operator
from collections.abc import Mapping, Sequence
from typing import Any, Self

import numpy as np
import numpy.typing as npt

from shmbuffer.errors import ShmBufferError
from shmbuffer.registry import Episode, EpisodeRegistry
from shmbuffer.reservations import ReservationOps
from shmbuffer.ringstate import Range, SampleRecord
from shmbuffer.rows import episode_rows, slice_rows
from shmbuffer.samplers import RateLimiter, Sampler, make_rate_limiter, make_sampler
from shmbuffer.sampling import EPISODES, ROWS, SLICES, SamplingOps, set_rng_words


class PersistenceOps(ReservationOps, SamplingOps):
    """Saving and restoring the container, and redoing journaled changes on it."""

    def state(self) -> dict[str, Any]:
        """Everything a restart needs, open reservations aside (their rows are never
        published): ring, registry, sampler (its kind, settings and state), limiter counts and
        the generator's state. Plain values, JSON- and msgpack-able both: bytes travel as
        ``{"b64": ...}`` and integers beyond 64 bits (the generator's) as ``{"int": "..."}``."""
        return {
            "capacity": self.capacity,
            "unit": self.unit,
            "mode": self.mode,
            "pointer": self.pointer,
            "rows_written": self.rows_written,
            "next_reservation": self._next_reservation,
            "registry": self.registry.to_state(),
            "sampler": {
                "name": self.sampler.name,
                "settings": self.sampler.settings(),
                "state": encode_state(self.sampler.state_dict()),
            },
            "rate_limiter": {
                "name": self.rate_limiter.name,
                "settings": self.rate_limiter.settings(),
                "state": encode_state(self.rate_limiter.state_dict()),
            },
            "rng": encode_state(self.rng.bit_generator.state),
            "priority_updates": self.priority_updates,
            "priority_updates_stale": self.priority_updates_stale,
        }

    @classmethod
    def from_state(
        cls,
        state: Mapping[str, Any],
        *,
        sampler: Sampler | None = None,
        rate_limiter: RateLimiter | None = None,
    ) -> Self:
        """A container in ``state``. ``sampler``/``rate_limiter`` None: the saved kinds with
        their saved settings (uniform / no limit for a state saved before samplers existed).
        ValueError (KeyError, TypeError) when the state is inconsistent."""
        saved = state.get("sampler") or {}
        if sampler is None and "name" in saved:
            sampler = make_sampler(saved["name"], **dict(saved.get("settings") or {}))
        limiter = state.get("rate_limiter") or {}
        if rate_limiter is None and "name" in limiter:
            rate_limiter = make_rate_limiter(limiter["name"], **dict(limiter.get("settings") or {}))
        container = cls(
            operator.index(state["capacity"]),
            mode=state["mode"],
            unit=state["unit"],
            sampler=sampler,
            rate_limiter=rate_limiter,
        )
        container.load_state(state)
        return container

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Take over ``state`` (see :meth:`state`); open reservations are dropped and use
        counters restart at 0 for every committed row, or take ``state["use_counts"]`` (an
        array, what the dead daemon's counter file held: see :meth:`adopt_use_counts`) when
        it is there. ValueError when it does not fit this
        container (capacity, unit, mode, another sampler kind) or is inconsistent; checked
        before anything changes, except a sampler state that fails its own checks (the owner
        discards the container then). A different limiter kind keeps the saved counts."""
        for key in ("capacity", "unit", "mode"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"saved state is capacity={state['capacity']} unit={state['unit']} "
                    f"mode={state['mode']}, the buffer is capacity={self.capacity} "
                    f"unit={self.unit} mode={self.mode}"
                )
        registry = EpisodeRegistry.from_state(state["registry"])
        saved = state.get("sampler") or {}
        if "name" in saved and saved["name"] != self.sampler.name:
            raise ValueError(
                f"saved state is for the {saved['name']!r} sampler, this buffer's is "
                f"{self.sampler.name!r}: resume or restore with the same sampler"
            )
        # A checkpoint written before samplers existed kept the generator under "sampler".
        rng = state.get("rng", saved.get("rng"))
        self.registry = registry
        self.reservations.clear()
        self.pointer = operator.index(state["pointer"])
        self.rows_written = operator.index(state["rows_written"])
        self._next_reservation = operator.index(state["next_reservation"])
        self.travelled = 0
        self.use_counts[:] = -1
        for ep in registry:
            self.use_counts[ep.start : ep.end] = 0
        if state.get("use_counts") is not None:
            self.adopt_use_counts(state["use_counts"])
        self.sampler.attach(registry, self.unit, self.capacity)
        if "state" in saved:
            self.sampler.load_state_dict(decode_state(saved["state"]))
        limiter = state.get("rate_limiter") or {}
        counts: dict[str, Any] = {"inserted": registry.num_rows, "sampled": 0, "deleted": 0}
        if "state" in limiter:
            counts = decode_state(limiter["state"])
        self.rate_limiter.load_state_dict({**counts, "limiter": self.rate_limiter.name})
        if rng is not None:
            self.rng.bit_generator.state = decode_state(rng)
        self.priority_updates = int(state.get("priority_updates", 0))
        self.priority_updates_stale = int(state.get("priority_updates_stale", 0))

    def adopt_use_counts(self, saved: npt.ArrayLike) -> None:
        """Take the use counters a dead daemon left (its counter file, written in place by
        every read): kept for every committed row, -1 elsewhere. The registry is what the
        journal replayed, the state of the last acknowledged request, so a row the file
        still counts but no episode holds (an unacknowledged reservation's) goes back to -1.
        ValueError for a wrong size."""
        counts = np.asarray(saved)
        if counts.shape != (self.capacity,):
            raise ValueError(f"use counts of shape {counts.shape}, the ring has {self.capacity}")
        committed = self.use_counts >= 0
        self.use_counts[committed] = np.maximum(counts[committed], 0)

    # -- journal replay: the same code as the live requests, without their checks ---------

    def replay_reserve(
        self, evicted: Sequence[Range], pointer: int, rows_written: int, next_reservation: int
    ) -> None:
        """Redo a reservation: evict ``evicted`` (telling sampler and limiter) and move the
        ring to where it stood after it. No reservation is opened: its rows were never
        committed, so they are never published."""
        self._evict_ranges(evicted, [])
        self.pointer, self.rows_written = pointer, rows_written
        self._next_reservation = next_reservation

    def replay_commit(self, episodes: Sequence[tuple[int, int, int]]) -> None:
        """Redo a commit of ``(id, start, end)`` episodes (one reservation's); ValueError if
        the registry hands out other ids (the journal does not fit this state). Priorities a
        writer gave are journaled apart and come back through :meth:`replay_priorities`."""
        published: list[Episode] = []
        num_rows = 0
        for episode_id, start, end in episodes:
            got = self.registry.add(start, end)
            if got != episode_id:
                raise ValueError(f"replayed episode got id {got}, journal says {episode_id}")
            self.use_counts[start:end] = 0
            published.append(Episode(got, start, end))
            num_rows += end - start
        self._published(published, None, num_rows)

    def replay_restore(self, episodes: Sequence[Episode], pointer: int, rows_written: int) -> None:
        """Redo an abort that published ``episodes`` again (see :meth:`abort`)."""
        self.restore(episodes)
        self.pointer, self.rows_written = pointer, rows_written

    def replay_clear(self, pointer: int) -> None:
        self.clear()
        self.pointer = pointer

    def replay_priorities(self, rows: npt.ArrayLike, priority: npt.ArrayLike) -> int:
        """Redo a priority update (stale rows were already left out when it was journaled)."""
        return self.update_priorities(rows, priority)

    def replay_sample(self, draw: SampleRecord) -> bool:
        """Redo a journaled draw (:class:`~shmbuffer.ringstate.SampleRecord`): the generator set to
        ``rng`` when given, the sampler asked again (its consumption, epochs and counts
        move as they did), the limiter told ``handed`` rows (exact, whatever the draw)
        and the use counters the rows drawn. The limiter is not asked: the live draw was
        admitted.

        True when the draw went as journaled (refused or not; as many rows). Samplers whose
        draws change state draw the same again (their contract); others, say uniform draws
        through a registry laid out otherwise after a resume, may not, and need not."""
        call, n, length, strict, handed, refused, rng = draw
        if rng is not None:
            set_rng_words(self.rng, rng)
        sampler = self.sampler
        try:
            if call == ROWS:
                rows = sampler.sample_rows(n, self.rng).rows
                got = rows.size
            elif call == EPISODES:
                episodes = sampler.sample_episodes(n, self.rng)
                rows = episode_rows(episodes.starts, episodes.ends - episodes.starts)
                got = rows.size
            elif call == SLICES:
                sliced = sampler.sample_slices(n, length, self.rng, strict)
                rows = slice_rows(sliced.starts, length)
                if not strict:  # the real rows only, as the live draw counted them
                    real = np.arange(length) < sliced.lengths[:, None]
                    rows = rows[real.reshape(-1)]
                got = n * length
            else:
                raise ValueError(f"unknown sample call {call}")
        except (ShmBufferError, ValueError, IndexError):
            sampler.changed_on_refusal = False
            self.rng_unlogged = sampler.uses_rng
            if not refused:  # the live draw handed rows out: the limiter counts them anyway
                self.rate_limiter.on_sample(handed)
            return refused
        self.rate_limiter.on_sample(handed)
        self.count_use(rows)
        return not refused and got == handed


def encode_state(value: Any) -> Any:
    """``value`` with bytes as ``{"b64": str}`` and ints outside int64 as ``{"int": str}``, so
    it fits JSON (the journal's snapshot) and msgpack alike; :func:`decode_state` undoes it."""
    if isinstance(value, bytes | bytearray | memoryview):
        return {"b64": base64.b64encode(value).decode("ascii")}
    if isinstance(value, bool | float | str) or value is None:
        return value
    if isinstance(value, int | np.integer):
        value = int(value)
        return value if -(2**63) <= value < 2**63 else {"int": str(value)}
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, Mapping):
        return {str(k): encode_state(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [encode_state(v) for v in value]
    raise TypeError(f"cannot save a {type(value).__name__} in a container state")


def decode_state(value: Any) -> Any:
    if isinstance(value, Mapping):
        if len(value) == 1 and "b64" in value:
            return base64.b64decode(value["b64"])
        if len(value) == 1 and "int" in value:
            return int(value["int"])
        return {k: decode_state(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_state(v) for v in value]
    return value
