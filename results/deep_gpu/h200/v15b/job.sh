#!/usr/bin/env bash
# Nineteenth session, second lease: the one-row steps at the context window's end warmed up, the tree's own mask by
# default, eight 8K prompts at batch 1; batch 16 with three trees; the GPU tests with the parameter fixed; the
# kernel's folded rows a program swept.
set -u
cd /root/tree
export PYTHONPATH=/root/ppd-site:/root/tree HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OUT=/root/res TORCHINDUCTOR_CACHE_DIR=/root/inductor
t() { echo "== $(date +%T) $*"; }
R=/root/res/v15b; mkdir -p $R/logs
gunzip -kf /root/ppd-stage/sharegpt_first3000.json.gz
T=results/train/v7/runs/maps16-lr3e-3-e3/trees
A="--dtype bfloat16 --capture compiled_graph --attention dense --contexts 8192 --data_path /root/ppd-stage/sharegpt_first3000.json --max_new_tokens 128 --max_seq_len 8448 --methods baseline"
export PPD_GROUPED_SDPA=split
{
  t long-b1-tree-8; timeout 480 python -m eval.long_context $A --batch_sizes 1 --samples 8 --trees $T/tree_128.json $T/tree_64.json \
    --output $R/long_context_8k_b1_samples8.json > $R/logs/long_b1_samples8.log 2>&1
  echo "rc $?"; grep "^context\|^| 8192\|pass\|captured" $R/logs/long_b1_samples8.log | tail -8
  t tests; timeout 200 python -m pytest -q -p no:cacheprovider tests/test_split_attention.py -k gpu \
    > $R/logs/tests.log 2>&1; tail -2 $R/logs/tests.log
  t long-b16-tree; PPD_SPLIT_TUNING=per_processor=4 timeout 480 python -m eval.long_context $A \
    --batch_sizes 16 --trees $T/tree_16.json $T/tree_32.json $T/tree_64.json --output $R/long_context_8k_b16_pp4.json > $R/logs/long_b16_pp4.log 2>&1
  echo "rc $?"; grep "^context\|^| 8192\|pass\|captured" $R/logs/long_b16_pp4.log | tail -8
  t sweep; timeout 420 python results/deep_gpu/split_sweep.py --ways tree --output $R/split_sweep_block_m.json \
    --best $R/best_tuning.txt > $R/logs/sweep.log 2>&1; echo "rc $?"; grep -v "^  batch" $R/logs/sweep.log | tail -12; grep "^  batch" $R/logs/sweep.log
  t long-b1-width-8; PPD_SPLIT_MASK=width timeout 400 python -m eval.long_context $A --batch_sizes 1 --samples 8 --trees $T/tree_128.json \
    --output $R/long_context_8k_b1_samples8_width_mask.json > $R/logs/long_b1_samples8_width_mask.log 2>&1
  echo "rc $?"; grep "^context\|^| 8192\|pass\|captured" $R/logs/long_b1_samples8_width_mask.log | tail -8
  t end
} > /root/res/gpu0.log 2>&1
echo "JOB DONE"
