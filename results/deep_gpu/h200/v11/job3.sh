#!/usr/bin/env bash
# The maps as matrix products (the sums were slower) with prefills from CUDA graphs: batch 1, then batch 2 both ways.
set -u
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OUT=/root/res TORCHINDUCTOR_CACHE_DIR=/root/inductor PYTHONPATH=/root/ppd-site:/root/tree_mm
cd /root/tree_mm
t() { echo "== $(date +%T) $*"; }
R=/root/res/deep_gpu
ENGINE="--dtype bfloat16 --capture compiled_graph"
for run in 1:1 2:1 2:0; do
  IFS=: read -r b g <<< "$run"
  t mm-b$b-graphs$g; CUDA_VISIBLE_DEVICES=0 PPD_PREFILL_GRAPHS=$g timeout 400 python -m eval.batch_speed $ENGINE --batch_sizes $b \
    --bench mt_bench --max_new_tokens 256 --max_seq_len 1024 --output $R/batch_speed_mm_b${b}_graphs$g.json > $R/logs/mm_b${b}_graphs$g.log 2>&1
  grep "^batch" $R/logs/mm_b${b}_graphs$g.log | tail -3
done
t end; echo "JOB DONE"
