#!/usr/bin/env bash
# Prepared in the twenty-eighth session for the next H200 lease (not run yet). Stage with LONG=1 (the long-context
# part reads the first 3,000 ShareGPT conversations): `LONG=1 bash results/deep_gpu/lease/stage.sh`, then the
# calls of ../../lease/README.md; outputs in /root/res/v26.
# v25 found the server at 64 clients bound by its host: its steps came every 4.5-5.7 ms against a 2.4 ms batch-64
# step, and on this project's CPU the event loop spent ~100 us of CPU a streamed token (results/server_host/).
# Since, the server runs uvicorn's C HTTP parser and event loop (httptools, uvloop) and a reader that falls behind
# takes every chunk that has arrived at once (Stream.batches). In the order they matter, each logged as it ends:
# (1) the server at 64, 16, 4 and 1 clients with the new stack (issue 14's server table), read by admission_gaps.py;
# (2) issue 18 at 8K context: the shipped policy (its static batch of 16 runs the one-row step) and, at batch 16,
#     the 32- and 16-row trees with the lookup chain, through the split kernel;
# (3) the server's host CPU a token on this machine, h11/asyncio against httptools/uvloop (host_cost.py);
# (4) the admission profile as served (not synchronised) under torch's profiler: which call holds a join's host
#     4.6 ms (v25: six small writes that take 0.3 ms with the device idle).
set -u
source /root/tree/results/deep_gpu/lease/job_env.sh v26
E="--dtype bfloat16 --capture compiled_graph"
S="$E --max_seq_len 1024"
gunzip -kf /root/ppd-stage/sharegpt_first3000.json.gz
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  t load64; timeout 900 python -m eval.load --launch --model smollm2-135m-instruct --server_args="$S --max_batch 64" \
    --clients 64 16 4 1 --methods ppd baseline --bench mt_bench --max_tokens 256 \
    --output $R/load64.json --plot $R/load64.png > $R/logs/load64.log 2>&1; echo "rc $?"
  grep -E "^\|" $R/logs/load64.log | head -10; grep -E "^HTTP:" $R/load64.server.log
  python results/deep_gpu/admission_gaps.py $R/load64.json --output $R/admission_gaps64.json
  t long8k; timeout 600 python -m eval.long_context $E --attention dense --contexts 8192 --batch_sizes 1 16 \
    --methods ppd baseline --trees results/lookup/trees/tree_32_lookup8.json results/lookup/trees/tree_16_lookup8.json \
    --data_path /root/ppd-stage/sharegpt_first3000.json --max_new_tokens 128 --max_seq_len 8448 \
    --output $R/long_context_8k.json --plot $R/long_context_8k.png > $R/logs/long8k.log 2>&1; echo "rc $?"
  grep -E "^\|" $R/logs/long8k.log | cut -c1-220 | head -12
  t host_cost; timeout 600 python results/server_host/host_cost.py --model smollm2-135m-instruct \
    --server_args="$S --max_batch 64" --clients 64 --requests 256 --max_tokens 256 --repeats 1 \
    --output $R/host_cost64.json > $R/logs/host_cost.log 2>&1; echo "rc $?"; tail -n 4 $R/logs/host_cost.log
  t admission_profiled; timeout 300 python results/deep_gpu/admission_profile.py $S --max_batch 16 --admissions 40 \
    --profile --output $R/admission_profiled.json > $R/logs/admission_profiled.log 2>&1; echo "rc $?"
  grep -E "^(ppd|baseline):" $R/logs/admission_profiled.log
  t end
} > /root/res/job.log 2>&1
echo "JOB DONE" >> /root/res/job.log
