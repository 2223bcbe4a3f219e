#!/usr/bin/env bash
# The thirty-second session's second lease: tree steps compiled with each tree set's sizes as constants
# (PPD_TREE_SHAPES=static, now the default on CUDA) against symbolic sizes (the code before), where v29 found four
# copies a layer. (1) The shipped policy's batch-16 step profiled both ways (kernels of one step in order);
# (2) the continuous batcher at 16 rows, ppd (the policy) and baseline, both ways, where device time is left.
# Outputs in /root/res/v29b. Prepared in the thirty-second session and not run: no machine could be started.
set -u
source /root/tree/results/deep_gpu/lease/job_env.sh v29b
T=results/lookup/trees
P="python -m eval.step_profile --dtype bfloat16 --capture compiled_graph --context 300 --batch_size 16 --steps 16
   --trees $T/tree_32_lookup8.json --top 80 --sequence"
S="python -m eval.batch_speed --dtype bfloat16 --capture compiled_graph --batching continuous --batch_sizes 16
   --bench mt_bench --max_new_tokens 256 --max_seq_len 1024"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  t profile_static; timeout 330 $P --output $R/step_profile_b16_static.json > $R/logs/profile_static.log 2>&1
  echo "rc $?"; grep -E "^\|" $R/logs/profile_static.log | head -n 4
  t profile_symbolic; PPD_TREE_SHAPES=symbolic timeout 330 $P --output $R/step_profile_b16_symbolic.json \
    > $R/logs/profile_symbolic.log 2>&1; echo "rc $?"; grep -E "^\|" $R/logs/profile_symbolic.log | head -n 4
  t continuous_static; timeout 420 $S --output $R/continuous_b16_static.json > $R/logs/continuous_static.log 2>&1
  echo "rc $?"; grep -E "^\|" $R/logs/continuous_static.log | head -n 6
  t continuous_symbolic; PPD_TREE_SHAPES=symbolic timeout 420 $S --output $R/continuous_b16_symbolic.json \
    > $R/logs/continuous_symbolic.log 2>&1; echo "rc $?"; grep -E "^\|" $R/logs/continuous_symbolic.log | head -n 6
  t end
} > /root/res/job.log 2>&1
echo "JOB DONE" >> /root/res/job.log
