"""What ``shmbuffer-daemon status`` shows: a daemon's stats reply as lines a person reads
(:func:`format_status`), and as the live terminal view of ``status --watch``
(:class:`LiveStatus`, drawn with ``rich``, imported only there: the ``live`` extra).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import RenderableType

#: Clients listed in the live view; the rest are summed up in one line.
MAX_CLIENT_ROWS = 20
#: A client silent this long is shown as lagging (its lag cell turns yellow).
LAG_WARN_S = 5.0


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``1 writer``, ``4 writers``, ``0 writers``: a count and its noun, as a person says it
    (``nouns`` where the plural is not the noun and an s)."""
    return f"{n:,} {noun if n == 1 else nouns or noun + 's'}"


def rate(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


def format_status(s: dict[str, Any]) -> str:
    schema = s["schema"] or "(lazy: set by the first writer)"
    return "\n".join(
        [
            f"buffer      {s['name']}  (pid {s['pid']}, protocol {s['protocol']}, "
            f"up {s['uptime_s']:.0f}s)",
            f"capacity    {s['capacity']:,} rows  unit={s['unit']}  mode={s['mode']}",
            f"stored      {s['rows']:,} rows, {s['episodes']:,} episodes  "
            f"fill {100 * s['fill']:.1f}%",
            *compressed_lines(s),
            f"rates       insert {rate(s['insert_rows_per_s'])} rows/s   "
            f"sample {rate(s['sample_rows_per_s'])} rows/s",
            f"clients     {_clients(s)}",
            f"in flight   {_in_flight(s)}",
            *[f"stalled     {line}" for line in stalled_writers(s)],
            f"totals      {s['rows_committed']:,} rows / {s['episodes_committed']:,} episodes "
            f"committed, {s['samples']:,} samples, {s['errors']:,} refused requests",
            *_sampler_lines(s),
            *table_lines(s),
            f"schema      {schema}",
        ]
    )


def compressed_lines(s: dict[str, Any]) -> list[str]:
    """The byte store of compressed columns (docs/compression.md): its fill and the ratio of
    raw bytes to stored ones; none without such columns."""
    c = s.get("compressed")
    if not c:
        return []
    ratio = "-" if c.get("ratio") is None else f"{c['ratio']:.1f}x"
    columns = ", ".join(f"{k} ({v})" for k, v in (c.get("columns") or {}).items())
    return [
        f"compressed  {columns}: {c['used']:,} of {c['bytes']:,} bytes "
        f"(fill {100 * c['fill']:.1f}%), ratio {ratio} raw/stored"
    ]


def stalled_writers(s: dict[str, Any]) -> list[str]:
    """One line per reservation held for a live local writer that is past its TTL or lost its
    connection (a stopped process, a debugger): whose rows writers that lap it wait for."""
    lines = []
    for w in s.get("stalled_writers") or []:  # a daemon before protocol 1.6 has none
        why = (
            f"{w['past_ttl_s']:.0f}s past its TTL"
            if w["connected"]
            else "its connection gone, the process alive"
        )
        lines.append(
            f"writer pid {w['pid']} holds {w['rows']:,} rows (reservation {w['reservation']}), "
            f"{why}"
        )
    return lines


def _clients(s: dict[str, Any]) -> str:
    return f"{plural(s['writers'], 'writer')}, {plural(s['readers'], 'reader')}"


def _in_flight(s: dict[str, Any]) -> str:
    return (
        f"{plural(s['reservations'], 'reservation')} "
        f"({plural(s['reserved_rows'], 'row')}), {plural(s['leases'], 'lease')}"
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


def table_lines(s: dict[str, Any]) -> list[str]:
    """With several tables (``start --table``; the lines above are the default table's), one
    line per table: its sampler and what it holds (size and consumption, or its priorities),
    the rows it handed out, its limiter, and why writes wait for it now."""
    tables = s.get("tables") or {}  # a daemon before protocol 1.9 has none
    if len(tables) < 2 and not any("bounds" in t for t in tables.values()):
        return []
    lines = []
    for i, (name, table) in enumerate(tables.items()):
        sampler, limiter = table.get("sampler") or {}, table.get("rate_limiter") or {}
        shown = {"sampler", "unit", *sampler.get("settings", {})}
        figures = {k: v for k, v in sampler.get("figures", {}).items() if k not in shown}
        lead = "tables      " if i == 0 else "            "
        line = (
            f"{lead}{name}{' (default)' if i == 0 else ''}: {sampler.get('kind')}  "
            f"{_pairs(figures)}  sampled {limiter.get('sampled', 0):,} rows  "
            f"limiter {limiter.get('kind')}"
        )
        if table.get("holds_writes"):
            line += f"  HOLDS WRITES: {table['holds_writes']}"
        lines.append(line)
        if table.get("bounds"):
            lines.append("              " + _bounds_line(table["bounds"]))
    return lines


def _bounds_line(bounds: dict[str, Any]) -> str:
    """A bounded table's options and, with staleness, its live episodes per policy-version lag
    behind the newest (``lag 0: 812  1: 640 ... none: 0``)."""
    lags = bounds.get("lags")
    options = {k: v for k, v in bounds.items() if k not in ("lags", "newest_policy_version")}
    text = "bounds " + _pairs(options)
    if lags is not None:
        newest = bounds.get("newest_policy_version")
        text += f"  newest policy_version {newest}  episodes by lag " + "  ".join(
            f"{lag}: {count:,}" for lag, count in lags.items()
        )
    return text


class LiveStatus:
    """The frames of ``status --watch`` on a terminal: :meth:`render` turns each stats reply
    into a rich renderable; it keeps the previous reply to give each client its own rates."""

    def __init__(self) -> None:
        self._previous: tuple[float, dict[int, tuple[int, int]]] | None = None

    def render(self, s: dict[str, Any]) -> RenderableType:
        from rich.console import Group
        from rich.panel import Panel
        from rich.table import Table

        clients = s.get("clients")  # a daemon before this field has only the role counts
        rates = self._client_rates(s["uptime_s"], clients or [])
        top = Table.grid(expand=True)
        top.add_column(ratio=1)
        top.add_column(ratio=1)
        top.add_row(_buffer_panel(s), _totals_panel(s))
        top.add_row(_sampler_panel(s), _limiter_panel(s))
        title = f"shmbuffer [bold]{s['name']}[/]"
        subtitle = f"pid {s['pid']} · protocol {s['protocol']} · up {s['uptime_s']:.0f}s"
        return Panel(
            Group(top, *_tables_panel(s), _clients_panel(s, clients, rates)),
            title=title,
            subtitle=subtitle,
            border_style="blue",
        )

    def _client_rates(
        self, uptime: float, clients: list[dict[str, Any]]
    ) -> dict[int, tuple[float, float]]:
        """Rows/s committed and sampled by each client since the previous frame (the
        daemon's uptime is the clock: the watch's own sleep does not skew it)."""
        now = {c["id"]: (int(c["rows_committed"]), int(c["rows_sampled"])) for c in clients}
        previous, self._previous = self._previous, (uptime, now)
        if previous is None or uptime <= previous[0]:
            return {}
        dt = uptime - previous[0]
        return {
            cid: ((w - previous[1][cid][0]) / dt, (r - previous[1][cid][1]) / dt)
            for cid, (w, r) in now.items()
            if cid in previous[1]
        }


def _grid() -> Any:
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    return grid


def _buffer_panel(s: dict[str, Any]) -> RenderableType:
    from rich.panel import Panel
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    fill = Table.grid(padding=(0, 1))
    fill.add_row(
        ProgressBar(total=max(1, s["capacity"]), completed=s["rows"], width=30),
        f"{100 * s['fill']:.1f}%",
    )
    grid = _grid()
    grid.add_row("capacity", f"{s['capacity']:,} rows  unit={s['unit']}  mode={s['mode']}")
    grid.add_row("stored", f"{s['rows']:,} rows, {s['episodes']:,} episodes")
    grid.add_row("fill", fill)
    grid.add_row("in flight", _in_flight(s))
    for line in stalled_writers(s):
        grid.add_row("[bold red]stalled[/]", line)
    grid.add_row("schema", "set" if s["schema"] else "(lazy: set by the first writer)")
    return Panel(grid, title="buffer", title_align="left")


def _totals_panel(s: dict[str, Any]) -> RenderableType:
    from rich.panel import Panel

    grid = _grid()
    grid.add_row("insert rate", f"{rate(s['insert_rows_per_s'])} rows/s")
    grid.add_row("sample rate", f"{rate(s['sample_rows_per_s'])} rows/s")
    grid.add_row("rows committed", f"{s['rows_committed']:,}")
    grid.add_row("episodes committed", f"{s['episodes_committed']:,}")
    grid.add_row("rows sampled", f"{s['rows_sampled']:,} in {s['samples']:,} samples")
    grid.add_row("refused requests", f"{s['errors']:,}")
    return Panel(grid, title="rates and totals", title_align="left")


def _sampler_panel(s: dict[str, Any]) -> RenderableType:
    from rich.panel import Panel

    grid = _grid()
    sampler = s.get("sampler")
    if sampler is None:
        grid.add_row("kind", "uniform (a daemon before protocol 1.2)")
    else:
        shown = {"sampler", "unit", *sampler.get("settings", {})}
        figures = {k: v for k, v in sampler.get("figures", {}).items() if k not in shown}
        grid.add_row("kind", str(sampler["kind"]))
        grid.add_row("settings", _pairs(sampler.get("settings", {})) or "-")
        grid.add_row("figures", _pairs(figures) or "-")
        grid.add_row(
            "priority updates",
            f"{s.get('priority_updates', 0):,} "
            f"({s.get('priority_updates_stale', 0):,} stale, skipped)",
        )
    return Panel(grid, title="sampler", title_align="left")


def _limiter_panel(s: dict[str, Any]) -> RenderableType:
    from rich.panel import Panel

    limiter = s.get("rate_limiter") or {}
    grid = _grid()
    grid.add_row("kind", str(limiter.get("kind", "none")))
    if "inserted" in limiter:
        grid.add_row("settings", _pairs(limiter.get("settings", {})) or "-")
        grid.add_row(
            "counts",
            f"inserted {limiter['inserted']:,}  sampled {limiter['sampled']:,}  "
            f"deleted {limiter['deleted']:,}  size {limiter['size']:,}",
        )
        for what in ("insert", "sample"):  # seconds parked by flow control, all together
            waiting = limiter[f"{what}s_waiting"]
            text = f"{limiter[f'{what}_blocked_s']:.1f}s, {waiting} waiting now"
            grid.add_row(f"{what}s blocked", f"[yellow]{text}[/]" if waiting else text)
    return Panel(grid, title="rate limiter", title_align="left")


def _tables_panel(s: dict[str, Any]) -> list[RenderableType]:
    """Each table's line (:func:`table_lines`), with several tables; none otherwise."""
    from rich.panel import Panel
    from rich.text import Text

    lines = [line.strip() for line in table_lines(s)]
    if not lines:
        return []
    lines[0] = lines[0].removeprefix("tables").strip()
    return [Panel(Text("\n".join(lines)), title="tables", title_align="left")]


def _clients_panel(
    s: dict[str, Any],
    clients: list[dict[str, Any]] | None,
    rates: dict[int, tuple[float, float]],
) -> RenderableType:
    from rich.markup import escape
    from rich.panel import Panel
    from rich.table import Table

    title = f"clients: {_clients(s)}"
    if clients is None:
        return Panel("(this daemon reports no per-client figures)", title=title)
    table = Table(
        expand=True,
        box=None,
        header_style="bold",
        caption="lag: seconds since the client's last request",
        caption_justify="left",
    )
    for name in ("id", "role", "pid", "host", "lag", "committed", "sampled", "resv", "leases"):
        table.add_column(name, justify="left" if name in ("role", "host") else "right")
    order = sorted(clients, key=lambda c: (c["role"], c["id"]))
    for c in order[:MAX_CLIENT_ROWS]:
        w_rate, r_rate = rates.get(c["id"], (0.0, 0.0))
        lag = f"{c['idle_s']:.1f}s"
        table.add_row(
            str(c["id"]),
            escape(str(c["role"])),
            str(c["pid"]),
            escape(str(c["host"])) + (" (remote)" if c["remote"] else ""),
            f"[yellow]{lag}[/]" if c["idle_s"] >= LAG_WARN_S else lag,
            f"{c['rows_committed']:,} ({rate(w_rate)}/s)" if c["rows_committed"] else "-",
            f"{c['rows_sampled']:,} ({rate(r_rate)}/s)" if c["rows_sampled"] else "-",
            str(c["reservations"]),
            str(c["leases"]),
        )
    if len(order) > MAX_CLIENT_ROWS:
        table.add_row("", f"... {len(order) - MAX_CLIENT_ROWS} more", *[""] * 7)
    return Panel(table, title=title, title_align="left")
