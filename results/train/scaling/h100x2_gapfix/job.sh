#!/usr/bin/env bash
# Issue 13: the captured step's GPU tests, then 1 GPU against 2 at the shipped size; then issue 18's 8K phases.
set -u
cd /root/tree
export PYTHONPATH=/root/ppd-site:/root/tree HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OUT=/root/res
t() { echo "== $(date +%T) $*"; }
t tests; python -m pytest -q tests/test_captured_training.py > /root/res/gpu_test.log 2>&1; tail -1 /root/res/gpu_test.log
python -m pytest -q tests/test_train.py -k lagged_read >> /root/res/gpu_test.log 2>&1; tail -1 /root/res/gpu_test.log
t data; SAMPLES=3000 bash results/train/scaling/run.sh data | tail -1
export EPOCHS=3 EVAL_SIZE=0.03; R=results/train/scaling/run.sh
t base; EXTRA="--capture_step --group_by_width" TAG=-captured-grouped RUNS="1:8::3e-3 2:4::3e-3" bash $R quality | tail -3
t warm; EXTRA="--capture_step --group_by_width --warmup_ratio 0.1" TAG=-captured-grouped-warm RUNS="2:8:1.4e-2:4.2e-3 2:8:2e-2:6e-3" bash $R quality | tail -3
t b16; EXTRA="--capture_step --group_by_width" TAG=-captured-grouped RUNS="2:8::3e-3" bash $R quality | tail -6
t compiled; EXTRA="--capture_step --group_by_width --torch_compile" TAG=-captured-grouped-compiled RUNS="1:8::3e-3 2:4::3e-3" bash $R quality | tail -8
t deep; DEADLINE=100000 PHASE_CAP=420 bash results/deep_gpu/run.sh feed8k longmatmul | tail -3
t end; echo "JOB DONE"
