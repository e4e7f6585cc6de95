"""One figure per scenario, the kind a person reads at a glance:

- measured at several buffer sizes (rows with ``stored_rows``): cost per call against size, on
  log-log axes;
- measured at several writer, client or node counts (ops named ``<what>-<N>w``, ``-<N>c``,
  ``-<N>n``): throughput against the count, one line per implementation;
- otherwise, where peers ran: every implementation's throughput over the best peer's, per op
  and pass (bars; 1 = the best peer; error bars: the runs' min-max);
- with no peer at all: GB/s bars.

Every figure is drawn from the result rows of one run; nothing is typed in."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from bench.registry import Row
from bench.report import COPY_LIMIT, high, is_peer, low

_COUNTED = re.compile(r"^(?P<what>.+)-(?P<n>\d+)(?P<unit>[wcn])$")
_UNITS = {"w": "writer processes", "c": "client processes", "n": "nodes"}


def plot(rows: list[Row], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    palette = _palette(rows)
    paths = []
    for name in dict.fromkeys(r["scenario"] for r in rows):
        sub = [r for r in rows if r["scenario"] == name and r["op"] != "create"]
        if not sub:
            continue
        if any("stored_rows" in r for r in sub):
            paths.append(_by_size(plt, name, sub, out))
            continue
        counts = {c[1] for r in sub if (c := _counted(r["op"])) is not None}
        if len(counts) > 1:
            paths.append(_by_count(plt, name, sub, out, palette))
            continue
        if any(is_peer(r["impl"]) for r in sub):
            paths.append(_vs_peer(plt, name, sub, out, palette))
            continue
        groups = list(dict.fromkeys(f"{r['op']}\n{r['pass']}" for r in sub))
        impls = list(dict.fromkeys(r["impl"] for r in sub))
        width = 0.8 / max(1, len(impls))
        fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(groups)), 4.5))
        for i, impl in enumerate(impls):
            values = {f"{r['op']}\n{r['pass']}": r["gb_per_s"] for r in sub if r["impl"] == impl}
            xs = [g + i * width for g in range(len(groups))]
            ax.bar(xs, [values.get(g, 0.0) for g in groups], width, label=impl)
        ax.set_xticks([g + width * (len(impls) - 1) / 2 for g in range(len(groups))], groups)
        ax.set_ylabel("GB/s")
        ax.set_title(name)
        ax.legend(fontsize="small")
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _by_size(plt: Any, name: str, sub: list[Row], out: Path) -> Path:
    """One panel per ``sampler_op``: median us per call against stored rows, one line per impl,
    min-max of the repetitions as error bars."""
    ops = list(dict.fromkeys(r["sampler_op"] for r in sub))
    fig, axes = plt.subplots(1, len(ops), figsize=(4.6 * len(ops), 4.2), squeeze=False)
    for ax, op in zip(axes[0], ops, strict=True):
        mine = [r for r in sub if r["sampler_op"] == op]
        for impl in dict.fromkeys(r["impl"] for r in mine):
            pts = sorted((r for r in mine if r["impl"] == impl), key=lambda r: r["stored_rows"])
            xs = [r["stored_rows"] for r in pts]
            ys = [r["us_per_call"] for r in pts]
            err = [
                [y - r["us_min"] for y, r in zip(ys, pts, strict=True)],
                [r["us_max"] - y for y, r in zip(ys, pts, strict=True)],
            ]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=impl)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("stored rows")
        ax.set_ylabel("us per call (median, min-max)")
        ax.set_title(mine[0].get("call", op), fontsize="medium")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(name)
    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


_OURS = ["tab:blue", "tab:cyan", "navy", "tab:green", "steelblue"]
_PEERS = ["tab:orange", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "gold"]


def _palette(rows: list[Row]) -> dict[str, Any]:
    """One colour per implementation, the same in every figure of a run: shmbuffer's in
    blues and greens, the peers' in warm colours, the copy limit grey."""
    out: dict[str, Any] = {COPY_LIMIT: "tab:gray"}
    ours = peers = 0
    for impl in dict.fromkeys(r["impl"] for r in rows):
        if impl in out:
            continue
        if is_peer(impl):
            out[impl], peers = _PEERS[peers % len(_PEERS)], peers + 1
        else:
            out[impl], ours = _OURS[ours % len(_OURS)], ours + 1
    return out


def _spread(r: Row, scale: float) -> tuple[float, float]:
    """The distance from the median to the runs' min and max, divided by ``scale``."""
    mid = r["rows_per_s"]
    return (mid - low(r)) / scale, (high(r) - mid) / scale


def _counted(op: str) -> tuple[str, int, str] | None:
    """``("insert", 4, "w")`` for ``insert-4w``; None for an op not measured per count."""
    m = _COUNTED.match(op)
    return (m["what"], int(m["n"]), m["unit"]) if m else None


def _by_count(plt: Any, name: str, sub: list[Row], out: Path, palette: dict[str, Any]) -> Path:
    """One panel per measured thing and pass: rows/s against the writer (client) count, one
    line per implementation (the copy limit dashed), min-max of the runs as error bars."""
    keyed = [(r, c) for r in sub if (c := _counted(r["op"])) is not None]
    panels = list(dict.fromkeys((c[0], r["pass"]) for r, c in keyed))
    width = max(6.5, 4.8 * len(panels))  # room for the title over a single panel
    fig, axes = plt.subplots(1, len(panels), figsize=(width, 4.2), squeeze=False)
    unit_word = _UNITS[keyed[0][1][2]]
    for ax, (what, pass_) in zip(axes[0], panels, strict=True):
        mine = [(r, c[1]) for r, c in keyed if r["pass"] == pass_ and c[0] == what]
        top = max(high(r) for r, _ in mine)
        scale, unit = (1e6, "M rows/s") if top >= 1e5 else (1e3, "k rows/s")
        for impl in dict.fromkeys(r["impl"] for r, _ in mine):
            pts = sorted(((r, n) for r, n in mine if r["impl"] == impl), key=lambda p: p[1])
            ax.errorbar(
                [n for _, n in pts],
                [r["rows_per_s"] / scale for r, _ in pts],
                yerr=list(zip(*(_spread(r, scale) for r, _ in pts), strict=True)),
                marker="o",
                capsize=3,
                label=impl,
                color=palette.get(impl),
                linestyle="--" if impl == COPY_LIMIT else "-",
            )
        ax.set_xticks(sorted({n for _, n in mine}))
        ax.set_xlabel(unit_word)
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0)
        ax.set_title(f"{what} ({pass_})", fontsize="medium")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"{name}: throughput against {unit_word} (higher is better)")
    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _vs_peer(plt: Any, name: str, sub: list[Row], out: Path, palette: dict[str, Any]) -> Path:
    """Per op and pass that has a peer: every implementation's rows/s over the best peer's
    (1 = the best peer, the dashed line), min-max of the runs as error bars; log axis when
    the ratios span more than 30x."""
    groups: dict[str, list[Row]] = {}
    for r in sub:
        groups.setdefault(f"{r['op']}\n{r['pass']}", []).append(r)
    best = {
        g: max(r["rows_per_s"] for r in rs if is_peer(r["impl"]))
        for g, rs in groups.items()
        if any(is_peer(r["impl"]) for r in rs)
    }
    labels = list(best)
    impls = list(dict.fromkeys(r["impl"] for g in labels for r in groups[g]))
    width = 0.8 / max(1, len(impls))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.5 * len(labels) + 2), 4.6))
    ratios = []
    for i, impl in enumerate(impls):
        xs, ys, lo, hi = [], [], [], []
        for g, label in enumerate(labels):
            row = next((r for r in groups[label] if r["impl"] == impl), None)
            if row is None:
                continue
            down, up = _spread(row, best[label])
            xs.append(g + i * width)
            ys.append(row["rows_per_s"] / best[label])
            lo.append(down)
            hi.append(up)
        ratios += ys
        ax.bar(
            xs,
            ys,
            width,
            yerr=[lo, hi],
            capsize=2,
            label=impl,
            color=palette.get(impl),
            hatch="//" if impl == COPY_LIMIT else None,
        )
        if len(labels) * len(impls) <= 40:
            for x, y in zip(xs, ys, strict=True):
                text = f"{y:.0f}" if y >= 10 else f"{y:.2f}"
                ax.annotate(text, (x, y), ha="center", va="bottom", fontsize=6)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    if ratios and max(ratios) / max(min(ratios), 1e-12) > 30:
        ax.set_yscale("log")
    ax.set_xticks([g + width * (len(impls) - 1) / 2 for g in range(len(labels))], labels)
    ax.set_ylabel("throughput / best peer's (1 = best peer)")
    ax.set_title(f"{name}: against the best peer (higher is better)")
    ax.legend(
        fontsize="small", ncol=min(len(impls), 4), loc="upper center", bbox_to_anchor=(0.5, -0.14)
    )
    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
