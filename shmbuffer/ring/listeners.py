"""Who hears what the ring and its tables do: the two listener contracts and what they carry.

:class:`RingListener` is told every change of the ring's registry (rows committed, evicted,
restored, cleared, a saved state loaded) and asked, before a reservation, whether it must wait
(Reverb's ``TableExtension`` ``OnInsert/OnDelete/OnReset`` and its rate limiter's
``AwaitCanInsert``, as one contract). A :class:`~shmbuffer.ring.table.Table` is one: it tells its
sampler and rate limiter, and keeps its use counts. :class:`SampleLog` is told every draw a
table hands out (Reverb's ``OnSample``): the daemon's journal, so that a resumed daemon draws
them again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from shmbuffer.registry.intervals import Episode
from shmbuffer.ring.members import Members

#: Physical rows ``[start, stop)`` of the ring.
Range = tuple[int, int]
F64 = npt.NDArray[np.float64]

#: The kinds of draw a :class:`SampleLog` is told (journaled as numbers).
ROWS, EPISODES, SLICES = 0, 1, 2
_U64 = (1 << 64) - 1


class RingListener:
    """What a :class:`~shmbuffer.ring.ring.Ring` tells the parts that keep state about its rows.

    Register with :meth:`Ring.listen <shmbuffer.ring.ring.Ring.listen>`; listeners are told in the
    order they registered. The defaults do nothing: a listener overrides what it needs.

    Calling rule:

    - The ring's owner (the in-process ``Buffer``, the daemon loop) serialises every call, so
      a listener takes no locks. It never blocks, sleeps or does I/O that can stall (a file
      append the owner made room for first is fine): the owner is serving everyone else.
    - :meth:`insert_blocker` is asked while a reservation is planned, before anything
      changed; it must change nothing, and may be asked again for the same reservation or for
      one that never happens.
    - Every ``on_*`` is told after the ring's registry made the change, so the listener
      reads the registry as it is now (``ring.registry``). The ring checked everything it
      could refuse before changing anything: a notification is never refused, and a
      listener that raises leaves the ring changed and the listeners after it untold.
    - A listener reads the ring; it never changes it (no ``reserve``, ``commit``, ``abort``,
      ``restore`` or ``clear`` from inside a notification), and treats the lists it is given
      as read-only.
    """

    def insert_blocker(
        self, num_rows: int, evict: Sequence[Range], members: Members = None
    ) -> str | None:
        """Why a reservation of ``num_rows`` rows that evicts ``evict`` (the rows it would
        take) going into the tables ``members`` (None: every one) must wait now, or None:
        flow control that must answer before the rows are handed out (a rate limiter's insert
        side, for the tables the rows go into; rows a consuming reader still has to read,
        whichever tables the new rows go into). The ring puts the first reason in the
        reservation's ``Plan.blocked``."""
        return None

    def on_commit(
        self,
        episodes: Sequence[Episode],
        ranges: Sequence[Range],
        priority: F64 | None,
        members: Members = None,
    ) -> None:
        """``episodes`` were published (ids increasing), over the physical ``ranges`` they
        fill together, into the tables ``members`` names by key (None: every table; see
        below). ``priority``: None (no priority given), or one checked value per item (per
        row in transition unit, per episode in episode unit) for the tables that keep
        priorities; the committer checked it against them before the commit."""

    def on_evict(self, start: int, stop: int, evicted: Sequence[Episode], rows: int) -> None:
        """Rows ``[start, stop)`` no longer hold committed data: ``evicted`` lists the
        episodes dropped whole, with their bounds (which may reach past the range: an early
        wrap's skipped tail, a chunk overlapped at its end), and ``rows`` counts the rows that
        stopped holding data. A chunk the range only trimmed at its front stays in the
        registry with its new bounds. Told once per evicted range in which anything was live,
        in the order the ring took them."""

    def on_restore(self, episodes: Sequence[Episode], rows: int) -> None:
        """``episodes`` are published again under their old ids (an aborted reservation gave
        back what it evicted; a trimmed chunk got its front rows back); ``rows`` count the
        rows that hold data again."""

    def on_clear(self, rows: int) -> None:
        """Every committed row is gone (``rows`` of them)."""

    def on_load(self) -> None:
        """The ring took a saved state: its registry is a new object whose episodes this
        listener never heard of, and no reservation is open. Start over from it."""


# Tables over one ring, and which of them hold an episode (``ring/members.py``):
#
# - A commit goes into the tables its ``members`` name (keys, a table's name), every one for
#   None; every episode of one commit into the same ones. The ring records it
#   (``Ring.members_of``) until no abort can bring the episode back.
# - A table hears every change, and keeps only what is its own: it tells its sampler, its
#   limiter (inserted, deleted, restored, sampled rows) and its use counts of the episodes it
#   holds and nothing else, so its sizes, a FIFO's queue and a sum tree's mass hold its
#   episodes exactly. An eviction, a restore, a clear or a load reaches it as for any
#   listener; it sorts out its own episodes (a restore by ``Ring.members_of``).
# - A table that does not hold every live episode keeps a registry of those it holds
#   (``Table.registry``), which its sampler draws over: a uniform table's row draws over its
#   own runs of rows, a filter or bounds selection intersected with it.
# - Rows are reused only once every table that holds them lets them go: a consume-once
#   table's ``insert_blocker`` asks its sampler about the rows evicted, which holds only its
#   own, so a table that does not hold an episode never holds back the write over it.


class SampleRecord(NamedTuple):
    """A draw that changed state, as a log records it and a replay redoes it: ``call`` (ROWS,
    EPISODES or SLICES) of ``n`` items (slices of ``length`` rows, ``strict``) handed out
    ``handed`` rows (the limiter's count), or was ``refused`` yet changed the sampler (a
    FIFO's drops). ``rng``: the generator's state before the draw as :func:`rng_words`, when a
    refused draw may have moved it since the last record (None: where the previous record's
    draw left it)."""

    call: int
    n: int
    length: int
    strict: bool
    handed: int
    refused: bool
    rng: Sequence[int] | None


class SampleLog(Protocol):
    """Who hears of every sample a table hands out (the daemon's journal, so that a resumed
    daemon redoes them; see ``daemon/journal.py``): a table's listener, registered with
    :meth:`Table.listen <shmbuffer.ring.table.Table.listen>`. Called with the owner's calls
    serialised, as a :class:`RingListener` is."""

    def room_for_sample(self, n: int) -> None:
        """Before a draw of ``n`` items changes anything: make room for what it will record
        (OutOfSpaceError refuses the sample with nothing changed)."""

    def sampled(self, draw: SampleRecord) -> None:
        """``draw`` changed state; called before its rows are handed out."""


def rng_words(rng: np.random.Generator) -> list[int] | None:
    """The generator's state as six int64 words (PCG64's state and increment, 128 bits each,
    and its buffered 32-bit half); None for another bit generator. Not cheap next to a
    draw: taken only when a refused draw may have moved it."""
    state = rng.bit_generator.state
    if state.get("bit_generator") != "PCG64":
        return None
    words = [state["state"]["state"], state["state"]["inc"]]
    split = [part for w in words for part in (w & _U64, w >> 64)]
    return [v - (1 << 64) if v >= 1 << 63 else v for v in split] + [
        int(state["has_uint32"]),
        int(state["uinteger"]),
    ]


def set_rng_words(rng: np.random.Generator, words: Sequence[int]) -> None:
    """Undo :func:`rng_words` into ``rng`` (a PCG64 generator); ValueError if they do not fit."""
    if len(words) != 6 or rng.bit_generator.state.get("bit_generator") != "PCG64":
        raise ValueError(f"generator state of {len(words)} words does not fit this generator")
    u = [int(w) & _U64 for w in words[:4]]
    rng.bit_generator.state = {
        "bit_generator": "PCG64",
        "state": {"state": u[0] | u[1] << 64, "inc": u[2] | u[3] << 64},
        "has_uint32": int(words[4]),
        "uinteger": int(words[5]) & 0xFFFFFFFF,
    }
