#!/usr/bin/env bash
# Twenty-second session, one H200: does Inductor's GEMM autotuning ($PPD_AUTOTUNE=gemm) make the tree step
# cheaper against the one-row step? Step times of the 16- and 64-row trees and the one-row step, 300 tokens
# of context at batch 1, 4 and 16, then 8K context at batch 16 (issue 18's missed case), each with and without.
set -u
cd /root/tree
export PYTHONPATH=/root/ppd-site:/root/tree HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/root/inductor
t() { echo "== $(date +%T) $*"; }
R=/root/res/v17; mkdir -p $R/logs
T=results/train/v7/runs/maps16-lr3e-3-e3/trees
E="--dtype bfloat16 --capture compiled_graph"
{
  # compile both variants at once (the CPU's work), then time them one after the other from Inductor's cache
  t warm
  for v in gemm off; do
    PPD_AUTOTUNE=$v timeout 560 python -m eval.pick_tree $E --trees $T/tree_16.json $T/tree_64.json --steps 4 \
      --batch_sizes 1 16 --output $R/warm_$v.json > $R/logs/warm_$v.log 2>&1 &
  done
  wait; t warmed; tail -3 $R/logs/warm_*.log
  for v in gemm off; do
    t pick-$v; PPD_AUTOTUNE=$v timeout 300 python -m eval.pick_tree $E --trees $T/tree_16.json $T/tree_64.json \
      --steps 32 --batch_sizes 1 4 16 --output $R/pick_$v.json > $R/logs/pick_$v.log 2>&1; echo "rc $?"
    tail -12 $R/logs/pick_$v.log
  done
  for v in off gemm; do
    t pick8k-$v; PPD_GROUPED_SDPA=split PPD_AUTOTUNE=$v timeout 400 python -m eval.pick_tree $E --context 8000 \
      --max_seq_len 8448 --trees $T/tree_16.json --steps 24 --batch_sizes 16 --output $R/pick_8k_b16_$v.json \
      > $R/logs/pick_8k_b16_$v.log 2>&1; echo "rc $?"; tail -8 $R/logs/pick_8k_b16_$v.log
  done
  t end
} > /root/res/job.log 2>&1
echo "JOB DONE" >> /root/res/job.log
