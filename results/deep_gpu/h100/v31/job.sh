#!/usr/bin/env bash
# Prepared in the thirty-fourth session for the next lease (H100 or H200). Stage with (the folder, the scripts it runs)
#   bash results/deep_gpu/lease/slim.sh on results/deep_gpu/h100/v31 \
#       results/deep_gpu/{split_sweep,attention_feed}.py
# and `bash results/deep_gpu/lease/stage.sh` (two calls), then launch this; outputs in /root/res/v31.
# Since v30: the split kernel shares each row's own slots among its pieces instead of cutting the captured width
# (a short row left the later pieces empty), and the server's warm-up reads and writes PPD_COMPILE_CACHE.
# In the order they matter (revised at the start of the thirty-fifth session, to fit one 30-minute lease):
# (1) the split kernel's GPU tests (a kernel changed since the last lease);
# (2) the kernel alone at served shapes (rows shorter than the captured width): balanced pieces at the default
#     tuning against one piece, more pieces, and pieces that merge themselves (fused_merge=1, no merging kernel;
#     each tuning checked against SDPA first); model-free, in the background during (3)'s compilation;
# (3) issue 14's decoder table through the continuous batcher, batch 1-32, current defaults;
# (4) issue 14's server table, 1, 4, 16 and 64 clients, in one run (Inductor's cache warm from (3));
# (5) the compiled artifacts (PPD_COMPILE_CACHE, /root/keep/compiled) packed in 15 MiB parts in /root/keep/out,
#     which peek.sh brings back beside its archive, for a later lease to carry instead of compiling for minutes;
# (6) if time is left: the constant/symbolic tree sizes A/B at 16 rows over 160 prompts each, and the batch-16
#     step's kernels with balanced pieces, against v29's profile.
set -u
source /root/tree/results/deep_gpu/lease/job_env.sh v31
export PPD_COMPILE_CACHE=/root/keep/compiled
mkdir -p "$PPD_COMPILE_CACHE"
T=results/lookup/trees
E="--dtype bfloat16 --capture compiled_graph"
C="python -m eval.batch_speed $E --batching continuous --bench mt_bench --max_new_tokens 256 --max_seq_len 1024"
L="python -m eval.load --launch --model smollm2-135m-instruct --methods ppd baseline --bench mt_bench --max_tokens 256"
rows() { echo "rc $1"; grep -E "^\|" "$2" | head -n "${3:-6}" | cut -c1-300; }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  t tests; timeout 240 python -m pytest -q -p no:cacheprovider tests/test_split_attention.py -k gpu \
    > $R/logs/tests.log 2>&1; echo "rc $?"; tail -n 2 $R/logs/tests.log
  # the sweep runs beside (3)'s warm-up, which compiles on the CPU for longer than the sweep's limit, so that the
  # decoder's timed rounds start after the sweep has ended
  t sweep_start; ( timeout 240 python results/deep_gpu/split_sweep.py --ways tree --repeats 30 \
    --shapes 1,40,300,512 4,40,300,512 16,40,300,512 32,40,300,512 16,40,600,1024 1,40,8000 16,17,8000 \
    --tunings min_piece=4096 min_piece=128 min_piece=64 per_processor=4 fused_merge=1 fused_merge=1,min_piece=128 \
    fused_merge=1,min_piece=64 fused_merge=1,per_processor=4 --output $R/split_sweep_served.json \
    > $R/logs/sweep.log 2>&1; echo "sweep rc $? at $(date +%T)" >> $R/logs/sweep.log ) &
  sweep=$!
  t continuous; timeout 900 $C --batch_sizes 32 16 8 4 2 1 --output $R/continuous_b1-32.json \
    --plot $R/continuous_b1-32.png > $R/logs/continuous.log 2>&1; rows $? $R/logs/continuous.log 9
  wait $sweep; tail -n 1 $R/logs/sweep.log; grep -E "mask: one row|best|not timed" $R/logs/sweep.log | cut -c1-220
  t load; timeout 900 $L --clients 64 16 4 1 --server_args="$E --max_seq_len 1024 --max_batch 64" \
    --output $R/load.json --plot $R/load.png > $R/logs/load.log 2>&1; rows $? $R/logs/load.log 10
  # the compiled artifacts, packed for the next lease to carry (peek.sh brings /root/keep/out's files back)
  t pack; mkdir -p /root/keep/out && tar czf /root/keep/compiled.tgz -C /root/keep compiled
  size=$(stat -c %s /root/keep/compiled.tgz); echo "compiled.tgz $size bytes"
  if (( size <= 45 * 1048576 )); then  # what comes back: at most 64 MiB in all, the results' archive beside it
    split -b 15m /root/keep/compiled.tgz /root/keep/out/compiled.tgz. && touch /root/keep/packed
  fi
  t continuous_symbolic; PPD_TREE_SHAPES=symbolic timeout 600 $C --batch_sizes 16 --prompts 160 \
    --output $R/continuous_b16_symbolic.json > $R/logs/continuous_symbolic.log 2>&1
  rows $? $R/logs/continuous_symbolic.log
  t continuous_static; timeout 420 $C --batch_sizes 16 --prompts 160 --output $R/continuous_b16_static.json \
    > $R/logs/continuous_static.log 2>&1; rows $? $R/logs/continuous_static.log
  t profile; timeout 330 python -m eval.step_profile $E --context 300 --batch_size 16 --steps 16 \
    --trees $T/tree_32_lookup8.json --top 80 --sequence --output $R/step_profile_b16.json \
    > $R/logs/profile.log 2>&1; rows $? $R/logs/profile.log 4
  t keep; du -sm "$PPD_COMPILE_CACHE"
  t end
} > /root/res/job.log 2>&1
echo "JOB DONE" >> /root/res/job.log
