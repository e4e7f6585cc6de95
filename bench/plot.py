"""One grouped bar chart (GB/s per op and pass, one bar per impl) per scenario; for a scenario
measured at several buffer sizes (rows with ``stored_rows``), cost per call against size on
log-log axes instead."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.registry import Row


def plot(rows: list[Row], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name in dict.fromkeys(r["scenario"] for r in rows):
        sub = [r for r in rows if r["scenario"] == name and r["op"] != "create"]
        if any("stored_rows" in r for r in sub):
            paths.append(_by_size(plt, name, sub, out))
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
