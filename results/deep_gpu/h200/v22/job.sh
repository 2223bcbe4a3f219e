#!/usr/bin/env bash
# Twenty-sixth session, one H200 (prepared by the twenty-fifth as a longer job, cut to what one lease holds).
# (1) The HTTP server under load, 16/4/1/64 clients, with the shipped batch policy (the 32-row tree with a lookup
# chain of 8 up to 16 rows, the one-row step from 32) and the batcher that runs one step ahead: issue 14's
# 16-client target, not measured since those changes. (2) Decoder throughput through the continuous batcher at
# batch 16, 4 and 1: the baseline, the policy and prompt lookup alone in the engine (lookup_only_8.json: the
# root's prompt rows and a chain of 8), against h200/v21's figures taken before the run-ahead.
# Started by results/deep_gpu/lease/launch.sh after the staging calls; outputs in /root/res/v22.
set -u
cd /root/tree
export PYTHONPATH=/root/ppd-site:/root/tree HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=/root/inductor
t() { echo "== $(date +%T) $*"; }
R=/root/res/v22; mkdir -p $R/logs
E="--dtype bfloat16 --capture compiled_graph"
LO=results/lookup/trees/lookup_only_8.json
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  t load; timeout 780 python -m eval.load --launch --model smollm2-135m-instruct \
    --server_args="--dtype bfloat16 --capture compiled_graph --max_batch 64 --max_seq_len 1024" \
    --clients 16 4 1 64 --methods ppd baseline --bench mt_bench --max_tokens 256 \
    --output $R/load_bfloat16.json --plot $R/load_bfloat16.png > $R/logs/load.log 2>&1; echo "rc $?"
  grep -E "^\|" $R/logs/load.log | head -20
  t continuous; timeout 780 python -m eval.batch_speed $E --batching continuous --batch_sizes 16 4 1 \
    --bench mt_bench --max_new_tokens 256 --max_seq_len 1024 --trees $LO --output $R/batch_speed_continuous.json \
    --plot $R/batch_speed_continuous.png > $R/logs/continuous.log 2>&1; echo "rc $?"
  grep -E "^batch|^\|" $R/logs/continuous.log | cut -c1-220
  t end
} > /root/res/job.log 2>&1
echo "JOB DONE" >> /root/res/job.log
