#!/usr/bin/env bash
# Prepared in the thirty-seventh session for the next lease (H100 or H200). Stage with
#   bash results/deep_gpu/lease/slim.sh on results/deep_gpu/h100/v34
# and `bash results/deep_gpu/lease/stage.sh` (two calls); then one more call with carry=[".gpu_keep"] (v31's compiled
# artifacts, 10 MB, git-ignored) that launches this, so that the first warm-ups load them instead of compiling.
# Outputs in /root/res/v34. Parts are functions run in the order $JOB_ORDER names; by default, in the order they matter:
# (1) several staging rows (PPD_STAGING_ROWS, new: that many joining requests' prefills under way at once), in one
#     process, every setting decoding the 160 prompts in turn, twice over: at batch 32 with the policy (the one-row
#     step) and the 17-row chained tree, whose joins waited 62-69 steps for the one staging row in v33 (0.89x), and at
#     16 and 8 with the policy;
# (2) the batcher's GPU tests with four staging rows, and with v33's three levers (cut off in v33);
# (3) issue 14's server table, 64, 16, 4 and 1 clients (64 untimed since the heap is frozen; v31 lost 568 ms there to
#     one collection), then the 16-client level (160 requests) with four staging rows and with one;
# (4) issue 14's decoder table, batch 1-32.
# Make staging rows the default only where the tests pass and they gain in (1) and through the server.
set -u
source /root/tree/results/deep_gpu/lease/serving_job.sh "${JOB_VERSION:-v34}"
B="--batchers default staging2=staging_rows:2 staging4=staging_rows:4"
staging_b32() {
  timeout 900 $C --batch_sizes 32 --prompts 160 --rounds 2 $B --trees results/lookup/trees/tree_8_lookup8.json \
    --output $R/staging_b32.json > $R/logs/staging_b32.log 2>&1
  rows $? $R/logs/staging_b32.log 4; grep -E "^batch" $R/logs/staging_b32.log | cut -c1-250
}
staging_b16_8() {
  timeout 900 $C --batch_sizes 16 8 --prompts 160 --rounds 2 $B --output $R/staging_b16_8.json \
    > $R/logs/staging_b16_8.log 2>&1
  rows $? $R/logs/staging_b16_8.log 5; grep -E "^batch" $R/logs/staging_b16_8.log | cut -c1-250
}
tests() {
  for levers in PPD_STAGING_ROWS=4 "PPD_ADMISSIONS=before_step PPD_PREFILL_PRIORITY=high PPD_BACKLOG=waited"; do
    env $levers timeout 300 python -m pytest -q -p no:cacheprovider tests/test_batcher.py -k gpu \
      >> $R/logs/tests.log 2>&1; echo "rc $? ($levers)"; tail -n 1 $R/logs/tests.log
  done
}
load() {
  timeout 900 $L --methods ppd baseline --clients 64 16 4 1 "$S" --output $R/load.json --plot $R/load.png \
    > $R/logs/load.log 2>&1; rows $? $R/logs/load.log 11
}
load16() {  # $1 names the output; the staging rows come from the environment
  timeout 400 $L --methods baseline ppd --clients 16 --requests 160 "$S" --output $R/load16_$1.json \
    > $R/logs/load16_$1.log 2>&1; rows $? $R/logs/load16_$1.log 5
}
load16_staging4() { PPD_STAGING_ROWS=4 load16 staging4; }
load16_default() { load16 default; }
continuous() {
  timeout 900 $C --batch_sizes 32 16 8 4 2 1 --prompts 160 --output $R/continuous_b1-32.json \
    --plot $R/continuous_b1-32.png > $R/logs/continuous.log 2>&1; rows $? $R/logs/continuous.log 9
}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  unpack_kept
  for part in ${JOB_ORDER:-staging_b32 staging_b16_8 tests load load16_staging4 load16_default continuous}; do
    t "$part"; "$part"
  done
  t end
} > /root/res/job.log 2>&1
echo "JOB DONE" >> /root/res/job.log
