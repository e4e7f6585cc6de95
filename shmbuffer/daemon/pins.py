"""Rows pinned to the local writer that may still be copying into them.

A local writer copies rows itself, straight into the segment, after ``reserve`` handed them to
it. Aborting its reservation hands the rows to the next writer; if the first one was only
*stalled* (SIGSTOP, a debugger, swapping) and goes on copying, it overwrites rows another
writer has committed, and readers are served them as valid. So a reservation whose writer the
kernel vouches for (the lane's ``SO_PEERCRED``, :mod:`shmbuffer.daemon.processes`) is *pinned*
to that process: it is never aborted while the process lives — not when its
``reservation_ttl`` passes, not when the writer's connection closes, not across a daemon crash
and ``--resume`` — and a writer whose rows are pinned gets them back (commit or abort) from any
of its connections. Only when the process is gone does the reservation go, its rows never
published. A writer the transport does not vouch for (tcp, the ZeroMQ ipc socket, another pid
namespace) keeps the TTL rule; a remote writer's rows are written by the daemon itself, so it
is never pinned.

A pin whose writer's connection is gone (or that a resumed daemon found in its journal) is an
*orphan*: held for its process, owned by no client until one of that process commits or
aborts it by id. ``status`` lists pins past their TTL and orphans, with the writer's pid, and a
writer that must wait for pinned rows is told whose they are.

Pins are journaled (``RESERVE_PINNED`` and ``ABORT`` records, and every snapshot: see
``journal.py``) so that a resumed daemon pins what the dead one pinned.

Not thread-safe: the daemon loop serialises calls.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from shmbuffer.daemon.processes import Process, alive

Range = tuple[int, int]


@dataclass
class Pin:
    reservation: int
    process: Process
    ranges: list[Range]
    #: How its rows split into episodes, as the reserve asked: a count of equal ones, or
    #: their lengths (``Container.hold`` rebuilds the reservation from it).
    split: int | list[int]
    #: The tables its episodes go into, as a mask (``Container.members_mask``; 0: every one).
    tables: int = 0
    #: Monotonic time since which no client owns it (None: its writer's client does).
    orphaned: float | None = None
    #: Past its ``reservation_ttl`` and logged as such (once).
    overdue: bool = False

    @property
    def rows(self) -> int:
        return sum(stop - start for start, stop in self.ranges)

    def describe(self) -> str:
        return f"writer pid {self.process.pid} (reservation {self.reservation}, {self.rows} rows)"


class PinTable:
    """Pins by reservation id."""

    def __init__(self) -> None:
        self._pins: dict[int, Pin] = {}

    def __len__(self) -> int:
        return len(self._pins)

    def __iter__(self) -> Iterator[Pin]:
        return iter(self._pins.values())

    def get(self, reservation_id: int) -> Pin | None:
        return self._pins.get(reservation_id)

    def add(self, pin: Pin) -> None:
        self._pins[pin.reservation] = pin

    def pop(self, reservation_id: int) -> Pin | None:
        return self._pins.pop(reservation_id, None)

    def holds(self, reservation_id: int) -> bool:
        """Whether the reservation must be kept: pinned to a process that still runs."""
        pin = self._pins.get(reservation_id)
        return pin is not None and alive(pin.process)

    def orphans(self) -> list[Pin]:
        return [pin for pin in self._pins.values() if pin.orphaned is not None]

    def to_state(self) -> list[list[Any]]:
        """JSON-able, for the journal's snapshots: ``[id, pid, start, ranges, split,
        tables]``."""
        return [
            [p.reservation, p.process.pid, p.process.start, p.ranges, p.split, p.tables]
            for p in self._pins.values()
        ]


def pins_from_state(entries: list[list[Any]]) -> list[Pin]:
    """The pins a snapshot (and the journal after it) kept; see :meth:`PinTable.to_state`."""
    return [
        Pin(
            int(rid),
            Process(int(pid), int(start)),
            [(int(s), int(e)) for s, e in ranges],
            int(split) if isinstance(split, int) else [int(n) for n in split],
            int(tables[0]) if tables else 0,  # a snapshot from before tables has none
        )
        for rid, pid, start, ranges, split, *tables in entries
    ]
