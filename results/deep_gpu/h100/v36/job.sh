#!/usr/bin/env bash
# Prepared in the thirty-ninth session for the next lease (H100 or H200). Stage with
#   bash results/deep_gpu/lease/slim.sh on results/deep_gpu/h100/v36
# and `bash results/deep_gpu/lease/stage.sh` (two calls); then one more call with carry=[".gpu_keep"] that launches
# this from the call's own root, and poll back to back (an idle machine goes back after 30 s: v35 lost a part so).
# .gpu_keep (git-ignored) holds v35's compiled artifacts (compiled_v35_h100.tgz, unpacked by unpack_kept).
# Outputs in /root/res/v36. Parts are functions (serving_job.sh's) run in the order $JOB_ORDER names; by default:
# (1) exactness first: the batcher's GPU tests three times more (v35: a833cf3's code failed the staging test with
#     four rows beside the steps once in two runs, v34 once in one; the fixed code passed 2 of 2). Everything after
#     needs all three to pass;
# (2) four staging rows against one, and four with prefill_ahead (requests prefilled while every row runs, so each
#     joins as a row frees; ahead4b: and admitted before the step is queued, so it takes part in that step),
#     timed with the fix: batch 32 (the policy and the 17-row chained tree) and 16 in one
#     process; the compiled artifacts are then packed (pack_kept: `cat compiled.tgz.* >
#     .gpu_keep/compiled_v36_h100.tgz` afterwards); then the server at 16 clients, 160 requests: one row, four
#     ahead, four, four ahead again (v34, old code: four rows 1.47x with p99 0.95x, one 1.24x with p99 1.57x);
# (3) issue 18: the batch-16 tree step at 8K of context, kernel by kernel (eval.step_profile), beside the one-row step
#     (v35's was under way when its machine went back);
# (4) v35's first test run (engine, streams, batcher in one process) ended in a segmentation fault after pytest's
#     summary: the engine's and streams' GPU tests again, faulthandler on to the very end;
# (5) issue 14's decoder table with four staging rows (b1-32).
# Make four staging rows (and prefill_ahead, if it gains) the default, and the 17-row tree the policy's at bucket 32,
# only if (1) passes and (2) holds.
set -u
source /root/tree/results/deep_gpu/lease/serving_job.sh "${JOB_VERSION:-v36}"
B="--batchers default staging4=staging_rows:4 ahead4=staging_rows:4,prefill_ahead:true"
B+=" ahead4b=staging_rows:4,prefill_ahead:true,admissions:before_step"
tests() { batcher_tests 3; }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  unpack_kept
  for part in ${JOB_ORDER:-tests staging pack_kept load16_pairs profile_8k segv continuous}; do
    t "$part"; "$part"
  done
  t end
} > /root/res/job.log 2>&1
echo "JOB DONE" >> /root/res/job.log
