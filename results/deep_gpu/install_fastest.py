"""Install into the shipped CUDA bf16 batch policy, for each batch size an `eval.batch_speed` run timed, the
tree of the variant that decoded fastest end to end (the policy's own tree, a `--trees` one, or none where
the baseline won).

End-to-end decoding of 32+ MT-Bench first turns per batch size is the measure here, not `eval.pick_tree`'s
step timing at one context length, which overstated what trees gain (see compose_policy.py). A bucket the
run did not time, or that the command does not name after the file, keeps what it had.

    python results/deep_gpu/install_fastest.py results/deep_gpu/h200/v7/batch_speed_tree128_b1-4.json
    python results/deep_gpu/install_fastest.py results/deep_gpu/h200/v7/batch_speed_grouped_heads.json 8
"""

import json
import sys

from eval.batch_speed import variant_name
from ppd.policy import BatchPolicy
from ppd.prompt_tokens import packaged_adapter
from ppd.tree import TreeSet

measured_path, only = sys.argv[1], {int(b) for b in sys.argv[2:]}
measured = json.load(open(measured_path))
extra = {variant_name(t): t for t in measured["settings"]["trees"] or []}
target = packaged_adapter("HuggingFaceTB/SmolLM2-135M-Instruct") / "policy_cuda_bfloat16.json"
policy = BatchPolicy.load(target)
trees = list(policy.trees)
picks = []
for batch in sorted({r["batch_size"] for r in measured["rows"]} & (only or {r["batch_size"] for r in measured["rows"]})):
    rows = [r for r in measured["rows"] if r["batch_size"] == batch]
    best = max(rows, key=lambda r: r["tokens_per_s"])
    if batch not in policy.buckets:
        raise SystemExit(f"batch {batch} is not one of the policy's buckets {policy.buckets}")
    i = policy.buckets.index(batch)
    if best["variant"] == "baseline":
        trees[i], source = None, None
    elif best["variant"] == "ppd":
        source = "the policy's own tree, kept"
    else:
        source = extra[best["variant"]]
        trees[i] = TreeSet.load(source)
    picks.append({"batch_size": batch, "tree": source, "tree_rows": best["tree_rows"],
                  "speedup": round(best["speedup"], 3), "accept_length": round(best["accept_length"], 3),
                  "beside": {r["variant"]: round(r["speedup"], 3) for r in rows}})
earlier = policy.metadata.get("end_to_end_picks", [])
earlier = [earlier] if isinstance(earlier, dict) else earlier
same = {p["batch_size"] for p in picks}
earlier = [e for e in earlier if e["from"] != measured_path or {p["batch_size"] for p in e["picks"]} != same]  # run again
metadata = {**policy.metadata, "end_to_end_picks": earlier + [{"from": measured_path, "device": measured["device"],
                                                              "command": measured["command"], "picks": picks}]}
off = metadata.get("switched_off")
if off:  # an earlier run's list of buckets without a tree: drop those that get one now
    given = {p["batch_size"] for p in picks if p["tree"] is not None}
    metadata["switched_off"] = {**off, "batch_sizes": [b for b in off["batch_sizes"] if b not in given]}
shipped = BatchPolicy(policy.buckets, tuple(trees), metadata, policy.max_widths)
shipped.save(target)
print(f"{shipped.describe()}\nwritten to {target}")
for p in picks:
    print(f"batch {p['batch_size']:4d}: {p['tree']} ({p['tree_rows']} rows) {p['speedup']:.2f}x, beside {p['beside']}")
