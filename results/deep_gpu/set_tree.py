"""Set the tree set of buckets of the shipped CUDA bf16 batch policy, and record why in its metadata (each change
appended to ``tree_changes``: the file, the buckets, the evidence and a note).

    python results/deep_gpu/set_tree.py TREE_FILE MAX_BATCH [MAX_BATCH ...] --evidence PATH --note TEXT
    python results/deep_gpu/set_tree.py none MAX_BATCH [...] --static --evidence PATH --note TEXT

``none`` takes the one-row step for those buckets. ``--static`` sets what the buckets' static batches run (the
policy's ``static_trees``; ``Decoder.generate`` over a list of prompts), leaving what the serving engine's
continuously refilled batches run as it is; without it, both ways of batching run the tree set.

Twenty-fourth session: with a prompt-lookup chain of 8 beside it, the 32-row tree decoded MT-Bench at batch 1 at
1.83x the baseline where the policy's 128-row tree gave 1.53x, in the same run (`h200/v20/speed_b1_live.log`):

    python results/deep_gpu/set_tree.py results/lookup/trees/tree_32_lookup8.json 1 \\
        --evidence results/deep_gpu/h200/v20/speed_b1_live.log --note "..."
"""

import argparse
import dataclasses

from ppd.policy import BatchPolicy
from ppd.prompt_tokens import packaged_adapter
from ppd.tree import TreeSet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tree", help="the tree set file the buckets take, or 'none' for the one-row step")
    parser.add_argument("buckets", nargs="+", type=int, help="the buckets, by their max_batch")
    parser.add_argument("--evidence", required=True, help="the measurement the change rests on")
    parser.add_argument("--note", required=True, help="what the measurement showed")
    parser.add_argument("--static", action="store_true",
                        help="set what the buckets' static batches run, not their continuously refilled ones")
    args = parser.parse_args()
    target = packaged_adapter("HuggingFaceTB/SmolLM2-135M-Instruct") / "policy_cuda_bfloat16.json"
    policy = BatchPolicy.load(target)
    unknown = sorted(set(args.buckets) - set(policy.buckets))
    if unknown:
        raise SystemExit(f"no bucket with max_batch {unknown}; the policy's are {list(policy.buckets)}")
    trees = None if args.tree == "none" else TreeSet.load(args.tree)
    replaced = {b: (t.metadata.get("budget") if t is not None else None)
                for b, t in ((b, policy.for_batch(b, args.static)) for b in args.buckets)}
    record = {"tree": args.tree, "lookup": trees.lookup if trees is not None else None, "buckets": args.buckets,
              "batching": "static" if args.static else "both", "replaced_budgets": replaced,
              "from": args.evidence, "note": args.note}
    metadata = {**policy.metadata, "tree_changes": [*policy.metadata.get("tree_changes", []), record]}
    if args.static:
        shipped = dataclasses.replace(policy, metadata=metadata,
                                      static_trees={**policy.static_trees, **{b: trees for b in args.buckets}})
    else:
        # both ways of batching: the buckets' static tree sets, if any, give way
        shipped = dataclasses.replace(policy, metadata=metadata, trees=tuple(
            trees if b in args.buckets else t for b, t in zip(policy.buckets, policy.trees)),
            static_trees={b: t for b, t in policy.static_trees.items() if b not in args.buckets})
    shipped.save(target)
    print(f"{shipped.describe()}\nwritten to {target}")


if __name__ == "__main__":
    main()
