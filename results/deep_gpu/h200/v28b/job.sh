#!/usr/bin/env bash
# The thirty-first session's second H200 lease, after v28 traced the chained tree's 8K prefill: (1) the prefill's
# allocations again with the layout's pair mask gathered (no [B, Q, Q] long indices) and the prefill's width a
# multiple of 16 (no padded mask copy per layer); (2) v27's 8K batch-16 run, compiled and captured, for the whole
# generation's peak and the end-to-end figures. Staged with LONG=1 as ../v28/job.sh; outputs in /root/res/v28b.
set -u
source /root/tree/results/deep_gpu/lease/job_env.sh v28b
T=results/lookup/trees
D=/root/ppd-stage/sharegpt_first3000.json
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  gunzip -kf $D.gz
  t prefill_memory eager; timeout 300 python results/deep_gpu/prefill_memory.py --dtype bfloat16 --capture eager \
    --attention dense --contexts 8192 --batch_sizes 16 --methods baseline --trees $T/tree_16_lookup8.json \
    --data_path $D --max_new_tokens 128 --max_seq_len 8448 --output $R/prefill_memory_eager.json \
    > $R/logs/prefill_memory_eager.log 2>&1
  echo "rc $?"; grep -v "Loading\|pow_by_natural" $R/logs/prefill_memory_eager.log | tail -n 16 | cut -c1-300
  t long8k_memory; timeout 500 python -m eval.long_context --dtype bfloat16 --capture compiled_graph --attention dense \
    --contexts 8192 --batch_sizes 16 --methods baseline --trees $T/tree_16_lookup8.json --data_path $D \
    --max_new_tokens 128 --max_seq_len 8448 --output $R/long_context_8k_b16_memory.json \
    > $R/logs/long8k_memory.log 2>&1; echo "rc $?"
  grep -E "^\|" $R/logs/long8k_memory.log | cut -c1-300
  t end
} > /root/res/job.log 2>&1
echo "JOB DONE" >> /root/res/job.log
