#!/usr/bin/env bash
# A/B at 8K batch 1: the compact tree mask off (monkeypatched) against on, the swept tuning.
set -u
cd /root/tree
export PYTHONPATH=/root/ppd-site:/root/tree HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OUT=/root/res TORCHINDUCTOR_CACHE_DIR=/root/inductor
t() { echo "== $(date +%T) $*"; }
R=/root/res/v14; mkdir -p $R/logs
T=results/train/v7/runs/maps16-lr3e-3-e3/trees
A="--dtype bfloat16 --capture compiled_graph --attention dense --contexts 8192 --data_path /root/ppd-stage/sharegpt_first3000.json --max_new_tokens 128 --max_seq_len 8448 --methods baseline --batch_sizes 1 --trees $T/tree_128.json"
export PPD_SPLIT_TUNING=$(cat $R/best_tuning.txt)
{
  t nocompact-b1; PPD_GROUPED_SDPA=split timeout 400 python -c "
import runpy, sys
import ppd.decoding.grouped_attention as g
g.compact_tree_mask = lambda *a, **k: False
sys.argv = ['long_context'] + sys.argv[1:]
runpy.run_module('eval.long_context', run_name='__main__')" $A --output $R/long_context_8k_b1_width_mask.json > $R/logs/long_b1_width_mask.log 2>&1
  echo "rc $?"; grep "^context\|^| 8192" $R/logs/long_b1_width_mask.log
  t default-tuning-b1; PPD_SPLIT_TUNING= PPD_GROUPED_SDPA=split timeout 400 python -m eval.long_context $A \
    --output $R/long_context_8k_b1_default_tuning.json > $R/logs/long_b1_default_tuning.log 2>&1
  echo "rc $?"; grep "^context\|^| 8192" $R/logs/long_b1_default_tuning.log
  t end
} > /root/res/gpu0.log 2>&1
echo "JOB DONE"
