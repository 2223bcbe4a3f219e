"""Pick the tree budget for this device: the tree set maximising expected tokens per step / step time.

Usage:
    python -m eval.build_trees --accuracy results/trees/accuracy.json --budgets 4 6 8 16 32 64 128 256 \\
        --output_dir results/trees
    python -m eval.pick_tree --trees results/trees/tree_*.json --context 300 [--capture auto] [--dtype ...] \\
        --output results/trees/pick_cpu.json [--install]
    python -m eval.pick_tree --trees results/trees/tree_*.json --batch_sizes 1 2 4 8 16 32 64 128 \\
        --dtype bfloat16 --output results/serving/policy_pick.json [--install]

Each tree set's expected tokens per step comes from the accuracies it was built from (its metadata), or, with
``--accept_lengths``, from the accept length an ``eval.replay`` record measured for it on real answers (the only
way a ``confident`` set is rated for what its choice adds: its accuracy table is its fixed tree's); its
time is the decoder's whole step as the engine runs it on this device, in this dtype and capture mode
(``eval.step_latency``: compiled and captured on CUDA by default). The one-row baseline is scored the
same way. ``--install`` copies the best tree into the adapter directory as
``tree_<device type>_<dtype>.json``, where the decoder finds it for that device and dtype; where the
baseline wins, it says so, and the best tree is still what PPD uses on that device. ``--captures graph
compiled_graph`` times every tree under each capture mode and reports the best mode for the tree step
and for the one-row step (``best_tree_capture``, ``baseline_capture``).
With ``--batch_sizes`` every step time is written to ``--output`` as soon as it is measured, and the same
command run again after a cut-off run times only what is missing (the policy is installed once all are).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from ppd.cli import add_adapter_args, add_engine_args, add_model_args, load_decoder_or_exit, tree_files
from ppd.policy import BatchPolicy
from ppd.prompt_tokens import packaged_adapter
from ppd.tree import TreeSet
from ppd.tree_builder import expected_tokens_per_step

from .records import PartialRun, SettingsMismatch, environment, run_settings, write_json
from .step_latency import step_time


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.pick_tree", description=__doc__.split("\n")[0])
    add_model_args(parser)
    add_adapter_args(parser)
    add_engine_args(parser)
    parser.add_argument("--trees", nargs="+", required=True, help="tree-set JSON files (from eval.build_trees)")
    parser.add_argument("--context", type=int, default=300, help="prompt tokens before the timed steps")
    parser.add_argument("--steps", type=int, default=32, help="timed steps per tree")
    parser.add_argument("--captures", nargs="+", default=None, metavar="MODE",
                        help="time every tree under each of these capture modes and pick the best pair "
                             "(default: --capture alone)")
    parser.add_argument("--batch_sizes", nargs="+", type=int, default=None, metavar="B",
                        help="make a batch policy: time every tree at each of these batch sizes (powers of two)")
    parser.add_argument("--accept_lengths", default=None, metavar="REPLAY_JSON",
                        help="rate each tree by the accept length this eval.replay record (same adapter) measured "
                             "for it, instead of the expectation from its accuracy table; every tree must be in it")
    parser.add_argument("--install", action="store_true",
                        help="copy the best tree (or, with --batch_sizes, the policy) into the adapter directory")
    parser.add_argument("--output", default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.batch_sizes is not None:
        bad = [b for b in args.batch_sizes if b < 1 or b & (b - 1)]
        if bad:
            parser.error(f"--batch_sizes must be powers of two (the decoder's buckets), got {bad}")
        if args.captures:
            parser.error("--batch_sizes times one capture mode (--capture), not --captures")
        if args.max_seq_len is None:  # each tree's caches at every batch size: keep them to what the timing needs
            args.max_seq_len = args.context + 8 * args.steps + 512
    sets = tree_files(args.trees, args.tree_choice, args.lookup)
    if args.accept_lengths is None:
        chained = [name for name, trees in sets.items() if trees.lookup]
        if chained:
            print(f"error: {', '.join(chained)} verify a lookup chain, which no accuracy table rates: rate them with "
                  "--accept_lengths (an eval.replay record)", file=sys.stderr)
            return 2
        missing = [name for name, trees in sets.items() if not trees.metadata.get("accuracy")]
        if missing:
            print(f"error: {', '.join(missing)} record no accuracy table in their metadata (make them with "
                  "eval.build_trees, or rate them with --accept_lengths)", file=sys.stderr)
            return 2
    loaded = load_decoder_or_exit(args)
    try:
        expected = expected_per_step(sets, args.accept_lengths, loaded.adapter)
    except (OSError, ValueError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.batch_sizes is not None:
        return pick_policy(args, loaded, sets, expected)
    return pick_one(args, loaded, sets, expected)


def expected_tokens(trees: TreeSet) -> float:
    """Expected tokens per step of a tree set, from the accuracies it was built from (its deepest tree)."""
    return expected_tokens_per_step(trees.trees[trees.num_prompt_tokens], trees.metadata["accuracy"])


def replayed_accept_lengths(path: str, adapter: str) -> dict[tuple, float]:
    """The accept lengths an ``eval.replay`` record measured, by tree set (:meth:`TreeSet.identity`, each row's
    file read with the row's choice); refused where the record is of another adapter."""
    record = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(record, dict) or not isinstance(record.get("trees"), list):
        raise ValueError(f"{path} is not an eval.replay record (no list of trees)")
    if record.get("adapter") != adapter:
        raise ValueError(f"{path} measured the prompt tokens of {record.get('adapter')!r}, not of {adapter!r}")
    found = {}
    for row in record["trees"]:
        trees = TreeSet.load(row["tree"]).chosen(row.get("choice", "fixed")).with_lookup(int(row.get("lookup", 0)))
        found[trees.identity()] = float(row["accept_length"])
    return found


def expected_per_step(sets: dict[str, TreeSet], accept_lengths: str | None, adapter: str) -> dict[str, float]:
    """Each tree set's expected tokens a step: from its accuracy table, or from the replay record
    ``accept_lengths`` (which must hold every set)."""
    if accept_lengths is None:
        return {name: expected_tokens(trees) for name, trees in sets.items()}
    measured = replayed_accept_lengths(accept_lengths, adapter)
    missing = [name for name, trees in sets.items() if trees.identity() not in measured]
    if missing:
        raise ValueError(f"{accept_lengths} holds no accept length for {', '.join(missing)} (replay them: "
                         "python -m eval.replay --trees ... --choices fixed confident)")
    return {name: measured[trees.identity()] for name, trees in sets.items()}


def dtype_name(decoder) -> str:
    return str(decoder.dtype).removeprefix("torch.")


def target_dir(args, loaded) -> Path:
    return Path(args.adapter) if args.adapter else packaged_adapter(loaded.info.model_id)


def pick_one(args, loaded, sets: dict[str, TreeSet], expected: dict[str, float]) -> int:
    decoder = loaded.decoder
    device = decoder.device
    modes = args.captures or [args.capture]
    decoders = {name: decoder.with_trees(trees) for name, trees in sets.items()}
    rows = []
    with torch.no_grad():
        for mode in modes:
            one_row = step_time(decoder, "baseline", args.context, args.steps, mode)
            rows.append({"tree": "baseline (1 row)", "capture": mode, "rows": 1, "expected_tokens": 1.0,
                         "latency_s": one_row["step_ms"] / 1e3, "capture_s": one_row["capture_s"],
                         "tokens_per_s": 1e3 / one_row["step_ms"]})
            for name in sets:
                timed = step_time(decoders[name], "ppd", args.context, args.steps, mode)
                latency = timed["step_ms"] / 1e3
                rows.append({"tree": name, "capture": mode, "rows": timed["rows"], "expected_tokens": expected[name],
                             "latency_s": latency, "capture_s": timed["capture_s"],
                             "tokens_per_s": expected[name] / latency})
    baselines = [r for r in rows if r["rows"] == 1 and r["tree"].startswith("baseline")]
    trees_only = [r for r in rows if r not in baselines]
    best = max(rows, key=lambda r: r["tokens_per_s"])
    best_tree = max(trees_only, key=lambda r: r["tokens_per_s"])
    best_baseline = max(baselines, key=lambda r: r["tokens_per_s"])
    print(f"step times: {decoder.dtype}, {args.context} tokens of context")
    print("| capture | tree | rows | expected tokens / step | step ms | capture s | expected tokens / s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        mark = " **picked**" if r is best else ""
        print(f"| {r['capture']} | {r['tree']}{mark} | {r['rows']} | {r['expected_tokens']:.2f} | "
              f"{r['latency_s'] * 1e3:.2f} | {r['capture_s']:.1f} | {r['tokens_per_s']:.1f} |")
    if best in baselines:
        print(f"the one-row baseline is faster on this device than any tree here (best: {best_tree['tree']}): "
              "decode with --method baseline")
    if args.install:
        # The best tree is what PPD uses on this device type, even where the baseline is faster.
        target = target_dir(args, loaded) / f"tree_{device.type}_{dtype_name(decoder)}.json"
        if best_tree["tree"] in args.trees:
            shutil.copyfile(best_tree["tree"], target)
        else:  # a file's trees with their choice changed by --tree_choice
            sets[best_tree["tree"]].save(target)
        print(f"installed {best_tree['tree']} as {target}")
    if args.output:
        write_json(args.output, {"context": args.context, "adapter": loaded.adapter, "rows": rows,
                                 "expected_from": args.accept_lengths or "accuracy tables",
                                 "dtype": dtype_name(decoder), "picked": best["tree"],
                                 "best_tree": best_tree["tree"], "best_tree_capture": best_tree["capture"],
                                 "baseline_capture": best_baseline["capture"], **environment(device)})
    return 0


def pick_policy(args, loaded, sets: dict[str, TreeSet], expected: dict[str, float]) -> int:
    """Time every tree and the one-row step at every batch size; keep the best per bucket."""
    decoder = loaded.decoder
    device = decoder.device
    batch_sizes = sorted(set(args.batch_sizes))
    # Each (tree, batch size) step time is written as soon as it is measured; a cut-off run of the same
    # settings (trees and batch sizes aside) is finished by the same command.
    try:
        partial = PartialRun(args.output, run_settings(args, device, ("trees", "batch_sizes", "output", "install")))
    except SettingsMismatch as error:
        print(f"pick_tree: error: {error}", file=sys.stderr)
        return 2
    header = {"context": args.context, "adapter": loaded.adapter, "dtype": dtype_name(decoder),
              "capture": args.capture, "expected_from": args.accept_lengths or "accuracy tables",
              **environment(device)}

    def measure(name: str, dec, method: str, per_step: float) -> None:
        for batch in batch_sizes:
            if partial.measured(tree=name, batch_size=batch):
                print(f"batch {batch:4d} | {name} | measured already in {args.output}", file=sys.stderr)
                continue
            timed = step_time(dec, method, args.context, args.steps, args.capture, batch_size=batch)
            latency = timed["step_ms"] / 1e3
            partial.add([{"tree": name, "batch_size": batch, "rows": timed["rows"], "expected_tokens": per_step,
                          "latency_s": latency, "capture_s": timed["capture_s"],
                          "tokens_per_s": batch * per_step / latency}], header)
            print(f"batch {batch:4d} | {name} | {timed['rows']} rows | {timed['step_ms']:.2f} ms | "
                  f"capture {timed['capture_s']:.1f} s, warm-up {timed['warmup_s']:.1f} s", file=sys.stderr)

    with torch.no_grad():
        measure("baseline (1 row)", decoder, "baseline", 1.0)
        for name, trees in sets.items():
            if all(partial.measured(tree=name, batch_size=batch) for batch in batch_sizes):
                continue  # no decoder (nor its caches) for a tree measured before the cut
            tree_decoder = decoder.with_trees(trees)
            measure(name, tree_decoder, "ppd", expected[name])
            del tree_decoder  # its caches and graphs go before the next tree's are made
            if device.type == "cuda":
                torch.cuda.empty_cache()
    names = ["baseline (1 row)", *sets]
    rows = [r for name in names for batch in batch_sizes for r in partial.measured(tree=name, batch_size=batch)]
    picks = []
    for batch in batch_sizes:
        here = [r for r in rows if r["batch_size"] == batch]
        best = max(here, key=lambda r: r["tokens_per_s"])
        baseline = next(r for r in here if r["rows"] == 1 and r["tree"].startswith("baseline"))
        picks.append({"batch_size": batch, "tree": None if best is baseline else best["tree"],
                      "tokens_per_s": best["tokens_per_s"], "baseline_tokens_per_s": baseline["tokens_per_s"],
                      "expected_speedup": best["tokens_per_s"] / baseline["tokens_per_s"]})
    print(f"step times: {decoder.dtype}, {args.context} tokens of context, capture {args.capture}")
    print("| batch | tree | rows | expected tokens / step | step ms | expected tokens / s |")
    print("|---|---|---|---|---|---|")
    chosen = {(p["batch_size"], p["tree"]) for p in picks}
    for r in rows:
        tree = None if r["tree"].startswith("baseline") else r["tree"]
        mark = " **picked**" if (r["batch_size"], tree) in chosen else ""
        print(f"| {r['batch_size']} | {r['tree']}{mark} | {r['rows']} | {r['expected_tokens']:.2f} | "
              f"{r['latency_s'] * 1e3:.2f} | {r['tokens_per_s']:.0f} |")
    policy = BatchPolicy(tuple(p["batch_size"] for p in picks),
                         tuple(None if p["tree"] is None else sets[p["tree"]] for p in picks),
                         {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                          "dtype": dtype_name(decoder), "capture": args.capture, "context": args.context,
                          "expected_from": header["expected_from"], "picks": picks})
    print(f"batch policy: {policy.describe()}")
    if args.install:
        target = target_dir(args, loaded) / f"policy_{device.type}_{dtype_name(decoder)}.json"
        policy.save(target)
        print(f"installed the batch policy as {target}")
    partial.finish({**header, "rows": rows, "picks": picks, "policy": policy.to_json()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
