#!/usr/bin/env bash
# After the training runs of job.sh: the decoder before/after at batch 1 (then 2), and a step's kernels at batch 1.
set -u
cd /root/tree
export PYTHONPATH=/root/ppd-site:/root/tree HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OUT=/root/res TORCHINDUCTOR_CACHE_DIR=/root/inductor
t() { echo "== $(date +%T) $*"; }
R=/root/res/deep_gpu; mkdir -p $R/logs
while pgrep -f "scaling/run[.]sh" > /dev/null; do sleep 2; done
ENGINE="--dtype bfloat16 --capture compiled_graph"
T=results/train/v7/runs/maps16-lr3e-3-e3/trees
for b in 1 2; do
  BS="--batch_sizes $b --bench mt_bench --max_new_tokens 256 --max_seq_len 1024"
  t decode-old-b$b; (cd /root/tree_mm && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/root/ppd-site:/root/tree_mm PPD_PREFILL_GRAPHS=0 timeout 400 \
    python -m eval.batch_speed $ENGINE $BS --output $R/batch_speed_before_b$b.json > $R/logs/before_b$b.log 2>&1); grep "^batch" $R/logs/before_b$b.log | tail -3
  t decode-new-b$b; CUDA_VISIBLE_DEVICES=0 timeout 400 python -m eval.batch_speed $ENGINE $BS --output $R/batch_speed_after_b$b.json \
    > $R/logs/after_b$b.log 2>&1; grep "^batch" $R/logs/after_b$b.log | tail -3
  if [ $b = 1 ]; then
    t profile-new; CUDA_VISIBLE_DEVICES=0 timeout 300 python -m eval.step_profile $ENGINE --context 300 --batch_size 1 --steps 32 \
      --trees $T/tree_128.json --top 40 --output $R/profile_b1_after.json > $R/logs/profile_after.log 2>&1; tail -3 $R/logs/profile_after.log
  fi
done
t end; echo "JOB DONE"
