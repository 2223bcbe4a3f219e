"""The shipped CUDA bf16 batch policy for the deep prompt tokens, from this session's two H100 pick runs.

`policy_pick_b1-32.json` (eval.pick_tree, trees of 16, 32 and 64 rows, batches 1-32) is complete; the first
run (tree of 8 rows, batches 1-128) was cut off by the call's time limit after timing that tree, so only its
log's step times remain (`policy_pick_tree8_b1-128.log`). Buckets 1-32 take the complete run's picks;
buckets 64 and 128 take the 8-row tree where its expected tokens/s beat the one-row step in the first run
(the larger trees were not timed there).

Step times at 300 tokens of context overstate what a tree gains in a real batch: decoding MT-Bench on an
H200 (`h200/batch_speed_bfloat16.json`, every bucket in one run), the policy's trees lost to the one-row
step from batch 8 up (0.91x at 8 down to 0.46x at 128): a static batch waits for its slowest row, whose
accept length is below the batch's mean, and the tree steps there took 10-30% longer than the pick timed.
So the buckets where that end-to-end run measured PPD below the baseline run the one-row step.
    python results/deep_gpu/compose_policy.py
"""

import json
import re

from eval.pick_tree import expected_tokens
from ppd.policy import BatchPolicy
from ppd.prompt_tokens import packaged_adapter
from ppd.tree import TreeSet

HERE = "results/deep_gpu/h100"
END_TO_END = "results/deep_gpu/h200/batch_speed_bfloat16.json"
TREE_8 = "results/train/v4/runs/deep-e2/trees/tree_8.json"

complete = json.load(open(f"{HERE}/policy_pick_b1-32.json"))
policy = BatchPolicy.from_json(complete["policy"])
step_ms: dict[tuple[str, int], float] = {}
for line in open(f"{HERE}/policy_pick_tree8_b1-128.log"):
    found = re.match(r"batch\s+(\d+) \| (.+?) \| \d+ rows \| ([\d.]+) ms", line)
    if found:
        step_ms[(found[2], int(found[1]))] = float(found[3])
tree_8 = TreeSet.load(TREE_8)
expected = expected_tokens(tree_8)
picks = list(complete["picks"])
buckets, trees = list(policy.buckets), list(policy.trees)
for batch in (64, 128):
    ppd = batch * expected / (step_ms[(TREE_8, batch)] / 1e3)
    baseline = batch / (step_ms[("baseline (1 row)", batch)] / 1e3)
    wins = ppd > baseline
    buckets.append(batch)
    trees.append(tree_8 if wins else None)
    picks.append({"batch_size": batch, "tree": TREE_8 if wins else None, "tokens_per_s": max(ppd, baseline),
                  "baseline_tokens_per_s": baseline, "expected_speedup": max(ppd, baseline) / baseline,
                  "from": "policy_pick_tree8_b1-128.log (only the 8-row tree timed)"})
# Speculation off where the end-to-end run measured PPD slower than the baseline.
measured = json.load(open(END_TO_END))
speedup = {r["batch_size"]: r["speedup"] for r in measured["rows"] if r["variant"] == "ppd"}
off = sorted(b for b in buckets if speedup.get(b, 1.0) < 1.0)
for i, batch in enumerate(buckets):
    if batch in off:
        trees[i] = None
        picks[i] = {**picks[i], "tree": None, "switched_off": f"{speedup[batch]:.2f}x end to end ({END_TO_END})"}
metadata = {**policy.metadata, "picks": picks, "composed_by": "results/deep_gpu/compose_policy.py",
            "device": complete["device"], "torch": complete["torch"],
            "switched_off": {"batch_sizes": off, "from": END_TO_END, "device": measured["device"]}}
shipped = BatchPolicy(tuple(buckets), tuple(trees), metadata)
target = packaged_adapter("HuggingFaceTB/SmolLM2-135M-Instruct") / "policy_cuda_bfloat16.json"
shipped.save(target)
print(f"{shipped.describe()}\nwritten to {target}")
for p in picks:
    print(f"batch {p['batch_size']:4d}: {p['tree']}  expected {p['expected_speedup']:.2f}x"
          + (f", off: {p['switched_off']}" if "switched_off" in p else ""))
