#!/usr/bin/env bash
# Ship the deep prompt tokens of a run (RUN, default v4's deep-e2) as the default model's adapter: the tokens,
# and trees built from their own measured paths (held-out self-distilled replies) at the row budgets measured
# for the shipped adapter before them (CPU 6 / 8 / 16 rows, CUDA 64 / 128 rows, the CUDA bf16 batch policy's
# 64-row tree). The budgets were timed with the earlier, plain prompt tokens; deep tokens add one small add
# per layer (and low-rank maps two small products).
#   RUN=path/to/run bash results/train/v4/ship.sh
set -euo pipefail
R=${RUN:-results/train/v4/runs/deep-e2}; A=ppd/adapters/smollm2-135m-instruct; T=$(mktemp -d)
python -m eval.build_trees --paths "$R/paths.json" --budgets 6 8 16 64 128 --output_dir "$T"
cp "$R/ppd_config.json" "$R/prompt_tokens.safetensors" "$A/"
cp "$T/tree_6.json" "$A/tree_cpu.json"; cp "$T/tree_8.json" "$A/tree_cpu_float32.json"
cp "$T/tree_16.json" "$A/tree_cpu_bfloat16.json"; cp "$T/tree_64.json" "$A/tree_cuda.json"
cp "$T/tree_128.json" "$A/tree_cuda_float32.json"
python - "$A/policy_cuda_bfloat16.json" "$T/tree_64.json" "$R" <<'PY'
import json, sys
from ppd.files import atomic_write_json
policy_path, tree_path, run = sys.argv[1:]
policy, tree = json.load(open(policy_path)), json.load(open(tree_path))
for bucket in policy["buckets"]:
    if bucket["trees"] is not None:  # the buckets that pay keep their row budget, with the new tokens' tree
        bucket["trees"] = tree
policy["metadata"]["trees_rebuilt"] = (f"trees of the same row budgets from the deep prompt tokens' measured "
                                       f"paths ({run}); the timings above are an earlier adapter's")
atomic_write_json(policy_path, policy)
PY
