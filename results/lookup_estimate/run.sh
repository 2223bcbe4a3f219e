#!/usr/bin/env bash
# Prompt lookup beside PPD's tree, estimated by replay on the greedy float32 answers of the four benchmarks (CPU,
# float32, the shipped prompt tokens). From the project's root: bash results/lookup_estimate/run.sh
set -euo pipefail
T=results/train/v7/runs/maps16-lr3e-3-e3/trees
A=results/eval/h200_captured/answers
for bench in ${BENCHES:-mt_bench humaneval gsm8k alpaca_eval}; do
  python results/lookup_estimate/estimate.py --answers $A/$bench-baseline-float32-0000.jsonl --dtype float32 \
    --trees $T/tree_8.json $T/tree_16.json $T/tree_32.json --chains 4 8 \
    --output results/lookup_estimate/$bench.json 2>&1 | grep -v "it/s\]\|s/it\]\|answer/s\]\|s/answer\]" \
    | tee results/lookup_estimate/$bench.log
done
