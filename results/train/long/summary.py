"""The table of results/train/long/run.sh: accept length by token set, tree and data, training figures, 8K speed.

    python results/train/long/summary.py RESULTS_DIR [--best]

``--best`` prints the trained run (``long`` or ``mixed``) with the higher accept length on the held-out long
replies with its own 16-row tree: the one ``run.sh speed`` decodes at 8K.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RUNS = ("shipped", "long", "mixed")
BUDGETS = (16, 64, 128)
TRAINED = ("long", "mixed")


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def accept(result: dict | None, rows: int) -> float | None:
    """The accept length of the tree of ``rows`` rows in an ``eval.replay`` result."""
    for tree in (result or {}).get("trees", []):
        if tree["rows"] == rows:
            return tree["accept_length"]
    return None


def _cell(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def best(root: Path) -> str:
    scores = {run: accept(_read(root / run / "long_own_trees.json"), 16) or 0.0 for run in TRAINED}
    return max(scores, key=scores.get)


def table(root: Path) -> str:
    lines = ["| prompt tokens | held-out loss | long replies, own trees 16 / 64 / 128 | long replies, shipped trees "
             "16 / 64 / 128 | MT-Bench, shipped trees 16 / 64 / 128 | training |",
             "|---|---|---|---|---|---|"]
    for run in RUNS:
        own = _read(root / run / "long_own_trees.json")
        shipped = _read(root / run / "long_shipped_trees.json")
        bench = _read(root / run / "mt_bench.json")
        log = _read(root / f"training_log_{run}.json")
        loss = _cell((log or {}).get("final_eval", {}).get("eval_loss"), ".3f")
        trained = "-"
        if log:
            trained = (f"{log['throughput']['examples_per_s']:.0f} examples/s, {log['train_seconds']:.0f} s, "
                       f"{log['log_history'][-1].get('step')} steps")
        lines.append(f"| {run} | {loss} | {' / '.join(_cell(accept(own, b)) for b in BUDGETS)} | "
                     f"{' / '.join(_cell(accept(shipped, b)) for b in BUDGETS)} | "
                     f"{' / '.join(_cell(accept(bench, b)) for b in BUDGETS)} | {trained} |")
    held = _read(root / "shipped" / "long_own_trees.json")
    if held:
        lines.append(f"\nHeld-out long replies: {held['answers']} replies, {held['new_tokens']} tokens.")
    speed = []
    for path in sorted(root.glob("*/long_context_8k_b*.json")):
        result = json.loads(path.read_text())
        for row in result["rows"]:
            if row["method"] == "ppd":
                speed.append(f"| {path.parent.name} | {row['batch_size']} | {_cell(row.get('accept_length'))} | "
                             f"{_cell(row.get('decode_tokens_per_s'), '.1f')} | "
                             f"{_cell(row.get('speedup_decode_vs_baseline'))}x |")
    if speed:
        lines += ["", "| 8K, prompt tokens | batch | accept length | ppd decode tokens/s | vs baseline (decode) |",
                  "|---|---|---|---|---|", *speed]
    return "\n".join(lines)


if __name__ == "__main__":
    root = Path(sys.argv[1])
    print(best(root) if "--best" in sys.argv[2:] else table(root))
