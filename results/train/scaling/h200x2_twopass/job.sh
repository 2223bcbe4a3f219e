#!/usr/bin/env bash
# Twentieth session, 2 x H200: the two-pass training forward (ppd.two_pass) against one pass. The captured step's
# GPU test first (its graphs now replay the two passes), then issue 13's data, then the training pair (1 GPU x 8,
# 2 x 4) with two passes (the new default) and with --single_pass, captured, grouped and compiled.
set -u
cd /root/tree
export PYTHONPATH=/root/ppd-site:/root/tree HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OUT=/root/res TORCHINDUCTOR_CACHE_DIR=/root/inductor
t() { echo "== $(date +%T) $*"; }
mkdir -p /root/res/logs
gunzip -kf /root/ppd-stage/sharegpt_first3000.json.gz
t gpu-tests; timeout 300 python -m pytest -q -x tests/test_captured_training.py -k gpu > /root/res/logs/gpu_tests.log 2>&1
echo "rc $?"; tail -3 /root/res/logs/gpu_tests.log
t data; SOURCE=/root/ppd-stage/sharegpt_first3000.json SAMPLES=3000 bash results/train/scaling/run.sh data | tail -1
export EPOCHS=3 EVAL_SIZE=0.03
t two-pass; EXTRA="--capture_step --group_by_width --torch_compile" TAG=-captured-grouped-compiled-twopass \
  RUNS="1:8::3e-3 2:4::3e-3" bash results/train/scaling/run.sh quality | tail -4
t one-pass; EXTRA="--capture_step --group_by_width --torch_compile --single_pass" TAG=-captured-grouped-compiled-onepass \
  RUNS="1:8::3e-3 2:4::3e-3" bash results/train/scaling/run.sh quality | tail -8
t end; echo "JOB DONE"
