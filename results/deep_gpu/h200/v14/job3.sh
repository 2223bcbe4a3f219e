#!/usr/bin/env bash
# Profiles of the 8K batch-1 tree step: the compact tree mask against the width's mask.
set -u
cd /root/tree
export PYTHONPATH=/root/ppd-site:/root/tree HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OUT=/root/res TORCHINDUCTOR_CACHE_DIR=/root/inductor
t() { echo "== $(date +%T) $*"; }
R=/root/res/v14; mkdir -p $R/logs
T=results/train/v7/runs/maps16-lr3e-3-e3/trees
A="--dtype bfloat16 --capture compiled_graph --context 8000 --max_seq_len 8448 --steps 24 --trees $T/tree_128.json --top 12"
export PPD_SPLIT_TUNING=$(cat $R/best_tuning.txt)
{
  t profile-compact; PPD_GROUPED_SDPA=split timeout 300 python -m eval.step_profile $A --output $R/profile_8k_b1_compact.json \
    > $R/logs/profile_compact.log 2>&1; echo "rc $?"; grep -v "pow_by_natural\|^W1" $R/logs/profile_compact.log | tail -40
  t profile-width; PPD_GROUPED_SDPA=split timeout 300 python -c "
import runpy, sys
import ppd.decoding.grouped_attention as g
g.compact_tree_mask = lambda *a, **k: False
sys.argv = ['step_profile'] + sys.argv[1:]
runpy.run_module('eval.step_profile', run_name='__main__')" $A --output $R/profile_8k_b1_width_mask.json > $R/logs/profile_width.log 2>&1
  echo "rc $?"; grep -v "pow_by_natural\|^W1" $R/logs/profile_width.log | tail -40
  t end
} > /root/res/gpu0.log 2>&1
echo "JOB DONE"
