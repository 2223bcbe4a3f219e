#!/usr/bin/env bash
# Prepared in the twenty-fifth session for the next H200 lease (not run yet). (1) Decoder throughput through the
# continuous batcher, which now runs one step ahead on a GPU, at batch 16, 4 and 1: the baseline, the shipped policy
# (the 32-row tree with a chain of 8 up to 16) and prompt lookup alone in the engine (lookup_only_8.json: the root's
# prompt rows and a chain of 8), to compare with h200/v21's figures taken before the run-ahead. (2) The HTTP server
# under load, 16/4/1 clients (issue 14's 16-client target), with that policy. (3) The output head's product by row
# count and layout (v21's batch-16 profile: 173 us over 400 rows). (4) Static batches with prompt lookup alone.
# (5) A chain of 16 at batch 1.
# Launched as .gpu/job/launch.sh does (pointed at this file); outputs in /root/res/v22.
set -u
cd /root/tree
export PYTHONPATH=/root/ppd-site:/root/tree:/root/tree/.gpu/job/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=/root/inductor
t() { echo "== $(date +%T) $*"; }
R=/root/res/v22; mkdir -p $R/logs
E="--dtype bfloat16 --capture compiled_graph"
LO=results/lookup/trees/lookup_only_8.json
{
  t continuous; timeout 900 python -m eval.batch_speed $E --batching continuous --batch_sizes 16 4 1 \
    --bench mt_bench --max_new_tokens 256 --max_seq_len 1024 --trees $LO --output $R/batch_speed_continuous.json \
    --plot $R/batch_speed_continuous.png > $R/logs/continuous.log 2>&1; echo "rc $?"
  grep -E "^batch|^\|" $R/logs/continuous.log | cut -c1-200
  t load; timeout 700 python -m eval.load --launch --model smollm2-135m-instruct \
    --server_args="--dtype bfloat16 --capture compiled_graph --max_batch 16 --max_seq_len 1024" \
    --clients 16 4 1 --methods ppd baseline --bench mt_bench --max_tokens 256 \
    --output $R/load_bfloat16.json --plot $R/load_bfloat16.png > $R/logs/load.log 2>&1; echo "rc $?"
  grep -E "^\|" $R/logs/load.log | head -20
  t head; timeout 240 python results/deep_gpu/head_gemm.py --layouts linear pad16 pad64 chunks16 chunks48 transposed \
    --output $R/head_gemm.json > $R/logs/head_gemm.log 2>&1; echo "rc $?"; tail -n 17 $R/logs/head_gemm.log
  t static; timeout 600 python -m eval.batch_speed $E --batch_sizes 16 2 1 --bench mt_bench --max_new_tokens 256 \
    --max_seq_len 1024 --trees $LO --output $R/batch_speed_static.json > $R/logs/static.log 2>&1; echo "rc $?"
  grep -E "^batch|^\|" $R/logs/static.log | cut -c1-200
  # A chain of 16 beside the 32-row tree (replay: 3.461 against 3.190 with 8), batch 1; the chain's length is a
  # shape of the compiled step, so this compiles the batch-1 step once more.
  t chain16; timeout 400 python -m eval.batch_speed $E --batch_sizes 1 --bench mt_bench --max_new_tokens 256 \
    --max_seq_len 1024 --trees results/lookup/trees/tree_32_lookup16.json --output $R/batch_speed_chain16_b1.json \
    > $R/logs/chain16.log 2>&1; echo "rc $?"; grep -E "^batch" $R/logs/chain16.log | cut -c1-200
  t end
} > /root/res/job.log 2>&1
echo "JOB DONE" >> /root/res/job.log
