#!/usr/bin/env bash
# Seventeenth session, second lease: the split kernel with its Triton merge; one-row steps back on SDPA.
# GPU 0: issue 18 at 8K, batch 1 (baseline and the 128-row tree). GPU 1: GPU tests, then attention alone at 8K.
set -u
cd /root/tree
export PYTHONPATH=/root/ppd-site:/root/tree HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OUT=/root/res TORCHINDUCTOR_CACHE_DIR=/root/inductor
t() { echo "== $(date +%T) $*"; }
R=/root/res/split2; mkdir -p $R/logs
gunzip -kf /root/ppd-stage/sharegpt_first3000.json.gz
T=results/train/v7/runs/maps16-lr3e-3-e3/trees
gpu0() {
  t long-b1; CUDA_VISIBLE_DEVICES=0 PPD_GROUPED_SDPA=split timeout 400 python -m eval.long_context --dtype bfloat16 \
    --capture compiled_graph --attention dense --contexts 8192 --data_path /root/ppd-stage/sharegpt_first3000.json \
    --max_new_tokens 128 --max_seq_len 8448 --methods baseline --batch_sizes 1 --trees $T/tree_128.json \
    --output $R/long_split_8k_b1.json > $R/logs/long_b1.log 2>&1; echo "rc $?"; grep "^context\|^| 8192" $R/logs/long_b1.log
  t gpu0-done
}
gpu1() {
  t tests; CUDA_VISIBLE_DEVICES=1 timeout 200 python -m pytest -q -p no:cacheprovider tests/test_split_attention.py -k gpu \
    > $R/logs/tests.log 2>&1; tail -2 $R/logs/tests.log
  t feed8k; CUDA_VISIBLE_DEVICES=1 timeout 150 python results/deep_gpu/attention_feed.py --batch_sizes 1 16 --rows 17 130 \
    --context 8000 --width 8192 --capacity 8448 --repeats 20 --ways split --output $R/feed_8k.json > $R/logs/feed8k.log 2>&1
  grep "^batch" $R/logs/feed8k.log; t gpu1-done
}
gpu0 > /root/res/gpu0.log 2>&1 &
gpu1 > /root/res/gpu1.log 2>&1 &
wait; cat /root/res/gpu0.log /root/res/gpu1.log; t end; echo "JOB DONE"
