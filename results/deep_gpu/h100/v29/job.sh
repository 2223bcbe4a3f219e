#!/usr/bin/env bash
# The thirty-second session's first lease (it came as one H100): what a batch-16 tree step launches, kernel by
# kernel, before the step is made cheaper. (1) The shipped policy's batch-16 step (the 32-row tree with a lookup chain of 8, 40 rows a
# batch row) and the one-row step, profiled with the kernels of one step in order (--sequence) and Inductor's
# generated code in the log; (2) the same with one piece per attention program (PPD_SPLIT_TUNING=min_piece=4096:
# no merge kernel at this context); (3) the same with the deep maps as low-rank products (PPD_DEEP_MAPS=low_rank).
# Staged as ../v28/job.sh without LONG; outputs in /root/res/v29.
set -u
source /root/tree/results/deep_gpu/lease/job_env.sh v29
T=results/lookup/trees
P="python -m eval.step_profile --dtype bfloat16 --capture compiled_graph --context 300 --batch_size 16 --steps 16
   --trees $T/tree_32_lookup8.json --top 80 --sequence"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  t profile; TORCH_LOGS=output_code timeout 420 $P --output $R/step_profile_b16.json \
    > $R/logs/profile.log 2> $R/logs/output_code.log; echo "rc $?"; grep -E "^\|" $R/logs/profile.log | head -n 4
  gzip -f $R/logs/output_code.log
  t one_piece; PPD_SPLIT_TUNING=min_piece=4096 timeout 300 $P --output $R/step_profile_b16_one_piece.json \
    > $R/logs/one_piece.log 2>&1; echo "rc $?"; grep -E "^\|" $R/logs/one_piece.log | head -n 4
  t low_rank; PPD_DEEP_MAPS=low_rank timeout 300 $P --output $R/step_profile_b16_low_rank.json \
    > $R/logs/low_rank.log 2>&1; echo "rc $?"; grep -E "^\|" $R/logs/low_rank.log | head -n 4
  t end
} > /root/res/job.log 2>&1
echo "JOB DONE" >> /root/res/job.log
