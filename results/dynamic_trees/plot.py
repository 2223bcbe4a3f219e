"""Accept length against rows per step, fixed and confident trees, one panel per benchmark (from run.sh's JSON).

Usage (from the project's root): python results/dynamic_trees/plot.py
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
BENCHES = ("mt_bench", "gsm8k", "humaneval", "alpaca_eval")


def main() -> None:
    fig, axes = plt.subplots(1, len(BENCHES), figsize=(4 * len(BENCHES), 3.4), sharey=True)
    for ax, bench in zip(axes, BENCHES):
        data = json.loads((HERE / f"{bench}.json").read_text())
        for choice, style in (("fixed", "o--"), ("confident", "s-")):
            rows = [r for r in data["trees"] if r["choice"] == choice]
            ax.plot([r["rows"] for r in rows], [r["accept_length"] for r in rows], style, label=choice)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{bench} ({data['answers']} answers)")
        ax.set_xlabel("rows per step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accept length (replay, greedy)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(HERE / "accept_length.png", dpi=120)


if __name__ == "__main__":
    main()
