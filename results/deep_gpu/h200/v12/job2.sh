#!/usr/bin/env bash
# Sixteenth session, second 2 x H200 lease (the first was given back idle before its training and 8K runs).
# Both GPUs: issue 13's training data while each GPU compiles one maps variant at batch 2; then the compiled
# training pair (1 GPU x 8, 2 x 4) with the deep tables unbound once a forward; then batch 2, low-rank against merged maps.
set -u
cd /root/tree
export PYTHONPATH=/root/ppd-site:/root/tree HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OUT=/root/res TORCHINDUCTOR_CACHE_DIR=/root/inductor
export PPD_COMPILE_CACHE=/root/keep/compiled
t() { echo "== $(date +%T) $*"; }
R=/root/res/deep_gpu; mkdir -p $R/logs $PPD_COMPILE_CACHE
gunzip -kf /root/ppd-stage/sharegpt_first3000.json.gz
ENGINE="--dtype bfloat16 --capture compiled_graph"
BS="--batch_sizes 2 --bench mt_bench --max_new_tokens 256 --max_seq_len 1024"
warm() {
  CUDA_VISIBLE_DEVICES=$1 PPD_DEEP_MAPS=$2 timeout 400 python -m eval.batch_speed $ENGINE $BS --prompts 2 --max_new_tokens 8 \
    --output /tmp/warm_$2.json > $R/logs/warm2_$2.log 2>&1; echo "warm $2 rc $? at $(date +%T)"
}
t data-and-warm; warm 0 low_rank > /root/res/warm0.log 2>&1 & warm 1 merged > /root/res/warm1.log 2>&1 &
SOURCE=/root/ppd-stage/sharegpt_first3000.json SAMPLES=3000 bash results/train/scaling/run.sh data | tail -1
t data-done; wait; cat /root/res/warm0.log /root/res/warm1.log
export EPOCHS=3 EVAL_SIZE=0.03
t train; EXTRA="--capture_step --group_by_width --torch_compile" TAG=-captured-grouped-compiled-unbound RUNS="1:8::3e-3 2:4::3e-3" \
  bash results/train/scaling/run.sh quality | tail -8
for run in low_rank:1 merged:1; do
  IFS=: read -r maps n <<< "$run"
  t b2-$maps-$n; CUDA_VISIBLE_DEVICES=0 PPD_DEEP_MAPS=$maps timeout 200 python -m eval.batch_speed $ENGINE $BS \
    --output $R/batch_speed_b2_${maps}_$n.json > $R/logs/b2_${maps}_$n.log 2>&1
  echo "rc $?"; grep -i "^batch\|ms a pass" $R/logs/b2_${maps}_$n.log | tail -4
done
t end; echo "JOB DONE"
