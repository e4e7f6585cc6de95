"""Plot learning curves written by the examples' ``--curve`` flag: return against env steps.

    python examples/dqn_cartpole.py --curve /tmp/dqn.csv
    python examples/ppo_cartpole.py --curve /tmp/ppo.csv
    python examples/plot_curves.py /tmp/dqn.csv /tmp/ppo.csv -o docs/learning-curves.png
    python examples/sac_pendulum.py --curve /tmp/sac.csv
    python examples/plot_curves.py /tmp/sac.csv --title "Pendulum-v1 through shmbuffer" \\
        -o docs/learning-curves-pendulum.png

Pendulum's returns (about -1,500 to -150) and CartPole's (up to 500) share no scale, hence a
plot of their own.

Each CSV holds one row per finished episode (``env_steps, seconds, return``); the plot shows
every episode's return faintly and the mean of the last 20 (what the examples report) on top.
Needs matplotlib (``pip install matplotlib``, or the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np

LAST_N = 20  # the examples' "mean return over the last 20 episodes"


def read_curve(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(env_steps, seconds, return) columns of one ``--curve`` CSV, in episode order."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise SystemExit(f"{path}: no episodes in the curve")
    try:
        columns = [
            np.array([float(r[k]) for r in rows]) for k in ("env_steps", "seconds", "return")
        ]
    except (KeyError, ValueError) as exc:
        raise SystemExit(f"{path}: not a --curve CSV (env_steps, seconds, return): {exc}") from None
    return columns[0], columns[1], columns[2]


def trailing_mean(values: np.ndarray, n: int = LAST_N) -> np.ndarray:
    """Mean of the last ``n`` values at each point (fewer at the start)."""
    sums = np.cumsum(values)
    counts = np.minimum(np.arange(1, len(values) + 1), n)
    shifted = np.concatenate([np.zeros(n), sums])[: len(values)]
    return (sums - shifted) / counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("curves", nargs="+", type=Path, help="CSV files from --curve")
    parser.add_argument("-o", "--out", type=Path, default=Path("learning-curves.png"))
    parser.add_argument("--title", default="CartPole-v1 through shmbuffer")
    args = parser.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plotting needs matplotlib: pip install matplotlib") from None

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for path in args.curves:
        steps, seconds, returns = read_curve(path)
        mean = trailing_mean(returns)
        (line,) = ax.plot(
            steps, mean, label=f"{path.stem}: {mean[-1]:.0f} after {seconds[-1]:.0f} s"
        )
        ax.plot(steps, returns, color=line.get_color(), alpha=0.15, linewidth=0.8)
    ax.set_xlabel("env steps")
    ax.set_ylabel(f"return (mean of last {LAST_N} episodes)")
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
