#!/usr/bin/env bash
# The rerun after job.sh's machine was released mid-run (its batch-1 rows are in README.md, its files were lost):
# batch 16 first, then batch 1, with fewer variants so that the lease's remaining minutes hold both. Outputs in
# /root/res/v20.
set -u
cd /root/tree
export PYTHONPATH=/root/ppd-site:/root/tree:/root/tree/.gpu/job/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 \
  TORCHINDUCTOR_CACHE_DIR=/root/inductor
t() { echo "== $(date +%T) $*"; }
R=/root/res/v20; mkdir -p $R/logs
T=results/train/v7/runs/maps16-lr3e-3-e3/trees
L=results/lookup/trees
{
  t speed; timeout 1500 python -m eval.batch_speed --dtype bfloat16 --capture compiled_graph --batch_sizes 16 1 \
    --bench mt_bench --max_new_tokens 256 --max_seq_len 1024 \
    --trees $T/tree_16.json $L/tree_16_lookup8.json $L/tree_32_lookup8.json \
    --output $R/batch_speed_lookup.json --plot $R/batch_speed_lookup.png > $R/logs/speed.log 2>&1
  echo "rc $?"; tail -n 8 $R/logs/speed.log
  t end
} > /root/res/job.log 2>&1
echo "JOB DONE" >> /root/res/job.log
