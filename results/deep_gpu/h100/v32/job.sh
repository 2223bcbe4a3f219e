#!/usr/bin/env bash
# Prepared in the thirty-fifth session for the next lease (H100 or H200). Stage with (the folder, the scripts it runs)
#   bash results/deep_gpu/lease/slim.sh on results/deep_gpu/h100/v32
# and `bash results/deep_gpu/lease/stage.sh` (two calls); then, if .gpu_keep/ holds v31's compiled artifacts
# (compiled_v31_h100.tgz, 10 MB, brought back by peek.sh; git-ignored), one more call with carry=[".gpu_keep"] that
# launches this, so that the first warm-up loads them (PPD_COMPILE_CACHE) instead of compiling from nothing.
# Outputs in /root/res/v32.
# Since v31: a ContinuousBatcher freezes the heap its warm-up built when it starts (gc.freeze; thawed at close) and
# logs any garbage collection over 20 ms; eval.load's client does the same, and its JSON records how many slow
# collections the server's log and the client saw. v31's 64-client level lost 568 ms to one stop of the whole
# server (ppd 0.84x; 0.97x with the collector switched off).
# Also since v31 (opt-in): PPD_ADMISSIONS=before_step joins a prefilled request and starts the next prefill before
# the lane's next step is queued (one step sooner a request); the batcher now counts each admission's steps waiting
# for the staging row and in flight there (eval.batch_speed prints them).
# In the order they matter:
# (1) issue 14's server table, 64, 16, 4 and 1 clients, one launched server (first: what changed is the server's);
# (2) issue 14's decoder table through the continuous batcher, batch 1-32;
# (3) the batcher at 16 rows over 160 prompts, default admissions;
# (4) the batcher's GPU tests with PPD_ADMISSIONS=before_step, then (3) with it, then the 16-client server with it
#     and without it, the methods' order swapped (its figure moved 1.32-1.53x between runs). The GPU tests also run
#     with PPD_PREFILL_PRIORITY=high (the side stream at high priority, added this session), and (3) once with it.
# Reworked in the thirty-sixth session, whose lease began with less than 20 minutes left: each part is a function,
# run in the order $JOB_ORDER names (default: the one above, with (5) before the tests and the server's A/B), and
# (5) batches 32, 16 and 8 (160 prompts) with two small trees: the policy runs the one-row step at 32, chosen from
# H200 timings of an older, slower tree step, and the 40-row tree at 16 and 8. ../v33/job.sh runs this script with
# its own $JOB_VERSION (the results' folder), $JOB_ORDER and $TEST_LEVERS.
set -u
source /root/tree/results/deep_gpu/lease/serving_job.sh "${JOB_VERSION:-v32}"
E16="--server_args=$E --max_seq_len 1024 --max_batch 16"
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
levers_all() { ( export ${TEST_LEVERS:?}; continuous_160 _levers_all ); }  # the three levers together
# Every lever's A/B in one process (eval.batch_speed --batchers, since the thirty-seventh session): each graph compiles
# once, every setting decodes the 160 prompts in turn, twice over, at batch 16 and then 8.
levers_ab() {
  timeout 900 $C --batch_sizes 16 8 --prompts 160 --rounds 2 --batchers default \
    levers=admissions:before_step,backlog:waited,prefill_priority:high prefill_priority=prefill_priority:high \
    backlog=backlog:waited admissions=admissions:before_step --output $R/levers_ab.json > $R/logs/levers_ab.log 2>&1
  rows $? $R/logs/levers_ab.log 5; grep -E "^batch" $R/logs/levers_ab.log | cut -c1-250
}
b32_trees() {
  timeout 600 $C --batch_sizes 32 16 8 --prompts 160 --trees results/lookup/trees/tree_8_lookup8.json \
    results/lookup/trees/tree_16_lookup8.json --output $R/continuous_b32_trees.json > $R/logs/continuous_b32_trees.log 2>&1
  rows $? $R/logs/continuous_b32_trees.log 8; grep -E "^batch" $R/logs/continuous_b32_trees.log
}
tests() {  # with the levers $TEST_LEVERS names
  env ${TEST_LEVERS:-PPD_ADMISSIONS=before_step PPD_PREFILL_PRIORITY=high} timeout 300 python -m pytest -q \
    -p no:cacheprovider tests/test_batcher.py -k gpu > $R/logs/tests_levers.log 2>&1; echo "rc $?"
  tail -n 1 $R/logs/tests_levers.log
}
load16() {  # $1 names the output; the levers come from the environment. 160 requests (10 a client, v31 ran 4): less
  # of the level is its drain. The server captures buckets up to 16 only, to start sooner; both methods alike.
  timeout 400 $L --methods baseline ppd --clients 16 --requests 160 "$E16" --output $R/load16_$1.json \
    > $R/logs/load16_$1.log 2>&1; rows $? $R/logs/load16_$1.log 5
}
load16_before_step() { PPD_ADMISSIONS=before_step load16 before_step; }
load16_after_step() { PPD_ADMISSIONS=after_step load16 after_step; }
load16_levers_all() { ( export ${TEST_LEVERS:?}; load16 levers_all ); }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  unpack_kept
  for part in ${JOB_ORDER:-load continuous continuous_160 before_step high_priority b32_trees tests load16_before_step \
      load16_after_step}; do
    t "$part"; "$part"
  done
  t end
} > /root/res/job.log 2>&1
echo "JOB DONE" >> /root/res/job.log
