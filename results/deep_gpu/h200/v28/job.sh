#!/usr/bin/env bash
# The thirty-first session's H200 lease. Stage with LONG=1: `LONG=1 bash results/deep_gpu/lease/stage.sh`, then the
# calls of ../../lease/README.md; outputs in /root/res/v28.
# v27 found the 16-row chained tree's timed generation at 8K and batch 16 raising the peak 17.5 GiB against the
# baseline's 4.9, prefill included. (1) Where the prefill's memory goes, by the allocator's history, with the
# compiled prefill and then the eager one; (2) the eager steps' own working memory at 1K, 4K and 8K (issue 18:
# O(T^2 + T*B), not growing with the cache), from eval.long_context's step_rise_bytes.
set -u
source /root/tree/results/deep_gpu/lease/job_env.sh v28
T=results/lookup/trees
P="--attention dense --contexts 8192 --batch_sizes 16 --methods baseline ppd --trees $T/tree_16_lookup8.json
   --data_path /root/ppd-stage/sharegpt_first3000.json --max_new_tokens 128 --max_seq_len 8448"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  gunzip -kf /root/ppd-stage/sharegpt_first3000.json.gz
  for capture in compiled_graph eager; do
    t prefill_memory $capture; timeout 420 python results/deep_gpu/prefill_memory.py --dtype bfloat16 \
      --capture $capture $P --output $R/prefill_memory_$capture.json > $R/logs/prefill_memory_$capture.log 2>&1
    echo "rc $?"; grep -v Loading $R/logs/prefill_memory_$capture.log | tail -n 24 | cut -c1-400
  done
  t step_memory; timeout 600 python -m eval.long_context --dtype bfloat16 --capture eager --attention dense \
    --contexts 1024 4096 8192 --batch_sizes 16 --methods baseline --trees $T/tree_16_lookup8.json \
    --data_path /root/ppd-stage/sharegpt_first3000.json --max_new_tokens 16 --max_seq_len 8448 \
    --output $R/long_context_step_memory_eager.json > $R/logs/step_memory.log 2>&1; echo "rc $?"
  grep -E "^\|" $R/logs/step_memory.log | cut -c1-260
  t end
} > /root/res/job.log 2>&1
echo "JOB DONE" >> /root/res/job.log
