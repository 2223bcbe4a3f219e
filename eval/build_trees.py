"""Build tree sets for several row budgets from measured prompt-token accuracies.

Usage:
    python -m eval.build_trees --accuracy runs/smollm2-ppd/training_log.json --budgets 8 16 32 64 \\
        --output_dir results/trees

``--accuracy`` is a training log (its ``rank_accuracy``: for each prompt token, the share of held-out
examples whose target is at each rank of its top-K) or a JSON file holding that [N][K] table alone.
Writes ``tree_<budget>.json`` per budget (``ppd.tree.TreeSet`` format) and prints each tree's size.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ppd.tree_builder import build_tree_set


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.build_trees", description=__doc__.split("\n")[0])
    parser.add_argument("--accuracy", required=True, help="training_log.json or a JSON [N][K] table")
    parser.add_argument("--budgets", type=int, nargs="+", required=True, help="rows per forward pass")
    parser.add_argument("--num_ensemble", type=int, default=None, help="default: the adapter's (from the log)")
    parser.add_argument("--output_dir", required=True)
    return parser


def read_accuracy(path: str) -> tuple[list[list[float]], int, dict]:
    data = json.loads(Path(path).read_text())
    if isinstance(data, list):
        return data, 1, {"accuracy_source": str(path)}
    if not data.get("rank_accuracy"):
        raise ValueError(f"{path} has no rank_accuracy (was the training run given an evaluation set?)")
    meta = {"accuracy_source": str(path), "adapter_base_model": data["prompt_tokens"]["base_model"],
            "eval_examples": data["dataset"]["eval_examples"]}
    return data["rank_accuracy"], int(data["prompt_tokens"]["num_ensemble"]), meta


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    accuracy, num_ensemble, meta = read_accuracy(args.accuracy)
    num_ensemble = args.num_ensemble or num_ensemble
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for budget in args.budgets:
        trees = build_tree_set(accuracy, budget, num_ensemble, metadata=meta)
        trees.save(out / f"tree_{budget}.json")
        sizes = {key: len(tree.paths) for key, tree in trees.trees.items()}
        print(f"budget {budget}: candidates per depth key {sizes} -> {out / f'tree_{budget}.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
