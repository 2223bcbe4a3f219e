#!/usr/bin/env bash
# Twenty-fifth session, one H200. (1) Decoder throughput in static batches at batch 2-16: the shipped policy
# against the v7 16- and 32-row trees with a lookup chain of 8, to decide the policy's buckets 2-16. (2) The same
# variants through the serving engine's continuous batcher (`--batching continuous`) at batch 1-32. (3) Where a
# batch-16 step's time goes (`eval.step_profile`). (4) The lookup chain's GPU tests. Compiled artifacts are kept in
# $PPD_COMPILE_CACHE for later machines. Launched as .gpu/job/launch.sh does; outputs in /root/res/v21.
set -u
cd /root/tree
export PYTHONPATH=/root/ppd-site:/root/tree:/root/tree/.gpu/job/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=/root/inductor PPD_COMPILE_CACHE=/root/keep/compiled
t() { echo "== $(date +%T) $*"; }
R=/root/res/v21; mkdir -p $R/logs $PPD_COMPILE_CACHE
L=results/lookup/trees
E="--dtype bfloat16 --capture compiled_graph"
TREES="--trees $L/tree_16_lookup8.json $L/tree_32_lookup8.json"
{
  t static; timeout 1200 python -m eval.batch_speed $E --batch_sizes 16 2 4 8 --bench mt_bench --max_new_tokens 256 \
    --max_seq_len 1024 $TREES --output $R/batch_speed_static.json --plot $R/batch_speed_static.png \
    > $R/logs/static.log 2>&1; echo "rc $?"; grep -E "^batch|^\|" $R/logs/static.log | cut -c1-200
  t continuous; timeout 1200 python -m eval.batch_speed $E --batching continuous --batch_sizes 16 4 1 32 \
    --bench mt_bench --max_new_tokens 256 --max_seq_len 1024 $TREES --output $R/batch_speed_continuous.json \
    --plot $R/batch_speed_continuous.png > $R/logs/continuous.log 2>&1; echo "rc $?"
  grep -E "^batch|^\|" $R/logs/continuous.log | cut -c1-200
  t profile; timeout 400 python -m eval.step_profile $E --context 300 --batch_size 16 --steps 32 \
    --trees $L/tree_16_lookup8.json --top 40 --output $R/step_profile_b16.json > $R/logs/profile.log 2>&1
  echo "rc $?"; grep -E "^\|" $R/logs/profile.log | head -8
  t check; timeout 600 python -m pytest -q tests/test_lookup.py -k gpu > $R/logs/gpu_tests.log 2>&1; echo "rc $?"
  tail -n 5 $R/logs/gpu_tests.log
  t end; du -sh $PPD_COMPILE_CACHE
} > /root/res/job.log 2>&1
echo "JOB DONE" >> /root/res/job.log
