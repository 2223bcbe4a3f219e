#!/usr/bin/env bash
# Issue 13: compiled training layers with the deep tokens' offsets and maps inside, 1 GPU x 8 against 2 x 4.
# Issue 14: the decoder as last timed (eager prefills, maps as matrix products) against prefills from CUDA
# graphs with the maps as fused sums; kernels of a step at batch 1. Issue 18: the 8K matmul phase with what is left.
set -u
cd /root/tree
export PYTHONPATH=/root/ppd-site:/root/tree HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OUT=/root/res TORCHINDUCTOR_CACHE_DIR=/root/inductor
t() { echo "== $(date +%T) $*"; }
R=/root/res/deep_gpu; mkdir -p $R/logs
gunzip -kf /root/ppd-stage/sharegpt_first3000.json.gz
# The code as last timed: the maps' products as matrix products in the compiled step too.
rm -rf /root/tree_mm && cp -r /root/tree /root/tree_mm
sed -i 's/    if torch.compiler.is_compiling() and not torch.is_grad_enabled():/    if False:/' /root/tree_mm/ppd/deep_prompts.py
echo "old variant edited: $(grep -c 'if False:' /root/tree_mm/ppd/deep_prompts.py)"
ENGINE="--dtype bfloat16 --capture compiled_graph"
BS="--batch_sizes 1 2 4 8 --bench mt_bench --max_new_tokens 256 --max_seq_len 1024"
warm() {  # GPU 1, while the data are made: GPU tests of the changed code, then Inductor's cache for both variants
  CUDA_VISIBLE_DEVICES=1 timeout 200 python -m pytest -q tests/test_engine.py tests/test_deep_prompts.py \
    -k "captured_prefills or every_step_mode_agrees" > $R/logs/gpu_tests.log 2>&1; tail -1 $R/logs/gpu_tests.log
  (cd /root/tree_mm && CUDA_VISIBLE_DEVICES=1 PYTHONPATH=/root/ppd-site:/root/tree_mm timeout 300 python -m eval.batch_speed $ENGINE $BS \
    --prompts 1 --max_new_tokens 8 --output /tmp/warm_old.json > $R/logs/warm_old.log 2>&1); echo "warm old rc $?"
  CUDA_VISIBLE_DEVICES=1 timeout 300 python -m eval.batch_speed $ENGINE $BS --prompts 1 --max_new_tokens 8 \
    --output /tmp/warm_new.json > $R/logs/warm_new.log 2>&1; echo "warm new rc $?"
}
t data; warm > /root/res/warm.log 2>&1 &
SOURCE=/root/ppd-stage/sharegpt_first3000.json SAMPLES=3000 bash results/train/scaling/run.sh data | tail -1
t wait-warm; wait; cat /root/res/warm.log
export EPOCHS=3 EVAL_SIZE=0.03
t compiled; EXTRA="--capture_step --group_by_width --torch_compile" TAG=-captured-grouped-compiled-fused RUNS="1:8::3e-3 2:4::3e-3" \
  bash results/train/scaling/run.sh quality | tail -8
t decode-old; (cd /root/tree_mm && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/root/ppd-site:/root/tree_mm PPD_PREFILL_GRAPHS=0 timeout 500 \
  python -m eval.batch_speed $ENGINE $BS --output $R/batch_speed_before.json > $R/logs/before.log 2>&1); grep "^batch\|ms a pass" $R/logs/before.log | tail -12
t decode-new; CUDA_VISIBLE_DEVICES=0 timeout 500 python -m eval.batch_speed $ENGINE $BS --output $R/batch_speed_after.json \
  --plot $R/batch_speed_after.png > $R/logs/after.log 2>&1; grep "^batch\|ms a pass" $R/logs/after.log | tail -12
T=results/train/v7/runs/maps16-lr3e-3-e3/trees
t profile-new; CUDA_VISIBLE_DEVICES=0 timeout 300 python -m eval.step_profile $ENGINE --context 300 --batch_size 1 --steps 32 \
  --trees $T/tree_128.json --top 40 --output $R/profile_b1_after.json > $R/logs/profile_after.log 2>&1; tail -4 $R/logs/profile_after.log
t profile-old; (cd /root/tree_mm && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/root/ppd-site:/root/tree_mm timeout 300 python -m eval.step_profile $ENGINE \
  --context 300 --batch_size 1 --steps 32 --trees $T/tree_128.json --top 40 --output $R/profile_b1_before.json > $R/logs/profile_before.log 2>&1); tail -4 $R/logs/profile_before.log
t long; CUDA_VISIBLE_DEVICES=0 LONG_DATA=/root/ppd-stage/sharegpt_first3000.json DEADLINE=100000 PHASE_CAP=900 bash results/deep_gpu/run.sh longmatmul | tail -3
t end; echo "JOB DONE"
