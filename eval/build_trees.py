"""Build tree sets for several row budgets from measured prompt-token accuracies or accepted paths.

Usage:
    python -m eval.build_trees --accuracy runs/smollm2-ppd/training_log.json --budgets 8 16 32 64 \\
        --output_dir results/trees
    python -m eval.build_trees --paths results/trees/path_stats.json --budgets 8 16 32 64 --output_dir results/trees

``--accuracy`` is a training log (its ``rank_accuracy``: for each prompt token, the share of held-out
examples whose target is at each rank of its top-K) or a JSON file holding that [N][K] table alone; the
builder then takes successive guesses as independent. ``--paths`` is a ``path_stats.json`` of
``eval.replay --paths_output``: how often each path of ranks was accepted on known greedy answers, the
joint chances, each guess conditional on the ones before it being right.
Writes ``tree_<budget>.json`` per budget (``ppd.tree.TreeSet`` format) and prints each tree's size.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ppd.replay import PathStats
from ppd.tree_builder import build_tree_set


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.build_trees", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--accuracy", help="training_log.json or a JSON [N][K] table")
    source.add_argument("--paths", help="path_stats.json from eval.replay --paths_output")
    parser.add_argument("--budgets", type=int, nargs="+", required=True, help="rows per forward pass")
    parser.add_argument("--num_ensemble", type=int, default=None,
                        help="default: the adapter's (from the log or the path stats)")
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


def read_paths(path: str) -> tuple[PathStats, int, dict]:
    stats = PathStats.load(path)
    if not stats.positions:
        raise ValueError(f"{path} counts no positions")
    meta = {"paths_source": str(path), "adapter_base_model": stats.metadata.get("model"),
            "adapter": stats.metadata.get("adapter"), "answers": stats.metadata.get("answers")}
    return stats, int(stats.metadata.get("num_ensemble", 1)), meta


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        source, num_ensemble, meta = read_paths(args.paths) if args.paths else read_accuracy(args.accuracy)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    num_ensemble = args.num_ensemble or num_ensemble
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for budget in args.budgets:
        trees = build_tree_set(source, budget, num_ensemble, metadata=meta)
        trees.save(out / f"tree_{budget}.json")
        sizes = {key: len(tree.paths) for key, tree in trees.trees.items()}
        print(f"budget {budget}: candidates per depth key {sizes} -> {out / f'tree_{budget}.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
