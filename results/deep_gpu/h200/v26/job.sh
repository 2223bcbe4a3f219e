#!/usr/bin/env bash
# Prepared in the twenty-eighth session, extended and run in the twenty-ninth. Stage with LONG=1 (the long-context
# part reads the first 3,000 ShareGPT conversations): `LONG=1 bash results/deep_gpu/lease/stage.sh`, then the
# calls of ../../lease/README.md; outputs in /root/res/v26.
# v25 found the server at 64 clients bound by its host: its steps came every 4.5-5.7 ms against a 2.4 ms batch-64
# step, and on this project's CPU the event loop spent ~100 us of CPU a streamed token (results/server_host/).
# Since, the server runs uvicorn's C HTTP parser and event loop (httptools, uvloop), a reader that falls behind
# takes every chunk that has arrived at once (Stream.batches), and a finished row is made padding by one foreach
# copy (twelve launches and six allocations before). In the order they matter, each logged as it ends:
# (0) the batcher's GPU tests (rows joining and leaving captured buckets decode what they decode alone);
# (1) the server at 64, 16, 4 and 1 clients with the new stack (issue 14's server table), read by admission_gaps.py;
# (2) issue 18 at 8K context: the shipped policy (its static batch of 16 runs the one-row step) and, at batch 16,
#     the 32- and 16-row trees with the lookup chain, through the split kernel;
# (3) the admission profile as served (not synchronised) under torch's profiler: which call holds a join's host
#     4.6 ms (v25: six small writes that take 0.3 ms with the device idle);
# (4) the server at 64 and 16 clients with a 1 ms thread switch interval: the batcher's thread waits for the
#     interpreter lock after each device wait, up to the interval (5 ms by default) while the event loop works,
#     and v25's 64-client steps came every ~5 ms (v23 tried 0.5 ms when admissions still stalled 10 ms each);
# (5) the server's host CPU a token on this machine, h11/asyncio against httptools/uvloop (host_cost.py).
set -u
source /root/tree/results/deep_gpu/lease/job_env.sh v26
E="--dtype bfloat16 --capture compiled_graph"
S="$E --max_seq_len 1024"
gunzip -kf /root/ppd-stage/sharegpt_first3000.json.gz
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  t check; timeout 200 python -m pytest -q tests/test_batcher.py -k "never_waits or (captured_continuous and not compiled)" \
    > $R/logs/gpu_tests.log 2>&1; echo "rc $?"; tail -n 2 $R/logs/gpu_tests.log
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
  t admission_profiled; timeout 300 python results/deep_gpu/admission_profile.py $S --max_batch 16 --admissions 40 \
    --profile --output $R/admission_profiled.json > $R/logs/admission_profiled.log 2>&1; echo "rc $?"
  grep -E "^(ppd|baseline):" $R/logs/admission_profiled.log
  t load_switch1; timeout 500 python -m eval.load --launch --model smollm2-135m-instruct \
    --server_args="$S --max_batch 64 --switch_interval_ms 1" --clients 64 16 --methods ppd baseline --bench mt_bench \
    --max_tokens 256 --output $R/load64_switch1.json > $R/logs/load64_switch1.log 2>&1; echo "rc $?"
  grep -E "^\|" $R/logs/load64_switch1.log | head -6
  python results/deep_gpu/admission_gaps.py $R/load64_switch1.json --output $R/admission_gaps64_switch1.json
  t host_cost; timeout 600 python results/server_host/host_cost.py --model smollm2-135m-instruct \
    --server_args="$S --max_batch 64" --clients 64 --requests 256 --max_tokens 256 --repeats 1 \
    --output $R/host_cost64.json > $R/logs/host_cost.log 2>&1; echo "rc $?"; tail -n 4 $R/logs/host_cost.log
  t end
} > /root/res/job.log 2>&1
echo "JOB DONE" >> /root/res/job.log
