# Sourced by the serving jobs (h100/v32, v34, v35, v36):
# `source results/deep_gpu/lease/serving_job.sh vNN` after `set -u`.
# On top of job_env.sh (the tree, packages, caches, R and t): the compiled artifacts a lease carries in .gpu_keep
# (PPD_COMPILE_CACHE: the latest compiled_vNN_h100.tgz, unpacked by `unpack_kept`, packed again by `pack_kept`), the
# commands the parts share (E: engine flags, C: the continuous batcher's speed at MT-Bench, L: the load benchmark
# with a launched server, S: its server's flags, buckets to 64) and `rows`, which prints a part's exit status and its
# table's first lines.
source /root/tree/results/deep_gpu/lease/job_env.sh "${1:?usage: source serving_job.sh vNN}"
export PPD_COMPILE_CACHE=/root/keep/compiled
mkdir -p "$PPD_COMPILE_CACHE"
kept=$(ls /root/tree/.gpu_keep/compiled_v*_h100.tgz 2>/dev/null | sort | tail -n 1)  # the latest lease's (vNN)
E="--dtype bfloat16 --capture compiled_graph"
C="python -m eval.batch_speed $E --batching continuous --bench mt_bench --max_new_tokens 256 --max_seq_len 1024"
L="python -m eval.load --launch --model smollm2-135m-instruct --bench mt_bench --max_tokens 256"
S="--server_args=$E --max_seq_len 1024 --max_batch 64"
rows() { echo "rc $1"; grep -E "^\||slow garbage" "$2" | head -n "${3:-6}" | cut -c1-300; }
unpack_kept() {
  if [ -f "$kept" ]; then t "kept $kept"; tar xzf "$kept" -C /root/keep && du -sm "$PPD_COMPILE_CACHE"; fi
}
# The compiled artifacts as they stand, packed in 15 MiB parts for peek.sh to bring back once (as v31's were), where
# they fit beside the results' archive (64 MiB in all); the next lease carries them in .gpu_keep.
pack_kept() {
  mkdir -p /root/keep/out && tar czf /root/keep/compiled.tgz -C /root/keep compiled
  local size; size=$(stat -c %s /root/keep/compiled.tgz); echo "compiled.tgz $size bytes"
  if (( size <= 45 * 1048576 )); then
    split -b 15m /root/keep/compiled.tgz /root/keep/out/compiled.tgz. && touch /root/keep/packed
  fi
}

# The parts of the staging-row leases (h100/v36 on; h100/v35, as it ran, keeps its own copies). `exact` says
# whether the batcher's GPU tests passed in every run (batcher_tests); the parts that time staging rows run only
# then. The job sets B, the `--batchers` that `staging` compares.
exact=unknown
batcher_tests() {  # $1 runs of the batcher's GPU tests
  local failed=0
  for i in $(seq "${1:?usage: batcher_tests RUNS}"); do
    timeout 300 python -m pytest -q -p no:cacheprovider tests/test_batcher.py -k gpu >> $R/logs/tests.log 2>&1
    rc=$?; echo "rc $rc (run $i)"; tail -n 1 $R/logs/tests.log; [ $rc -eq 0 ] || failed=1
  done
  if [ $failed -eq 0 ]; then exact=yes; else exact=no; fi
}
exact_or_skip() { [ "$exact" = yes ] || { echo "skipped: the GPU tests did not pass"; return 1; }; }
staging() {  # batch 32 (the policy and the 17-row chained tree) and 16, the batchers $B in one process
  exact_or_skip || return 0
  timeout 900 $C --batch_sizes 32 16 --prompts 160 --rounds 2 $B --trees results/lookup/trees/tree_8_lookup8.json \
    --output $R/staging.json > $R/logs/staging.log 2>&1
  rows $? $R/logs/staging.log 6; grep -E "^batch" $R/logs/staging.log | cut -c1-250
}
load16() {  # $1 names the output; the staging rows come from the environment
  timeout 400 $L --methods baseline ppd --clients 16 --requests 160 "$S" --output $R/load16_$1.json \
    > $R/logs/load16_$1.log 2>&1; rows $? $R/logs/load16_$1.log 5
}
load16_pairs() {  # one staging row, four ahead, four, four ahead again
  exact_or_skip || return 0
  load16 default; PPD_STAGING_ROWS=4 PPD_PREFILL_AHEAD=1 load16 ahead4_1; PPD_STAGING_ROWS=4 load16 staging4
  PPD_STAGING_ROWS=4 PPD_PREFILL_AHEAD=1 load16 ahead4_2
}
profile_8k() {  # issue 18: where a batch-16 tree step's time goes at 8K of context (h200/v28b: 0.91x there)
  timeout 480 python -m eval.step_profile $E --context 8000 --batch_size 16 --steps 16 --max_seq_len 8448 \
    --trees results/lookup/trees/tree_16_lookup8.json results/lookup/trees/tree_8_lookup8.json --top 40 --sequence \
    --output $R/step_profile_8k_b16.json > $R/logs/profile_8k.log 2>&1; rows $? $R/logs/profile_8k.log 8
}
segv() {  # h100/v35's first test run (engine, streams, batcher) ended in a segmentation fault after pytest's summary
  timeout 400 python -X faulthandler -m pytest -q -p no:cacheprovider -p no:faulthandler tests/test_streams.py \
    tests/test_engine.py -k gpu > $R/logs/segv.log 2>&1; echo "rc $?"; tail -n 30 $R/logs/segv.log | cut -c1-200
}
continuous() {  # issue 14's decoder table with four staging rows (b1-32)
  exact_or_skip || return 0
  PPD_STAGING_ROWS=4 timeout 900 $C --batch_sizes 32 16 8 4 2 1 --prompts 160 \
    --trees results/lookup/trees/tree_8_lookup8.json --output $R/continuous_staging4.json \
    --plot $R/continuous_staging4.png > $R/logs/continuous.log 2>&1; rows $? $R/logs/continuous.log 9
}
