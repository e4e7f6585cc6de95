"""The daemon's counters, the insert/sample rates and the per-client figures that
``shmbuffer-daemon status`` shows."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from shmbuffer.daemon.clients import Client

RATE_WINDOW_S = 3.0  # rates are averaged over the last few seconds, up to "now"


@dataclass
class Counters:
    rows_committed: int = 0
    episodes_committed: int = 0
    rows_sampled: int = 0
    samples: int = 0
    messages: int = 0
    errors: int = 0
    reservations_expired: int = 0
    leases_expired: int = 0
    clients_reaped: int = 0  # local clients whose process died (found by the pid check)
    clients_expired: int = 0  # clients dropped after client_idle_ttl with nothing open
    rows_rewritten: int = 0  # committed rows changed in place (daemon/rewrites.py)

    def restore(self, saved: Mapping[str, Any]) -> None:
        """Take the values of a snapshot or checkpoint (``persistent_state``); a counter it
        does not know (an older or newer version's) is left out, one it lacks stays as is."""
        for name, value in saved.items():
            if name in self.__dataclass_fields__:
                setattr(self, name, int(value))


class RateMeter:
    """Rows committed and sampled per second, from snapshots taken about once a second."""

    def __init__(self) -> None:
        self._snapshots: deque[tuple[float, int, int]] = deque(maxlen=11)

    def tick(self, now: float, counters: Counters) -> None:
        if not self._snapshots or now - self._snapshots[-1][0] >= 1.0:
            self._snapshots.append((now, counters.rows_committed, counters.rows_sampled))

    def rates(self, now: float, counters: Counters) -> tuple[float, float]:
        """(insert, sample) rows per second since the oldest snapshot in the window, so a
        burst shows at once and an idle buffer falls to zero."""
        recent = [snap for snap in self._snapshots if now - snap[0] <= RATE_WINDOW_S]
        if not recent or now <= recent[0][0]:
            return 0.0, 0.0
        t0, committed, sampled = recent[0]
        return (
            (counters.rows_committed - committed) / (now - t0),
            (counters.rows_sampled - sampled) / (now - t0),
        )


def client_figures(
    clients: Iterable[Client], leases_by_owner: Mapping[int, int], now: float
) -> list[dict[str, Any]]:
    """One map per client for ``stats.clients``: who it is, what it holds open, the rows it
    committed and sampled, and its lag (``idle_s``: seconds since its last request, so a
    stalled writer or learner stands out). ``leases_by_owner``: leases held per client id
    (one pass over the lease table, not one per client)."""
    return [
        {
            "id": client.id,
            "role": client.role,
            "pid": client.pid,
            "host": client.host,
            "remote": client.remote,
            "idle_s": max(0.0, now - client.last_seen),
            "reservations": len(client.reservations),
            "leases": int(leases_by_owner.get(client.id, 0)),
            "rows_committed": client.rows_committed,
            "rows_sampled": client.rows_sampled,
        }
        for client in clients
    ]
