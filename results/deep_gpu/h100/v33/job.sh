#!/usr/bin/env bash
# Prepared in the thirty-sixth session for the next lease (H100 or H200): v32's job, which ran one part (results in
# ../v32/README.md: each admission of the continuous batcher took ~11 steps at batch 16, 4-5 of them with its
# prefill in flight beside the steps and 6-7 waiting for the one staging row). Stage with
#   bash results/deep_gpu/lease/slim.sh on results/deep_gpu/h100/v33 results/deep_gpu/h100/v32/job.sh
# and `bash results/deep_gpu/lease/stage.sh` (two calls); then one more call with carry=[".gpu_keep"] (v31's compiled
# artifacts, 10 MB, git-ignored) that launches this, so that the first warm-up loads them instead of compiling.
# Outputs in /root/res/v33. It runs v32's script, whose parts are functions, in the order $JOB_ORDER names; by
# default, in the order they matter:
# (1) the batcher at batch 16, then 8, over 160 prompts, in one process, twice over, with each setting in turn:
#     as v32 ran it, the three opt-in admission levers together, and each alone: PPD_PREFILL_PRIORITY=high (the side
#     stream at high priority), PPD_BACKLOG=waited (a burst joins in the prefills' own time), PPD_ADMISSIONS=
#     before_step (each request one step sooner) (`eval.batch_speed --batchers`, so that each graph compiles once);
# (2) the server at 16 clients (160 requests, buckets to 16) with the three levers and without;
#     batches 32, 16 and 8 (160 prompts) with two small trees: the policy runs the one-row step at 32, chosen from
#     H200 timings of an older, slower tree step, and the 40-row tree at 16 and 8; the batcher's GPU tests with the
#     three levers on;
# (3) issue 14's decoder table through the continuous batcher, batch 1-32, and its server table, 64, 16, 4 and 1
#     clients (the heap frozen at the batcher's start: untimed through the server so far).
# Reworked in the thirty-seventh session: (1) ran as five processes (~4 minutes of compiling each for seconds of
# decoding); now it is one.
# Make a lever the default only where the tests pass and it gains in (1) and in the server.
export JOB_VERSION=v33 TEST_LEVERS="PPD_ADMISSIONS=before_step PPD_PREFILL_PRIORITY=high PPD_BACKLOG=waited"
export JOB_ORDER=${JOB_ORDER:-levers_ab load16_levers_all load16_after_step b32_trees tests continuous load}
exec bash /root/tree/results/deep_gpu/h100/v32/job.sh
