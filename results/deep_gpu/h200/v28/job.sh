#!/usr/bin/env bash
# Prepared in the thirtieth session for the next H200 lease (not run yet). Stage with LONG=1:
# `LONG=1 bash results/deep_gpu/lease/stage.sh`, then the calls of ../../lease/README.md; outputs in /root/res/v28.
# v27 found the 16-row chained tree's timed generation at 8K and batch 16 raising the peak 17.5 GiB against the
# baseline's 4.9, prefill included. (1) Where the prefill's memory goes, by the allocator's history; (2) the eager
# steps' own working memory at 8K against 1K (issue 18: O(T^2 + T*B), not growing with the cache), from
# eval.long_context's new step_rise_bytes; (3) if time is left, the server at 16 clients with the 8-row chained
# tree, whose result v27 lost with its machine.
set -u
source /root/tree/results/deep_gpu/lease/job_env.sh v28
E="--dtype bfloat16 --capture compiled_graph"
T=results/lookup/trees
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  gunzip -kf /root/ppd-stage/sharegpt_first3000.json.gz
  t prefill_memory; timeout 500 python results/deep_gpu/prefill_memory.py $E --attention dense --contexts 8192 \
    --batch_sizes 16 --methods baseline ppd --trees $T/tree_16_lookup8.json \
    --data_path /root/ppd-stage/sharegpt_first3000.json --max_new_tokens 128 --max_seq_len 8448 \
    --output $R/prefill_memory.json > $R/logs/prefill_memory.log 2>&1; echo "rc $?"; tail -n 30 $R/logs/prefill_memory.log
  t step_memory; timeout 600 python -m eval.long_context --dtype bfloat16 --capture eager --attention dense \
    --contexts 1024 8192 --batch_sizes 16 --methods baseline --trees $T/tree_16_lookup8.json \
    --data_path /root/ppd-stage/sharegpt_first3000.json --max_new_tokens 16 --max_seq_len 8448 \
    --output $R/long_context_step_memory_eager.json > $R/logs/step_memory.log 2>&1; echo "rc $?"
  grep -E "^\|" $R/logs/step_memory.log | cut -c1-260
  t load16_tree8; timeout 500 python -m eval.load --launch --model smollm2-135m-instruct \
    --server_args="$E --max_seq_len 1024 --max_batch 16 --tree $T/tree_8_lookup8.json" --clients 16 \
    --methods ppd baseline --bench mt_bench --max_tokens 256 --output $R/load16_tree8.json \
    > $R/logs/load16_tree8.log 2>&1; echo "rc $?"; grep -E "^\|" $R/logs/load16_tree8.log | head -4
  t end
} > /root/res/job.log 2>&1
echo "JOB DONE" >> /root/res/job.log
