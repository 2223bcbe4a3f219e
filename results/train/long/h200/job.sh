#!/usr/bin/env bash
# Twenty-first session, 2 x H200: prompt tokens for long contexts (results/train/long/run.sh): the data, the two
# training runs and their replays, then 8K batch 16 with the better run against the shipped tokens.
set -u
cd /root/tree
export PYTHONPATH=/root/ppd-site:/root/tree HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OUT=/root/res TORCHINDUCTOR_CACHE_DIR=/root/inductor
t() { echo "== $(date +%T) $*"; }
mkdir -p /root/res/long
gunzip -kf /root/ppd-stage/sharegpt_first3000.json.gz /root/ppd-stage/long_prompts.json.gz
export LONG_SAMPLES=1024 GPU_A=0 GPU_B=0 SOURCE=/root/ppd-stage/sharegpt_first3000.json LONG_PROMPTS=/root/ppd-stage/long_prompts.json
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > /root/res/long/gpu.txt
t data; bash results/train/long/run.sh data
t runs; bash results/train/long/run.sh runs
for r in long mixed; do mkdir -p /root/res/long/adapters/$r; cp /root/work-long/runs/$r/*.json /root/work-long/runs/$r/*.safetensors /root/res/long/adapters/$r/ 2>/dev/null; done
t summary; python results/train/long/summary.py /root/res/long | tee /root/res/long/summary.md
BEST=$(python results/train/long/summary.py /root/res/long --best)
t speed $BEST; BEST=$BEST bash results/train/long/run.sh speed
python results/train/long/summary.py /root/res/long | tee /root/res/long/summary.md
t end; echo "JOB DONE"
