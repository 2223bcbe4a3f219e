#!/usr/bin/env bash
# Once job.sh reaches its width-mask A/B, stops it and runs 8K at batch 16 with the tree's mask instead.
set -u
cd /root/tree
until grep -q "long-b1-width\|^== .* end" /root/res/gpu0.log; do sleep 2; done
pkill -f "bash .gpu/job/job[.]sh"; pkill -f "m eval[.]long_context"; pkill -f "run_module[(]'eval"; sleep 3
export PYTHONPATH=/root/ppd-site:/root/tree HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OUT=/root/res TORCHINDUCTOR_CACHE_DIR=/root/inductor
R=/root/res/v14b
T=results/train/v7/runs/maps16-lr3e-3-e3/trees
export PPD_SPLIT_TUNING=$(cat $R/best_tuning.txt)
{
  echo "== $(date +%T) long-b16-compact (the width A/B stopped)"
  PPD_GROUPED_SDPA=split timeout 400 python -m eval.long_context --dtype bfloat16 --capture compiled_graph --attention dense \
    --contexts 8192 --data_path /root/ppd-stage/sharegpt_first3000.json --max_new_tokens 128 --max_seq_len 8448 \
    --methods baseline --batch_sizes 16 --trees $T/tree_16.json --output $R/long_context_8k_b16_compact_mask.json \
    > $R/logs/long_b16_compact_mask.log 2>&1
  echo "rc $?"; grep "^context\|^| 8192" $R/logs/long_b16_compact_mask.log; echo "== $(date +%T) end"
} >> /root/res/gpu0.log 2>&1
echo "JOB DONE" >> /root/res/job.log
