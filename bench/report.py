"""Repetitions folded into one row (median, min-max), ratios, winners, markdown/rich tables and
the JSON/markdown result files."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.registry import Row

COPY_LIMIT = "copy-limit"
COLUMNS = [
    "impl",
    "op",
    "pass",
    "chunk",
    "rows_per_s",
    "range",
    "gb_per_s",
    "vs_copy",
    "vs_best_peer",
    "seconds",
    "winner",
]
#: Shown after COLUMNS for a scenario whose rows carry them (per-call costs of repeated runs;
#: the CPU figures of the multi-process loads, see bench.loads.cpu_fields).
OPTIONAL_COLUMNS = [
    "us_per_call",
    "us_min",
    "us_max",
    "cpu_s_per_m_rows",
    "daemon_cpu_share",
    "cpu_vs_best_peer",
]
#: A column's header where it is not its key; CPU is a cost: its ratio reads the other way.
HEADERS = {
    "cpu_s_per_m_rows": "cpu_s_per_M_rows",
    "daemon_cpu_share": "daemon_share",
    "cpu_vs_best_peer": "cpu_vs_best_peer (lower = better)",
}


def is_peer(impl: str) -> bool:
    return impl != COPY_LIMIT and not impl.startswith("shmbuffer")


def is_ours(impl: str) -> bool:
    return impl.startswith("shmbuffer")


def low(r: Row) -> float:
    """The slowest run's ``rows_per_s`` (the row's own for a single run)."""
    return float(r["rows_per_s_min"] if "rows_per_s_min" in r else r["rows_per_s"])


def high(r: Row) -> float:
    """The fastest run's ``rows_per_s`` (the row's own for a single run)."""
    return float(r["rows_per_s_max"] if "rows_per_s_max" in r else r["rows_per_s"])


def _key(r: Row) -> tuple[str, str, str, str]:
    return (r["scenario"], r["impl"], r["op"], r["pass"])


def aggregate(runs: list[list[Row]]) -> list[Row]:
    """The rows of repeated runs of one scenario, one row per measurement: the row of its
    median repetition by ``rows_per_s`` (the lower middle one for an even count, so every
    field is one repetition's, consistent with the others), with ``repeats``,
    ``rows_per_s_min``/``_max`` and every repetition's ``runs_rows_per_s`` beside it. A
    measurement appears once per run in the order first seen (a second row of the same
    impl, op and pass in one run is a second measurement)."""
    found: dict[tuple[Any, ...], list[Row]] = {}
    for rows in runs:
        seen: dict[tuple[str, str, str, str], int] = {}
        for r in rows:
            k = _key(r)
            seen[k] = seen.get(k, 0) + 1
            found.setdefault((*k, seen[k]), []).append(r)
    out = []
    for reps in found.values():
        ranked = sorted(reps, key=lambda r: r["rows_per_s"])
        row = dict(ranked[(len(ranked) - 1) // 2])
        row["repeats"] = len(reps)
        row["rows_per_s_min"] = ranked[0]["rows_per_s"]
        row["rows_per_s_max"] = ranked[-1]["rows_per_s"]
        row["runs_rows_per_s"] = [r["rows_per_s"] for r in reps]
        if "cpu_s_per_m_rows" in row:
            row["runs_cpu_s_per_m_rows"] = [r.get("cpu_s_per_m_rows") for r in reps]
        out.append(row)
    return out


def _groups(rows: list[Row]) -> dict[tuple[str, str, str], list[Row]]:
    groups: dict[tuple[str, str, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r["scenario"], r["op"], r["pass"]), []).append(r)
    return groups


def add_winners(rows: list[Row]) -> None:
    """``winner``: in each (scenario, op, pass) with a shmbuffer row and a peer row, the
    implementation with the highest median ``rows_per_s`` (the copy limit is a ceiling, not a
    contender); None elsewhere. ``winner_overlaps``: its min-max range overlaps the runner-up's
    (repeated runs only; the order may be noise)."""
    for (_, op, _), group in _groups(rows).items():
        if op == "create":  # lazy allocators: no ratio, no winner (see add_ratios)
            for r in group:
                r["winner"] = r["winner_overlaps"] = None
            continue
        rivals = sorted(
            (r for r in group if r["impl"] != COPY_LIMIT),
            key=lambda r: r["rows_per_s"],
            reverse=True,
        )
        contest = any(is_ours(r["impl"]) for r in rivals) and any(
            is_peer(r["impl"]) for r in rivals
        )
        best = rivals[0] if contest else None
        overlaps = None
        if best is not None and best.get("repeats", 1) > 1:
            second = rivals[1]
            overlaps = low(best) <= high(second)
        for r in group:
            r["winner"] = best["impl"] if best else None
            r["winner_overlaps"] = overlaps


def add_ratios(rows: list[Row]) -> None:
    """``vs_copy``: throughput / the copy limit's (same scenario, op, pass);
    ``vs_best_peer``: throughput / the best peer's (TorchRL, cpprb...). None when absent.
    Rows with CPU figures also get ``cpu_vs_best_peer``: their CPU per row / the lowest a
    peer spent (lower is better: below 1, less CPU per row than every peer)."""
    for group in _groups(rows).values():
        limit = [r["rows_per_s"] for r in group if r["impl"] == COPY_LIMIT]
        peers = [r["rows_per_s"] for r in group if is_peer(r["impl"])]
        frugal = [
            r["cpu_s_per_m_rows"]
            for r in group
            if is_peer(r["impl"]) and r.get("cpu_s_per_m_rows") is not None
        ]
        for r in group:
            if "cpu_s_per_m_rows" in r:
                cpu = r["cpu_s_per_m_rows"]
                r["cpu_vs_best_peer"] = cpu / min(frugal) if cpu is not None and frugal else None
            if r["op"] == "create":  # lazy allocators make creation ratios meaningless
                r["vs_copy"] = r["vs_best_peer"] = None
                continue
            r["vs_copy"] = r["rows_per_s"] / limit[0] if limit else None
            r["vs_best_peer"] = r["rows_per_s"] / max(peers) if peers else None


def rate(value: float) -> str:
    """Rows per second, short: ``11.52 M``, ``48.4 k``, ``512``."""
    if value >= 1e5:
        return f"{value / 1e6:.2f} M"
    return f"{value / 1e3:.1f} k" if value >= 1e3 else f"{value:.0f}"


def rate_range(r: Row) -> str:
    """``min-max`` of a repeated row's ``rows_per_s``; ``-`` for a single run."""
    if r.get("repeats", 1) <= 1:
        return "-"
    return f"{rate(r['rows_per_s_min'])}-{rate(r['rows_per_s_max'])}"


def winner(r: Row, markdown: bool = True) -> str:
    """The row's group winner; a peer in bold (markdown), ``~`` when the ranges overlap."""
    name = r.get("winner")
    if not name:
        return "-"
    text = f"**{name}**" if markdown and is_peer(name) else name
    return text + (" ~" if r.get("winner_overlaps") else "")


def cpu(value: float | None) -> str:
    """CPU seconds per million rows, three figures: ``2.05``, ``12.3``, ``153``."""
    if value is None:
        return "-"
    return f"{value:.3g}" if value < 1000 else f"{value:.0f}"


def daemon_share(r: Row) -> str:
    """The daemon's part of a row's CPU: ``23%``; ``—`` for an implementation without one."""
    value = r.get("daemon_cpu_share")
    if value is None:
        return "—" if not is_ours(r["impl"]) else "-"
    return f"{value:.0%}"


def _fmt(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key == "rows_per_s":
        return rate(value)
    if key == "cpu_s_per_m_rows":
        return cpu(value)
    if key in ("gb_per_s", "vs_copy", "vs_best_peer", "cpu_vs_best_peer"):
        return f"{value:.2f}"
    if key == "seconds":
        return f"{value:.3f}"
    if key.startswith("us_"):
        return f"{value:.1f}"
    return str(value)


def columns(rows: list[Row]) -> list[str]:
    """The table columns for one scenario's rows."""
    return COLUMNS + [c for c in OPTIONAL_COLUMNS if any(c in r for r in rows)]


def _cell(c: str, r: Row, markdown: bool) -> str:
    if c == "range":
        return rate_range(r)
    if c == "winner":
        return winner(r, markdown)
    if c == "daemon_cpu_share":
        return daemon_share(r)
    return _fmt(c, r.get(c))


def header(c: str) -> str:
    return HEADERS.get(c, c)


def table_rows(rows: list[Row], markdown: bool = True) -> list[list[str]]:
    return [[_cell(c, r, markdown) for c in columns(rows)] for r in rows]


def scenario_line(info: dict[str, Any] | None) -> str:
    """How long a scenario ran and how busy the machine was meanwhile (see bench.machine)."""
    if not info:
        return ""
    other = info.get("other_cores")
    busy = "?" if other is None else f"{other:.2f}"
    return (
        f"{info['repeats']} run(s), {info['seconds']:.1f} s ({info.get('cpu_seconds', 0):.1f} s "
        "of CPU); 1-min load average "
        f"{info['load_before'][0]:.2f} before, {info['load_after'][0]:.2f} after; other "
        f"processes kept {busy} cores busy"
    )


MD_LEGEND = (
    "rows_per_s: the median of the runs, range: their min-max; vs_copy / vs_best_peer: the "
    "median against the copy limit's and the best peer's; winner: the fastest implementation "
    "of that op and pass (a peer in **bold**; `~`: its range overlaps the runner-up's). "
    "Where a scenario runs processes (rollout, contention): cpu_s_per_M_rows: the CPU seconds "
    "every process of the implementation spent in the pass (writers, learners, shmbuffer's "
    "daemon, any helper), read from /proc, per million of the row's rows (written on a "
    "writer side, sampled on a learner side); daemon_share: the daemon's part of it (—: the "
    "implementation has no daemon); cpu_vs_best_peer: that over the lowest a peer spent, "
    "lower is better (below 1: less CPU per row than every peer)."
)


def markdown(rows: list[Row], notes: list[str], meta: dict[str, Any]) -> str:
    out = ["# shmbuffer benchmark results", ""]
    skip = ("versions", "machine", "scenarios")
    out.append(", ".join(f"{k}: {v}" for k, v in meta.items() if k not in skip))
    if "machine" in meta:
        out.append("machine: " + ", ".join(f"{k} {v}" for k, v in meta["machine"].items()))
    out.append("versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()))
    out += ["", MD_LEGEND]
    for name in dict.fromkeys(r["scenario"] for r in rows):
        sub = [r for r in rows if r["scenario"] == name]
        out += ["", f"## {name}", ""]
        line = scenario_line(meta.get("scenarios", {}).get(name))
        if line:
            out += [line, ""]
        out += ["| " + " | ".join(header(c) for c in columns(sub)) + " |"]
        out.append("|" + "|".join("---" for _ in columns(sub)) + "|")
        out += ["| " + " | ".join(t) + " |" for t in table_rows(sub)]
    if notes:
        out += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(out) + "\n"


def print_tables(rows: list[Row], notes: list[str], meta: dict[str, Any]) -> None:
    if not sys.stdout.isatty():
        print(markdown(rows, notes, meta))
        return
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(markdown(rows, notes, meta))
        return
    console = Console()
    for name in dict.fromkeys(r["scenario"] for r in rows):
        table = Table(title=name)
        sub = [r for r in rows if r["scenario"] == name]
        for c in columns(sub):
            table.add_column(header(c), justify="left" if c in ("impl", "op", "pass") else "right")
        for t in table_rows(sub, markdown=False):
            table.add_row(*t)
        console.print(table)
    for n in notes:
        console.print(f"- {n}")


def meta(
    quick: bool,
    tmpdir: str,
    threads: int,
    load: str,
    *,
    command: str = "",
    date: str = "",
    repeat: int = 1,
    scenarios: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    from bench import machine

    return {
        "command": command,
        "date": date,
        "quick": quick,
        "repeat": repeat,
        "tmpdir": tmpdir,
        "torch_threads": threads,
        "loadavg(start,end)": load,
        "machine": machine.describe(),
        "versions": machine.versions(),
        "scenarios": scenarios or {},
    }


def write(out: Path, rows: list[Row], notes: list[str], info: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    doc = {"meta": info, "notes": notes, "rows": rows}
    (out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "results.md").write_text(markdown(rows, notes, info))
