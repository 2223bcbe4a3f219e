#!/usr/bin/env bash
# Prepared in the twenty-seventh session, run in the twenty-eighth (README.md: the figures). Started by
# results/deep_gpu/lease/launch.sh after the staging calls (../../lease/README.md); outputs in /root/res/v25.
# v24 moved a joining request's prefill onto a side stream (the server at 16 clients: both methods +12-13%, still
# 1.25x), but by the code its launch still waited for the device: the staging row's reset and the lookup history
# uploaded from ordinary host memory. Since (commit 8f7b0b2) they upload from pinned memory and rows are copied whole
# in one foreach copy per dtype. In the order they matter, each logged as it ends (the lease may stop early):
# (1) the GPU tests of the batcher: a launch never waits for the device (sync debug mode set to raise), and the
#     captured batch equals each request alone;
# (2) the server at 16, 4 and 1 clients as in v24 (buckets up to 16), read by admission_gaps.py; then at 16 with
#     --prefill_in_line (each prefill on the running rows' stream, between two steps), to time the side stream alone;
# (3) the admission profile of the new flow (launch and join, the steps beside a prefill in flight), and where the
#     batch-16 tree step's device time goes (eval.step_profile, the shipped tree);
# (4) the server at 64 clients (buckets up to 64); the admission profile with the device synchronised around each
#     phase and torch's profiler; decoder throughput in static batches and through the batcher.
set -u
source /root/tree/results/deep_gpu/lease/job_env.sh v25
E="--dtype bfloat16 --capture compiled_graph"
S="$E --max_seq_len 1024"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  t check; timeout 200 python -m pytest -q tests/test_batcher.py -k "never_waits or (captured_continuous and not compiled)" \
    > $R/logs/gpu_tests.log 2>&1; echo "rc $?"; tail -n 2 $R/logs/gpu_tests.log
  t load16; timeout 560 python -m eval.load --launch --model smollm2-135m-instruct --server_args="$S --max_batch 16" \
    --clients 16 4 1 --methods ppd baseline --bench mt_bench --max_tokens 256 \
    --output $R/load16.json --plot $R/load16.png > $R/logs/load16.log 2>&1; echo "rc $?"
  grep -E "^\|" $R/logs/load16.log | head -10
  python results/deep_gpu/admission_gaps.py $R/load16.json --output $R/admission_gaps16.json
  # the same, each prefill queued on the running rows' stream instead of beside them (same machine, same run)
  t load16_in_line; timeout 400 python -m eval.load --launch --model smollm2-135m-instruct \
    --server_args="$S --max_batch 16 --prefill_in_line" --clients 16 --methods ppd baseline --bench mt_bench \
    --max_tokens 256 --output $R/load16_in_line.json > $R/logs/load16_in_line.log 2>&1; echo "rc $?"
  grep -E "^\|" $R/logs/load16_in_line.log | head -4
  python results/deep_gpu/admission_gaps.py $R/load16_in_line.json --output $R/admission_gaps16_in_line.json
  t admission; timeout 400 python results/deep_gpu/admission_profile.py $S --max_batch 16 --admissions 40 \
    --output $R/admission.json > $R/logs/admission.log 2>&1; echo "rc $?"; grep -E "^(ppd|baseline):" $R/logs/admission.log
  # where the batch-16 step of the shipped tree (32 rows + a chain of 8) spends its device time
  t step_profile; timeout 300 python -m eval.step_profile $E --context 300 --batch_size 16 --steps 32 \
    --trees results/lookup/trees/tree_32_lookup8.json --top 40 --output $R/step_profile_b16.json \
    > $R/logs/step_profile.log 2>&1; echo "rc $?"; tail -n 4 $R/logs/step_profile.log | cut -c1-200
  t load64; timeout 780 python -m eval.load --launch --model smollm2-135m-instruct --server_args="$S --max_batch 64" \
    --clients 64 16 --methods ppd baseline --bench mt_bench --max_tokens 256 \
    --output $R/load64.json --plot $R/load64.png > $R/logs/load64.log 2>&1; echo "rc $?"
  grep -E "^\|" $R/logs/load64.log | head -8
  python results/deep_gpu/admission_gaps.py $R/load64.json --output $R/admission_gaps64.json
  t admission_sync; timeout 300 python results/deep_gpu/admission_profile.py $S --max_batch 16 --admissions 40 \
    --sync --profile --output $R/admission_sync.json > $R/logs/admission_sync.log 2>&1; echo "rc $?"
  grep -E "^(ppd|baseline):" $R/logs/admission_sync.log
  t static; timeout 600 python -m eval.batch_speed $E --batch_sizes 16 8 4 2 1 --bench mt_bench --max_new_tokens 256 \
    --max_seq_len 1024 --output $R/batch_speed_static.json --plot $R/batch_speed_static.png \
    > $R/logs/static.log 2>&1; echo "rc $?"; grep -E "^\|" $R/logs/static.log | cut -c1-200
  t continuous; timeout 600 python -m eval.batch_speed $E --batching continuous --batch_sizes 16 4 1 --bench mt_bench \
    --max_new_tokens 256 --max_seq_len 1024 --output $R/batch_speed_continuous.json \
    --plot $R/batch_speed_continuous.png > $R/logs/continuous.log 2>&1; echo "rc $?"
  grep -E "^\|" $R/logs/continuous.log | cut -c1-200
  t end
} > /root/res/job.log 2>&1
echo "JOB DONE" >> /root/res/job.log
