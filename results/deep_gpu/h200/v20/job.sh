#!/usr/bin/env bash
# Twenty-fourth session, one H200: prompt lookup built in the decoder, measured end to end. Decoder throughput at
# batch 1-32 (MT-Bench, 256 new tokens) of the baseline, the shipped policy, the 16- and 32-row trees, and the 8-,
# 16- and 32-row trees with a lookup chain of 8 (results/lookup/trees/); then the GPU tests of the lookup and the
# captured steps. Launched as .gpu/job/launch.sh does; outputs in /root/res/v20.
set -u
cd /root/tree
export PYTHONPATH=/root/ppd-site:/root/tree:/root/tree/.gpu/job/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/root/inductor
t() { echo "== $(date +%T) $*"; }
R=/root/res/v20; mkdir -p $R/logs
T=results/train/v7/runs/maps16-lr3e-3-e3/trees
L=results/lookup/trees
E="--dtype bfloat16 --capture compiled_graph"
{
  t speed; timeout 1500 python -m eval.batch_speed $E --batch_sizes 1 16 4 32 8 2 --bench mt_bench --max_new_tokens 256 \
    --max_seq_len 1024 --trees $T/tree_16.json $T/tree_32.json $L/tree_8_lookup8.json $L/tree_16_lookup8.json \
    $L/tree_32_lookup8.json --output $R/batch_speed_lookup.json --plot $R/batch_speed_lookup.png \
    > $R/logs/speed.log 2>&1; echo "rc $?"; tail -n 14 $R/logs/speed.log
  [ "${SPEED_ONLY:-0}" = 1 ] && { t end; echo "JOB DONE" >> /root/res/job.log; exit 0; }
  t check; timeout 900 python -m pytest -q tests/test_lookup.py tests/test_engine.py -k "gpu or lookup" \
    > $R/logs/gpu_tests.log 2>&1; echo "rc $?"; tail -n 5 $R/logs/gpu_tests.log
  t end
} > /root/res/job.log 2>&1
echo "JOB DONE" >> /root/res/job.log
