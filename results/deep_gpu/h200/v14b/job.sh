#!/usr/bin/env bash
# Eighteenth session, second lease: the kernel with the prefix in a loop of its own (issue 18).
set -u
cd /root/tree
export PYTHONPATH=/root/ppd-site:/root/tree HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OUT=/root/res TORCHINDUCTOR_CACHE_DIR=/root/inductor
t() { echo "== $(date +%T) $*"; }
R=/root/res/v14b; mkdir -p $R/logs
gunzip -kf /root/ppd-stage/sharegpt_first3000.json.gz
T=results/train/v7/runs/maps16-lr3e-3-e3/trees
A="--dtype bfloat16 --capture compiled_graph --attention dense --contexts 8192 --data_path /root/ppd-stage/sharegpt_first3000.json --max_new_tokens 128 --max_seq_len 8448 --methods baseline --batch_sizes 1 --trees $T/tree_128.json"
{
  t sweep; timeout 300 python results/deep_gpu/split_sweep.py --output $R/split_sweep.json --best $R/best_tuning.txt \
    > $R/logs/sweep.log 2>&1; echo "rc $?"; grep -v "^  batch" $R/logs/sweep.log | grep -v "^batch.*difference"; grep "^  batch\|difference" $R/logs/sweep.log
  export PPD_SPLIT_TUNING=$(cat $R/best_tuning.txt 2>/dev/null || true); echo "PPD_SPLIT_TUNING=$PPD_SPLIT_TUNING"
  t long-b1-compact; PPD_GROUPED_SDPA=split timeout 400 python -m eval.long_context $A \
    --output $R/long_context_8k_b1_compact_mask.json > $R/logs/long_b1_compact_mask.log 2>&1
  echo "rc $?"; grep "^context\|^| 8192" $R/logs/long_b1_compact_mask.log
  t tests; timeout 200 python -m pytest -q -p no:cacheprovider tests/test_split_attention.py -k gpu \
    > $R/logs/tests.log 2>&1; tail -2 $R/logs/tests.log
  t long-b1-width; PPD_GROUPED_SDPA=split timeout 400 python -c "
import runpy, sys
import ppd.decoding.grouped_attention as g
g.compact_tree_mask = lambda *a, **k: False
sys.argv = ['long_context'] + sys.argv[1:]
runpy.run_module('eval.long_context', run_name='__main__')" $A --output $R/long_context_8k_b1_width_mask.json > $R/logs/long_b1_width_mask.log 2>&1
  echo "rc $?"; grep "^context\|^| 8192" $R/logs/long_b1_width_mask.log
  t end
} > /root/res/gpu0.log 2>&1
echo "JOB DONE"
