"""The text of ``shmbuffer-daemon status``: a daemon's stats reply as lines a person reads."""

from __future__ import annotations

from typing import Any


def format_status(s: dict[str, Any]) -> str:
    def rate(x: float) -> str:
        return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"

    schema = s["schema"] or "(lazy: set by the first writer)"
    return "\n".join(
        [
            f"buffer      {s['name']}  (pid {s['pid']}, protocol {s['protocol']}, "
            f"up {s['uptime_s']:.0f}s)",
            f"capacity    {s['capacity']:,} rows  unit={s['unit']}  mode={s['mode']}",
            f"stored      {s['rows']:,} rows, {s['episodes']:,} episodes  "
            f"fill {100 * s['fill']:.1f}%",
            f"rates       insert {rate(s['insert_rows_per_s'])} rows/s   "
            f"sample {rate(s['sample_rows_per_s'])} rows/s",
            f"clients     {s['writers']} writers, {s['readers']} readers",
            f"in flight   {s['reservations']} reservations ({s['reserved_rows']:,} rows), "
            f"{s['leases']} leases",
            f"totals      {s['rows_committed']:,} rows / {s['episodes_committed']:,} episodes "
            f"committed, {s['samples']:,} samples, {s['errors']:,} refused requests",
            f"limiter     {s['rate_limiter']}",
            f"schema      {schema}",
        ]
    )
