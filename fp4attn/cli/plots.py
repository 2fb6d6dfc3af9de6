"""PNG plots of the CLI results (matplotlib, optional)."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("fp4attn")


def plot_accuracy(records: list[dict], path: Path) -> bool:
    """Bar chart of 1 - cosine (log scale) per recipe and case; False if matplotlib is
    not installed (logged)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: skipping %s (pip install fp4attn[plot])", path)
        return False
    fig = accuracy_figure(records)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def accuracy_figure(records: list[dict]):
    """The matplotlib figure of `plot_accuracy`: one group of bars per recipe, its name
    written vertically under it (twenty recipe names side by side overlapped at any
    slant), the figure as wide as the groups need."""
    import matplotlib.pyplot as plt

    recipes = list(dict.fromkeys(r["recipe"] for r in records))
    cases = list(dict.fromkeys(r["case"] for r in records))
    fig, ax = plt.subplots(figsize=(max(8.0, 0.45 * len(recipes) + 2), 5))
    width = 0.8 / len(cases)
    for i, case in enumerate(cases):
        vals = [next(1 - r["cos"] for r in records if r["recipe"] == n and r["case"] == case) for n in recipes]
        ax.bar([j + i * width for j in range(len(recipes))], vals, width, label=case)
    ax.set_xticks([j + width * (len(cases) - 1) / 2 for j in range(len(recipes))], recipes, rotation=90)
    ax.set_yscale("log")
    ax.set_ylabel("1 - cosine vs float64 attention")
    r0 = records[0]
    ax.set_title(f"fp4attn accuracy, (B,H,S,D)=({r0['B']},{r0['H']},{r0['S']},{r0['D']}), {r0['device']}")
    ax.legend()
    fig.tight_layout()
    return fig
