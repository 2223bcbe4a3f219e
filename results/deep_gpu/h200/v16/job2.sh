#!/usr/bin/env bash
# Twentieth session, the same 2 x H200 lease after the training pair: issue 18's batch 16 at 8K with the split
# kernel's whole-wave piece count (default tuning now), the 16-row tree, on GPU 0 alone.
set -u
cd /root/tree
export PYTHONPATH=/root/ppd-site:/root/tree HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/root/inductor
t() { echo "== $(date +%T) $*"; }
R=/root/res/deep_gpu; mkdir -p $R/logs
T=results/train/v7/runs/maps16-lr3e-3-e3/trees
A="--dtype bfloat16 --capture compiled_graph --attention dense --contexts 8192 --data_path /root/ppd-stage/sharegpt_first3000.json --max_new_tokens 128 --max_seq_len 8448 --methods baseline"
t long-b16; CUDA_VISIBLE_DEVICES=0 PPD_GROUPED_SDPA=split timeout 560 python -m eval.long_context $A \
  --batch_sizes 16 --trees $T/tree_16.json --output $R/long_context_8k_b16_whole_waves.json > $R/logs/long_b16_whole_waves.log 2>&1
echo "rc $?"; grep "^context\|^| 8192\|pass\|captured" $R/logs/long_b16_whole_waves.log | tail -8
t end; echo "JOB DONE"
