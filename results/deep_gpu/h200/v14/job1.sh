#!/usr/bin/env bash
# Eighteenth session: the split kernel with its merge as one Triton kernel and its tunings swept (issue 18).
set -u
cd /root/tree
export PYTHONPATH=/root/ppd-site:/root/tree HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OUT=/root/res TORCHINDUCTOR_CACHE_DIR=/root/inductor
t() { echo "== $(date +%T) $*"; }
R=/root/res/v14; mkdir -p $R/logs
gunzip -kf /root/ppd-stage/sharegpt_first3000.json.gz
T=results/train/v7/runs/maps16-lr3e-3-e3/trees
L="python -m eval.long_context --dtype bfloat16 --capture compiled_graph --attention dense --contexts 8192
   --data_path /root/ppd-stage/sharegpt_first3000.json --max_new_tokens 128 --max_seq_len 8448 --methods baseline"
{
  t sweep; timeout 420 python results/deep_gpu/split_sweep.py --output $R/split_sweep.json --best $R/best_tuning.txt \
    > $R/logs/sweep.log 2>&1; echo "rc $?"; grep -v "^  batch" $R/logs/sweep.log | tail -12
  export PPD_SPLIT_TUNING=$(cat $R/best_tuning.txt 2>/dev/null || true); echo "PPD_SPLIT_TUNING=$PPD_SPLIT_TUNING"
  t long-b1; PPD_GROUPED_SDPA=split timeout 480 $L --batch_sizes 1 --trees $T/tree_128.json \
    --output $R/long_context_8k_b1.json > $R/logs/long_b1.log 2>&1; echo "rc $?"; grep "^context\|^| 8192" $R/logs/long_b1.log
  t tests; timeout 200 python -m pytest -q -p no:cacheprovider tests/test_split_attention.py -k gpu \
    > $R/logs/tests.log 2>&1; tail -2 $R/logs/tests.log
  t long-b16; PPD_GROUPED_SDPA=split timeout 480 $L --batch_sizes 16 --trees $T/tree_16.json \
    --output $R/long_context_8k_b16.json > $R/logs/long_b16.log 2>&1; echo "rc $?"; grep "^context\|^| 8192" $R/logs/long_b16.log
  t long-b1-trees; PPD_GROUPED_SDPA=split timeout 480 $L --batch_sizes 1 --trees $T/tree_64.json $T/tree_256.json \
    --output $R/long_context_8k_b1_trees.json > $R/logs/long_b1_trees.log 2>&1; echo "rc $?"; grep "^context\|^| 8192" $R/logs/long_b1_trees.log
  t end
} > /root/res/gpu0.log 2>&1
echo "JOB DONE"
