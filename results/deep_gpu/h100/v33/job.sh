#!/usr/bin/env bash
# Prepared in the thirty-sixth session for the next lease (H100 or H200): v32's job, which ran one part (results in
# ../v32/README.md: each admission of the continuous batcher took ~11 steps at batch 16, 4-5 of them with its
# prefill in flight beside the steps and 6-7 waiting for the one staging row). Stage with
#   bash results/deep_gpu/lease/slim.sh on results/deep_gpu/h100/v33
# and `bash results/deep_gpu/lease/stage.sh` (two calls); then one more call with carry=[".gpu_keep"] (v31's compiled
# artifacts, 10 MB, git-ignored) that launches this, so that the first warm-up loads them instead of compiling.
# Outputs in /root/res/v33. Each part is a function, run in the order $JOB_ORDER names; by default, in the order they
# matter:
# (1) the batcher at batch 16 over 160 prompts, as v32 ran it, then with each of the three opt-in admission levers:
#     PPD_PREFILL_PRIORITY=high (the side stream at high priority), PPD_BACKLOG=waited (a burst joins in the
#     prefills' own time), PPD_ADMISSIONS=before_step (each request one step sooner);
# (2) batches 32, 16 and 8 (160 prompts) with two small trees: the policy runs the one-row step at 32, chosen from
#     H200 timings of an older, slower tree step, and the 40-row tree at 16 and 8;
# (3) issue 14's decoder table through the continuous batcher, batch 1-32, and its server table, 64, 16, 4 and 1
#     clients (the heap frozen at the batcher's start: untimed through the server so far);
# (4) the batcher's GPU tests with all three levers on, then the server at 16 clients with before_step and without.
# Make a lever the default only where the tests pass and it gains in (1) and in the server.
set -u
source /root/tree/results/deep_gpu/lease/job_env.sh v33
export PPD_COMPILE_CACHE=/root/keep/compiled
mkdir -p "$PPD_COMPILE_CACHE"
kept=/root/tree/.gpu_keep/compiled_v31_h100.tgz
E="--dtype bfloat16 --capture compiled_graph"
C="python -m eval.batch_speed $E --batching continuous --bench mt_bench --max_new_tokens 256 --max_seq_len 1024"
L="python -m eval.load --launch --model smollm2-135m-instruct --bench mt_bench --max_tokens 256"
S="--server_args=$E --max_seq_len 1024 --max_batch 64"
rows() { echo "rc $1"; grep -E "^\||slow garbage" "$2" | head -n "${3:-6}" | cut -c1-300; }
load() {
  timeout 900 $L --methods ppd baseline --clients 64 16 4 1 "$S" --output $R/load.json --plot $R/load.png \
    > $R/logs/load.log 2>&1; rows $? $R/logs/load.log 11
}
continuous() {
  timeout 900 $C --batch_sizes 32 16 8 4 2 1 --output $R/continuous_b1-32.json \
    --plot $R/continuous_b1-32.png > $R/logs/continuous.log 2>&1; rows $? $R/logs/continuous.log 9
  grep -E "^batch" $R/logs/continuous.log | cut -c1-250
}
# the batcher over 160 prompts at batch 16, with the environment's switches ($1 names the output)
continuous_160() {
  timeout 600 $C --batch_sizes 16 --prompts 160 --output $R/continuous_b16${1:-}.json > $R/logs/continuous_160${1:-}.log 2>&1
  rows $? $R/logs/continuous_160${1:-}.log; grep -E "^batch" $R/logs/continuous_160${1:-}.log
}
before_step() { PPD_ADMISSIONS=before_step continuous_160 _before_step; }
high_priority() { PPD_PREFILL_PRIORITY=high continuous_160 _high_priority; }
backlog_waited() { PPD_BACKLOG=waited continuous_160 _backlog_waited; }
b32_trees() {
  timeout 600 $C --batch_sizes 32 16 8 --prompts 160 --trees results/lookup/trees/tree_8_lookup8.json \
    results/lookup/trees/tree_16_lookup8.json --output $R/continuous_b32_trees.json > $R/logs/continuous_b32_trees.log 2>&1
  rows $? $R/logs/continuous_b32_trees.log 8; grep -E "^batch" $R/logs/continuous_b32_trees.log
}
tests() {
  PPD_ADMISSIONS=before_step PPD_PREFILL_PRIORITY=high PPD_BACKLOG=waited timeout 300 python -m pytest -q -p no:cacheprovider \
    tests/test_batcher.py -k gpu > $R/logs/tests_levers.log 2>&1; echo "rc $?"; tail -n 1 $R/logs/tests_levers.log
}
load16() {  # $1: the admissions
  PPD_ADMISSIONS=$1 timeout 400 $L --methods baseline ppd --clients 16 "$S" --output $R/load16_$1.json \
    > $R/logs/load16_$1.log 2>&1; rows $? $R/logs/load16_$1.log 5
}
load16_before_step() { load16 before_step; }
load16_after_step() { load16 after_step; }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  if [ -f "$kept" ]; then t kept; tar xzf "$kept" -C /root/keep && du -sm "$PPD_COMPILE_CACHE"; fi
  for part in ${JOB_ORDER:-continuous_160 high_priority backlog_waited before_step b32_trees continuous load tests \
      load16_before_step load16_after_step}; do
    t "$part"; "$part"
  done
  t end
} > /root/res/job.log 2>&1
echo "JOB DONE" >> /root/res/job.log
