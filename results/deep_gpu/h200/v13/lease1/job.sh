#!/usr/bin/env bash
# Seventeenth session, first 2 x H200 lease: the split tree attention (PPD_GROUPED_SDPA=split) at commit 6029c38.
# In this code the one-row step also took the split kernel under PPD_GROUPED_SDPA=split, so the baselines of
# these runs are not the engine's baseline (files *_one_row_split_too*); fixed afterwards and rerun in the
# foreground (see ../README.md, seventeenth session).
# GPU 1: GPU tests, then attention alone at 8K and 1K (attention_feed.py), then issue 18 at 8K, batch 16.
# GPU 0: issue 18 at 8K, batch 1 (baseline, 64- and 128-row trees through the split kernel).
set -u
cd /root/tree
export PYTHONPATH=/root/ppd-site:/root/tree HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OUT=/root/res TORCHINDUCTOR_CACHE_DIR=/root/inductor
t() { echo "== $(date +%T) $*"; }
R=/root/res/split; mkdir -p $R/logs
gunzip -kf /root/ppd-stage/sharegpt_first3000.json.gz
ENGINE="--dtype bfloat16 --capture compiled_graph"
T=results/train/v7/runs/maps16-lr3e-3-e3/trees
LONG="--attention dense --contexts 8192 --data_path /root/ppd-stage/sharegpt_first3000.json --max_new_tokens 128 --max_seq_len 8448 --methods baseline"
gpu0() {
  t long-b1; CUDA_VISIBLE_DEVICES=0 PPD_GROUPED_SDPA=split timeout 780 python -m eval.long_context $ENGINE $LONG --batch_sizes 1 \
    --trees $T/tree_64.json $T/tree_128.json --output $R/long_split_8k_b1.json > $R/logs/long_b1.log 2>&1
  echo "rc $?"; grep -v Warn $R/logs/long_b1.log | tail -12; t gpu0-done
}
gpu1() {
  t tests; CUDA_VISIBLE_DEVICES=1 timeout 240 python -m pytest -q -p no:cacheprovider tests/test_split_attention.py -k gpu \
    > $R/logs/tests.log 2>&1; tail -15 $R/logs/tests.log
  t feed8k; CUDA_VISIBLE_DEVICES=1 timeout 240 python results/deep_gpu/attention_feed.py --batch_sizes 1 16 --rows 17 65 130 \
    --context 8000 --width 8192 --capacity 8448 --repeats 20 --ways matmul split --output $R/feed_8k.json > $R/logs/feed8k.log 2>&1
  grep -v Warn $R/logs/feed8k.log | tail -14
  t feed1k; CUDA_VISIBLE_DEVICES=1 timeout 200 python results/deep_gpu/attention_feed.py --batch_sizes 1 16 --rows 17 65 130 \
    --context 900 --width 1024 --capacity 1100 --repeats 30 --ways gqa split --output $R/feed_1k.json > $R/logs/feed1k.log 2>&1
  grep -v Warn $R/logs/feed1k.log | tail -14
  t long-b16; CUDA_VISIBLE_DEVICES=1 PPD_GROUPED_SDPA=split timeout 780 python -m eval.long_context $ENGINE $LONG --batch_sizes 16 \
    --trees $T/tree_16.json $T/tree_64.json --output $R/long_split_8k_b16.json > $R/logs/long_b16.log 2>&1
  echo "rc $?"; grep -v Warn $R/logs/long_b16.log | tail -12; t gpu1-done
}
gpu0 > /root/res/gpu0.log 2>&1 &
gpu1 > /root/res/gpu1.log 2>&1 &
wait; cat /root/res/gpu0.log /root/res/gpu1.log; t end; echo "JOB DONE"
