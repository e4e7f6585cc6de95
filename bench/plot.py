"""One grouped bar chart (GB/s per op and pass, one bar per impl) per scenario."""

from __future__ import annotations

from pathlib import Path

from bench.registry import Row


def plot(rows: list[Row], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name in dict.fromkeys(r["scenario"] for r in rows):
        sub = [r for r in rows if r["scenario"] == name and r["op"] != "create"]
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
