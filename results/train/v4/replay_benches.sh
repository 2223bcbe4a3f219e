#!/usr/bin/env bash
# Accept length on Alpaca Eval, HumanEval and GSM8K (and MT-Bench) by exact greedy replay of the fp32 baseline's
# answers (results/eval/h200_captured/answers/), for the prompt tokens shipped now (v7's low-rank maps trained for 3
# epochs, the packaged adapter), v6's (2 epochs; packaged until commit f30bdc3, whose tree holds its weights: the
# replays below were made then), v4's deep ones and the plain ones shipped before, each with its own trees at
# 16 / 64 / 512 rows. Runs on a CPU: python -m eval.replay, one forward per answer.
set -euo pipefail
A=results/eval/h200_captured/answers; O=results/train/v4/replay; mkdir -p "$O"
declare -A TREES=([deep-e2]="results/train/v4/runs/deep-e2/trees" [shipped_before]="results/trees/h200/trees"
                  [maps16-lr3e-3-e3]="results/train/v7/runs/maps16-lr3e-3-e3/trees")
declare -A ADAPTER=([deep-e2]="results/train/v4/runs/deep-e2" [shipped_before]="results/train/v4/shipped_before"
                    [maps16-lr3e-3-e3]="ppd/adapters/smollm2-135m-instruct")
for run in maps16-lr3e-3-e3 deep-e2 shipped_before; do
  for bench in alpaca_eval gsm8k humaneval; do
    [ -f "$O/$bench-$run.json" ] && continue
    python -m eval.replay --answers "$A/$bench-baseline-float32-0000.jsonl" --adapter "${ADAPTER[$run]}" \
      --dtype float32 --device cpu --trees "${TREES[$run]}"/tree_{16,64,512}.json --output "$O/$bench-$run.json"
  done
done
