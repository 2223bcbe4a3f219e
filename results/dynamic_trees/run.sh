#!/usr/bin/env bash
# Accept length of the shipped prompt tokens' trees, fixed and confident, replayed on the greedy float32 answers
# of the four benchmarks (CPU, float32). From the project's root: bash results/dynamic_trees/run.sh
set -euo pipefail
T=results/train/v7/runs/maps16-lr3e-3-e3/trees
A=results/eval/h200_captured/answers
for bench in mt_bench gsm8k humaneval alpaca_eval; do
  python -m eval.replay --answers $A/$bench-baseline-float32-0000.jsonl --dtype float32 --choices fixed confident \
    --trees $T/tree_8.json $T/tree_16.json $T/tree_32.json $T/tree_64.json $T/tree_128.json \
    --output results/dynamic_trees/$bench.json 2>&1 | grep -v "it/s\]\|s/it\]\|answer/s\]\|s/answer\]" | tee results/dynamic_trees/$bench.log
done
