#!/usr/bin/env bash
# Choose between two runs' prompt tokens on replies neither was trained or held out on: ShareGPT records
# 10,000-10,149 (the runs' data used the first 3,000), minus any whose first prompt appears in those 3,000,
# answered greedily in fp32 by the model here (2 turns, <= 256 tokens a reply), then each run's tokens and its
# own trees replayed on them (exact greedy replay, fp32). CPU; results in results/train/v7/compare/.
#   RUNS="results/train/v6/runs/maps16-lr3e-3:ADAPTER_DIR ..." bash results/train/v7/compare.sh
# where each entry is TREES_RUN_FOLDER:ADAPTER_FOLDER (the weights of a run may live elsewhere).
set -euo pipefail
O=results/train/v7/compare; W=${WORK:-/tmp/ppd-v7-compare}; mkdir -p "$O" "$W"
[ -f "$W/prompts.jsonl" ] || python - "$W/prompts.jsonl" <<'PY'
import json, os, sys
from ppd.conversations import load_conversations, user_texts
records = load_conversations().records
seen = {tuple(user_texts(r)[:1]) for r in records[:3000]}
with open(sys.argv[1] + ".tmp", "w") as out:
    for r in records[10000:10150]:
        if user_texts(r)[:1] and tuple(user_texts(r)[:1]) not in seen:
            out.write(json.dumps(r) + "\n")
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
PY
[ -d "$W/sd" ] || python -m data_gen.generate --dataset_type conversations --data_path "$W/prompts.jsonl" \
  --output_path "$W/sd" --max_turns 2 --max_new_tokens 256 --batch_size 64 --decode_method baseline \
  --dtype float32 2>&1 | tail -5
for entry in $RUNS; do
  run=${entry%%:*}; adapter=${entry#*:}; name=$(basename "$run")
  [ -f "$O/$name.json" ] || python -m eval.replay --conversations "$W/sd" --eval_size 0 --adapter "$adapter" \
    --dtype float32 --device cpu --trees "$run/trees/tree_16.json" "$run/trees/tree_64.json" \
    "$run/trees/tree_128.json" --output "$O/$name.json" 2>&1 | tail -3
done
