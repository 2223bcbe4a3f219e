#!/usr/bin/env bash
# Twentieth session, second 2 x H200 lease: the two-pass training with its first pass causal (no mask). The captured
# step's GPU test, issue 13's data again, the training pair (1 GPU x 8, 2 x 4), then the step's profile at batch 8.
set -u
cd /root/tree
export PYTHONPATH=/root/ppd-site:/root/tree HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OUT=/root/res TORCHINDUCTOR_CACHE_DIR=/root/inductor
t() { echo "== $(date +%T) $*"; }
mkdir -p /root/res/logs /root/res/deep_gpu/logs
gunzip -kf /root/ppd-stage/sharegpt_first3000.json.gz
t gpu-tests; timeout 300 python -m pytest -q -x tests/test_captured_training.py -k gpu > /root/res/logs/gpu_tests.log 2>&1
echo "rc $?"; tail -1 /root/res/logs/gpu_tests.log
t data; SOURCE=/root/ppd-stage/sharegpt_first3000.json SAMPLES=3000 bash results/train/scaling/run.sh data | tail -1
export EPOCHS=3 EVAL_SIZE=0.03
t two-pass-causal; EXTRA="--capture_step --group_by_width --torch_compile" TAG=-captured-grouped-compiled-twopass-causal \
  RUNS="1:8::3e-3 2:4::3e-3" bash results/train/scaling/run.sh quality | tail -4
t profile; CUDA_VISIBLE_DEVICES=0 timeout 240 python -m eval.train_profile --dataset_path /root/work-scaling/sd-targets \
  --batch_sizes 8 --steps 10 --warmup 5 --top 40 --variants captured:512 --output /root/res/deep_gpu/train_profile_twopass_causal.json \
  -- --trainer_type distillation --num_prompt_tokens 3 --deep --map_rank 16 --torch_compile > /root/res/deep_gpu/logs/train_profile_twopass_causal.log 2>&1
echo "rc $?"; grep "^| captured" /root/res/deep_gpu/logs/train_profile_twopass_causal.log
t end; echo "JOB DONE"
