#!/usr/bin/env bash
# Nineteenth session, first lease: why the tree's own mask makes a slower pass at 8K (issue 18); batch 16's pass profiled.
set -u
cd /root/tree
export PYTHONPATH=/root/ppd-site:/root/tree HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OUT=/root/res TORCHINDUCTOR_CACHE_DIR=/root/inductor
t() { echo "== $(date +%T) $*"; }
R=/root/res/v15; mkdir -p $R/logs
gunzip -kf /root/ppd-stage/sharegpt_first3000.json.gz
T=results/train/v7/runs/maps16-lr3e-3-e3/trees
A="--dtype bfloat16 --capture compiled_graph --attention dense --contexts 8192 --data_path /root/ppd-stage/sharegpt_first3000.json --max_new_tokens 128 --max_seq_len 8448 --methods baseline"
P="--dtype bfloat16 --capture compiled_graph --context 8000 --max_seq_len 8448 --steps 24"
export PPD_GROUPED_SDPA=split
{
  t long-b1-tree; PPD_SPLIT_MASK=tree timeout 420 python -m eval.long_context $A --batch_sizes 1 --trees $T/tree_128.json \
    --output $R/long_context_8k_b1_tree_mask.json > $R/logs/long_b1_tree_mask.log 2>&1
  echo "rc $?"; grep "^context\|^| 8192\|pass\|captured" $R/logs/long_b1_tree_mask.log | tail -8
  t long-b1-width; timeout 400 python -m eval.long_context $A --batch_sizes 1 --trees $T/tree_128.json \
    --output $R/long_context_8k_b1_width_mask.json > $R/logs/long_b1_width_mask.log 2>&1
  echo "rc $?"; grep "^context\|^| 8192\|pass\|captured" $R/logs/long_b1_width_mask.log | tail -8
  t profile-b1-tree; PPD_SPLIT_MASK=tree timeout 300 python -m eval.step_profile $P --trees $T/tree_128.json \
    --output $R/profile_8k_b1_tree_mask.json > $R/logs/profile_b1_tree_mask.log 2>&1; echo "rc $?"
  grep -i "wall\|device\|pieces\|merge" $R/logs/profile_b1_tree_mask.log | head -20
  t profile-b16-tree; PPD_SPLIT_MASK=tree PPD_SPLIT_TUNING=per_processor=4 timeout 400 python -m eval.step_profile $P \
    --batch_size 16 --trees $T/tree_16.json --top 25 --output $R/profile_8k_b16_tree_mask.json > $R/logs/profile_b16_tree_mask.log 2>&1
  echo "rc $?"; grep -i "wall\|device\|pieces\|merge" $R/logs/profile_b16_tree_mask.log | head -20
  t tests; timeout 200 python -m pytest -q -p no:cacheprovider tests/test_split_attention.py -k gpu \
    > $R/logs/tests.log 2>&1; tail -2 $R/logs/tests.log
  t long-b16-tree; PPD_SPLIT_MASK=tree PPD_SPLIT_TUNING=per_processor=4 timeout 400 python -m eval.long_context $A \
    --batch_sizes 16 --trees $T/tree_16.json --output $R/long_context_8k_b16_tree_mask_pp4.json > $R/logs/long_b16_tree_mask_pp4.log 2>&1
  echo "rc $?"; grep "^context\|^| 8192\|pass\|captured" $R/logs/long_b16_tree_mask_pp4.log | tail -8
  t end
} > /root/res/gpu0.log 2>&1
echo "JOB DONE"
