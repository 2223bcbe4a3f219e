#!/usr/bin/env bash
# The thirty-third session's lease (prepared in the thirty-second as v29b, never run: no machine could be started).
# Times the tree steps compiled with each tree set's sizes as constants (PPD_TREE_SHAPES=static, the CUDA default
# since the thirty-second session) against symbolic sizes (the code before), where v29 found four copies a layer,
# and a single attention piece at short widths (PPD_SPLIT_TUNING=min_piece=4096: -7 % wall on v29's batch-16 step).
# In the order they matter: (1) the continuous batcher at 16 rows, static sizes then symbolic; (2) the server at
# 16 clients (issue 14's 1.4x; it finds (1)'s compilations in the machine's Inductor cache); (3) the batcher and
# the server with one attention piece; (4) the batch-16 step's kernels both ways;
# (5) the model-free layer stack both ways. Outputs in /root/res/v30.
set -u
source /root/tree/results/deep_gpu/lease/job_env.sh v30
T=results/lookup/trees
E="--dtype bfloat16 --capture compiled_graph"
P="python -m eval.step_profile $E --context 300 --batch_size 16 --steps 16 --trees $T/tree_32_lookup8.json --top 80
   --sequence"
C="python -m eval.batch_speed $E --batching continuous --batch_sizes 16 --bench mt_bench --max_new_tokens 256
   --max_seq_len 1024"
L="python -m eval.load --launch --model smollm2-135m-instruct --clients 16 --methods ppd baseline --bench mt_bench
   --max_tokens 256"
LS="$E --max_seq_len 1024 --max_batch 16"
rows() { echo "rc $1"; grep -E "^\|" "$2" | head -n "${3:-6}" | cut -c1-260; }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  t continuous_static; timeout 420 $C --output $R/continuous_b16_static.json > $R/logs/continuous_static.log 2>&1
  rows $? $R/logs/continuous_static.log
  t continuous_symbolic; PPD_TREE_SHAPES=symbolic timeout 420 $C --output $R/continuous_b16_symbolic.json \
    > $R/logs/continuous_symbolic.log 2>&1; rows $? $R/logs/continuous_symbolic.log
  t load16; timeout 540 $L --server_args="$LS" --output $R/load16.json > $R/logs/load16.log 2>&1
  rows $? $R/logs/load16.log 4
  t continuous_onepiece; PPD_SPLIT_TUNING=min_piece=4096 timeout 420 $C --output $R/continuous_b16_onepiece.json \
    > $R/logs/continuous_onepiece.log 2>&1; rows $? $R/logs/continuous_onepiece.log
  t load16_onepiece; PPD_SPLIT_TUNING=min_piece=4096 timeout 540 $L --server_args="$LS" \
    --output $R/load16_onepiece.json > $R/logs/load16_onepiece.log 2>&1; rows $? $R/logs/load16_onepiece.log 4
  t profile_static; timeout 330 $P --output $R/step_profile_b16_static.json > $R/logs/profile_static.log 2>&1
  rows $? $R/logs/profile_static.log 4
  t profile_symbolic; PPD_TREE_SHAPES=symbolic timeout 330 $P --output $R/step_profile_b16_symbolic.json \
    > $R/logs/profile_symbolic.log 2>&1; rows $? $R/logs/profile_symbolic.log 4
  t layers; timeout 300 python results/deep_gpu/tree_shapes_bench.py --output $R/tree_shapes_bench.json \
    > $R/logs/layers.log 2>&1; echo "rc $?"; tail -n 8 $R/logs/layers.log
  t end
} > /root/res/job.log 2>&1
echo "JOB DONE" >> /root/res/job.log
