"""Ratios, markdown/rich tables and the JSON/markdown result files."""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata
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
    "gb_per_s",
    "vs_copy",
    "vs_best_peer",
    "seconds",
]
#: Shown after COLUMNS for a scenario whose rows carry them (per-call costs of repeated runs).
OPTIONAL_COLUMNS = ["us_per_call", "us_min", "us_max"]


def is_peer(impl: str) -> bool:
    return impl != COPY_LIMIT and not impl.startswith("shmbuffer")


def add_ratios(rows: list[Row]) -> None:
    """``vs_copy``: throughput / the copy limit's (same scenario, op, pass);
    ``vs_best_peer``: throughput / the best peer's (TorchRL, cpprb...). None when absent."""
    groups: dict[tuple[str, str, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r["scenario"], r["op"], r["pass"]), []).append(r)
    for group in groups.values():
        limit = [r["rows_per_s"] for r in group if r["impl"] == COPY_LIMIT]
        peers = [r["rows_per_s"] for r in group if is_peer(r["impl"])]
        for r in group:
            if r["op"] == "create":  # lazy allocators make creation ratios meaningless
                r["vs_copy"] = r["vs_best_peer"] = None
                continue
            r["vs_copy"] = r["rows_per_s"] / limit[0] if limit else None
            r["vs_best_peer"] = r["rows_per_s"] / max(peers) if peers else None


def _fmt(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key == "rows_per_s":
        return f"{value / 1e6:.2f} M" if value >= 1e5 else f"{value / 1e3:.1f} k"
    if key in ("gb_per_s", "vs_copy", "vs_best_peer"):
        return f"{value:.2f}"
    if key == "seconds":
        return f"{value:.3f}"
    if key.startswith("us_"):
        return f"{value:.1f}"
    return str(value)


def columns(rows: list[Row]) -> list[str]:
    """The table columns for one scenario's rows."""
    return COLUMNS + [c for c in OPTIONAL_COLUMNS if any(c in r for r in rows)]


def table_rows(rows: list[Row]) -> list[list[str]]:
    return [[_fmt(c, r.get(c)) for c in columns(rows)] for r in rows]


def markdown(rows: list[Row], notes: list[str], meta: dict[str, Any]) -> str:
    out = ["# shmbuffer benchmark results", ""]
    out.append(", ".join(f"{k}: {v}" for k, v in meta.items() if k != "versions"))
    out.append("versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()))
    for name in dict.fromkeys(r["scenario"] for r in rows):
        sub = [r for r in rows if r["scenario"] == name]
        out += ["", f"## {name}", "", "| " + " | ".join(columns(sub)) + " |"]
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
            table.add_column(c, justify="left" if c in ("impl", "op", "pass") else "right")
        for t in table_rows(sub):
            table.add_row(*t)
        console.print(table)
    for n in notes:
        console.print(f"- {n}")


def meta(quick: bool, tmpdir: str, threads: int, load: str) -> dict[str, Any]:
    versions = {}
    for pkg in ("shmbuffer", "numpy", "torch", "tensordict", "torchrl", "cpprb"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = "absent"
    return {
        "quick": quick,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "tmpdir": tmpdir,
        "torch_threads": threads,
        "loadavg(start,end)": load,
        "versions": versions,
    }


def write(out: Path, rows: list[Row], notes: list[str], info: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    doc = {"meta": info, "notes": notes, "rows": rows}
    (out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "results.md").write_text(markdown(rows, notes, info))
