#!/usr/bin/env bash
# Prepared in the twenty-sixth session, reordered in the twenty-seventh before it ran. Started by
# results/deep_gpu/lease/launch.sh after the staging calls (../../lease/README.md); outputs in /root/res/v23.
# Estimated at 30 minutes on a fresh machine (the first batcher's warm-up compiles for ~7), more than a lease leaves
# after staging: the parts are in the order they matter, each logged as it ends, so that the lease can stop early.
# (1) Where one admission's 7.5-9.6 ms go (v22's load gaps, admission_gaps.py): the batcher of 16 rows, 15 running,
#     admissions timed by phase as the server runs them.
# (2) The server at 16 clients (buckets up to 16 only, as in v22 at 16 clients), as it is and with a 0.5 ms thread
#     switch interval (application.serve --switch_interval_ms): does the batcher's thread wait for the interpreter
#     lock while the event loop takes a new request in? Each read by admission_gaps.py.
# (3) The admission with the device synchronised around each phase, and torch's profiler over ten of them.
# (4) The step since its node logits take the head as one matrix (LanguageModel.logits; v21's batch-16 profile:
#     173 us for the product, 19-48 us for 80-512 rows alone): the batch-16 step profile, to set beside v21's.
# (5) The server at 16 4 1 64 clients; decoder throughput in static batches 16 8 4 2 1 (the policy, whose bucket 16
#     runs the one-row step in static batches, beside the 32-row tree with its chain) and through the continuous
#     batcher at 16 4 1.
set -u
source /root/tree/results/deep_gpu/lease/job_env.sh v23
E="--dtype bfloat16 --capture compiled_graph"
A="$E --max_seq_len 1024 --max_batch 16 --admissions 40"
L=results/lookup/trees
S="$E --max_seq_len 1024"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  t admission; timeout 600 python results/deep_gpu/admission_profile.py $A --output $R/admission.json \
    > $R/logs/admission.log 2>&1; echo "rc $?"; grep -E "^(ppd|baseline):" $R/logs/admission.log
  for sw in 5 0.5; do
    t "load at 16 clients, switch interval $sw ms"; timeout 500 python -m eval.load --launch --model smollm2-135m-instruct \
      --server_args="$S --max_batch 16 --switch_interval_ms $sw" --clients 16 --methods ppd baseline \
      --bench mt_bench --max_tokens 256 --output $R/load16_switch$sw.json > $R/logs/load16_switch$sw.log 2>&1
    echo "rc $?"; grep -E "^\|" $R/logs/load16_switch$sw.log | head -6
    python results/deep_gpu/admission_gaps.py $R/load16_switch$sw.json --output $R/admission_gaps16_switch$sw.json
  done
  du -sh /root/inductor
  t admission_sync; timeout 300 python results/deep_gpu/admission_profile.py $A --sync --profile \
    --output $R/admission_sync.json > $R/logs/admission_sync.log 2>&1; echo "rc $?"
  grep -E "^(ppd|baseline):" $R/logs/admission_sync.log
  t profile; timeout 300 python -m eval.step_profile $E --context 300 --batch_size 16 --steps 32 --top 40 \
    --trees $L/tree_16_lookup8.json --output $R/step_profile_b16.json > $R/logs/profile.log 2>&1; echo "rc $?"
  grep -E "^\|" $R/logs/profile.log | head -6
  t load; timeout 780 python -m eval.load --launch --model smollm2-135m-instruct \
    --server_args="$S --max_batch 64" --clients 16 4 1 64 --methods ppd baseline --bench mt_bench --max_tokens 256 \
    --output $R/load_bfloat16.json --plot $R/load_bfloat16.png > $R/logs/load.log 2>&1; echo "rc $?"
  grep -E "^\|" $R/logs/load.log | head -12
  python results/deep_gpu/admission_gaps.py $R/load_bfloat16.json --output $R/admission_gaps.json
  t static; timeout 600 python -m eval.batch_speed $E --batch_sizes 16 8 4 2 1 --bench mt_bench --max_new_tokens 256 \
    --max_seq_len 1024 --trees $L/tree_32_lookup8.json --output $R/batch_speed_static.json --plot $R/batch_speed_static.png \
    > $R/logs/static.log 2>&1; echo "rc $?"; grep -E "^\|" $R/logs/static.log | cut -c1-200
  t continuous; timeout 600 python -m eval.batch_speed $E --batching continuous --batch_sizes 16 4 1 --bench mt_bench \
    --max_new_tokens 256 --max_seq_len 1024 --output $R/batch_speed_continuous.json \
    --plot $R/batch_speed_continuous.png > $R/logs/continuous.log 2>&1; echo "rc $?"
  grep -E "^\|" $R/logs/continuous.log | cut -c1-200
  t end
} > /root/res/job.log 2>&1
echo "JOB DONE" >> /root/res/job.log
