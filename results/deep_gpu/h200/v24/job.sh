#!/usr/bin/env bash
# Twenty-seventh session, second lease (~700 s of device time left after v23). v23's admission profile found that a
# joining request stalled the running rows for its whole prefill (5.1-5.8 ms of an 8.9-10.9 ms admission, the
# graph's device time included) and for the drain of the steps queued before it. Since, the staging row's prefill
# runs on a side stream beside the running rows' steps and only the row copy waits for it (ppd/serving/batcher.py,
# _Lane.advance_admissions). (1) The batcher's GPU equivalence test under capture (the side stream's ordering);
# (2) the server at 16, 4 and 1 clients, as v23's 16-client run (buckets up to 16), read by admission_gaps.py.
set -u
source /root/tree/results/deep_gpu/lease/job_env.sh v24
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  t check; timeout 150 python -m pytest -q tests/test_batcher.py -k "captured_continuous and not compiled" \
    > $R/logs/gpu_test.log 2>&1; echo "rc $?"; tail -n 2 $R/logs/gpu_test.log
  t load; timeout 560 python -m eval.load --launch --model smollm2-135m-instruct \
    --server_args="--dtype bfloat16 --capture compiled_graph --max_seq_len 1024 --max_batch 16" \
    --clients 16 4 1 --methods ppd baseline --bench mt_bench --max_tokens 256 \
    --output $R/load16.json --plot $R/load16.png > $R/logs/load16.log 2>&1; echo "rc $?"
  grep -E "^\|" $R/logs/load16.log | head -10
  python results/deep_gpu/admission_gaps.py $R/load16.json --output $R/admission_gaps16.json
  t end
} > /root/res/job.log 2>&1
echo "JOB DONE" >> /root/res/job.log
