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
            *_sampler_lines(s),
            f"schema      {schema}",
        ]
    )


def _pairs(values: dict[str, Any]) -> str:
    def show(v: Any) -> str:
        return f"{v:g}" if isinstance(v, float) else str(v)

    return " ".join(f"{k}={show(v)}" for k, v in values.items() if v is not None)


def _sampler_lines(s: dict[str, Any]) -> list[str]:
    """The sampler (kind, settings, its figures) and the rate limiter (kind, settings, counts,
    time inserts and samples spent blocked); a daemon before protocol 1.2 had neither."""
    limiter = s.get("rate_limiter") or {}
    lines = []
    sampler = s.get("sampler")
    if sampler is not None:
        shown = {"sampler", "unit", *sampler.get("settings", {})}  # on the line above
        figures = {k: v for k, v in sampler.get("figures", {}).items() if k not in shown}
        settings = _pairs(sampler.get("settings", {}))
        lines.append(f"sampler     {sampler['kind']}" + (f"  {settings}" if settings else ""))
        lines.append(
            f"            {_pairs(figures)}  priority updates {s.get('priority_updates', 0):,} "
            f"({s.get('priority_updates_stale', 0):,} stale, skipped)"
        )
    if "inserted" not in limiter:
        return [*lines, f"limiter     {limiter}"]
    settings = _pairs(limiter.get("settings", {}))
    lines.append(f"limiter     {limiter['kind']}" + (f"  {settings}" if settings else ""))
    lines.append(
        f"            inserted {limiter['inserted']:,}  sampled {limiter['sampled']:,}  "
        f"deleted {limiter['deleted']:,}  size {limiter['size']:,}"
    )
    lines.append(
        f"            blocked: inserts {limiter['insert_blocked_s']:.1f}s "
        f"({limiter['inserts_waiting']} waiting now), samples "
        f"{limiter['sample_blocked_s']:.1f}s ({limiter['samples_waiting']} waiting now)"
    )
    return lines
