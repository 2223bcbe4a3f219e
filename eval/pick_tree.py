"""Pick the tree budget for this device: the tree set maximising expected tokens per step / step latency.

Usage:
    python -m eval.build_trees --accuracy results/trees/accuracy.json --budgets 4 6 8 16 32 64 128 256 \\
        --output_dir results/trees
    python -m eval.pick_tree --trees results/trees/tree_*.json --context 300 \\
        --output results/trees/pick_cpu.json [--install]

Each tree set's expected tokens per step comes from the accuracies it was built from (its metadata); its
latency is a measured forward of its row count on this device (``eval.forward_latency``). The one-row
baseline is scored the same way. ``--install`` copies the best tree into the adapter directory as
``tree_<device type>.json``, where the decoder finds it; where the baseline wins, it says so, and the
best tree is still what PPD uses on that device.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from ppd.cli import add_adapter_args, add_model_args, load_decoder
from ppd.prompt_tokens import packaged_adapter
from ppd.tree import TreeSet
from ppd.tree_builder import expected_tokens_per_step

from .forward_latency import measure
from .records import environment, write_json


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.pick_tree", description=__doc__.split("\n")[0])
    add_model_args(parser)
    add_adapter_args(parser)
    parser.add_argument("--trees", nargs="+", required=True, help="tree-set JSON files (from eval.build_trees)")
    parser.add_argument("--context", type=int, default=300, help="cached tokens during the timed forward")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--install", action="store_true", help="copy the best tree into the adapter directory")
    parser.add_argument("--output", default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    loaded = load_decoder(args)
    V = loaded.decoder.prompt_tokens.num_ensemble
    device = loaded.decoder.device
    one_row = measure(loaded.model, 1, args.context, args.repeats)
    rows = [{"tree": "baseline (1 row)", "rows": 1, "expected_tokens": 1.0, "latency_s": one_row,
             "tokens_per_s": 1.0 / one_row}]
    for name in args.trees:
        trees = TreeSet.load(name)
        accuracy = trees.metadata.get("accuracy")
        if not accuracy:
            print(f"error: {name} records no accuracy table in its metadata (make it with eval.build_trees)",
                  file=sys.stderr)
            return 2
        n_rows = trees.max_rows(V)
        latency = measure(loaded.model, n_rows, args.context, args.repeats)
        expected = expected_tokens_per_step(trees.trees[trees.num_prompt_tokens], accuracy)
        rows.append({"tree": name, "rows": n_rows, "expected_tokens": expected, "latency_s": latency,
                     "tokens_per_s": expected / latency})
    best = max(rows, key=lambda r: r["tokens_per_s"])
    print("| tree | rows | expected tokens / step | forward ms | expected tokens / s |")
    print("|---|---|---|---|---|")
    for r in rows:
        mark = " **picked**" if r is best else ""
        print(f"| {r['tree']}{mark} | {r['rows']} | {r['expected_tokens']:.2f} | {r['latency_s'] * 1e3:.1f} | "
              f"{r['tokens_per_s']:.1f} |")
    best_tree = max(rows[1:], key=lambda r: r["tokens_per_s"])
    if best is rows[0]:
        print(f"the one-row baseline is faster on this device than any tree here (best: {best_tree['tree']}): "
              "decode with --method baseline")
    if args.install:
        # The best tree is what PPD uses on this device type, even where the baseline is faster.
        target_dir = Path(args.adapter) if args.adapter else packaged_adapter(loaded.info.model_id)
        target = target_dir / f"tree_{device.type}.json"
        shutil.copyfile(best_tree["tree"], target)
        print(f"installed {best_tree['tree']} as {target}")
    if args.output:
        write_json(args.output, {"context": args.context, "adapter": loaded.adapter, "rows": rows,
                                 "picked": best["tree"], "best_tree": best_tree["tree"], **environment(device)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
