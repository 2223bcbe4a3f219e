#!/usr/bin/env bash
# Sixteenth session, first 2 x H200 lease (given back idle at 11:09, during long8k: its training pair never ran).
# Both GPUs: issue 13's training data, while each GPU compiles one variant of the batch-1 step (below).
# GPU 0, issue 14 at batch 1: the deep tokens' maps as low-rank products (as shipped) against the maps merged
#   (PPD_DEEP_MAPS=merged), twice each, alternating; both steps' kernels.
# GPU 1: GPU tests of the merged maps, then issue 18 at 8K with the matmul layout.
# Both GPUs, issue 13: the compiled training pair (1 GPU x 8, 2 x 4) with the deep tables unbound once a forward.
set -u
cd /root/tree
export PYTHONPATH=/root/ppd-site:/root/tree HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OUT=/root/res TORCHINDUCTOR_CACHE_DIR=/root/inductor
export PPD_COMPILE_CACHE=/root/keep/compiled
t() { echo "== $(date +%T) $*"; }
R=/root/res/deep_gpu; mkdir -p $R/logs $PPD_COMPILE_CACHE
gunzip -kf /root/ppd-stage/sharegpt_first3000.json.gz
ENGINE="--dtype bfloat16 --capture compiled_graph"
T=results/train/v7/runs/maps16-lr3e-3-e3/trees
BS="--batch_sizes 1 --bench mt_bench --max_new_tokens 256 --max_seq_len 1024"
warm() {  # while the training data are made (both GPUs, mostly not busy): compile both variants, one on each GPU
  CUDA_VISIBLE_DEVICES=$1 PPD_DEEP_MAPS=$2 timeout 400 python -m eval.batch_speed $ENGINE $BS --prompts 1 --max_new_tokens 8 \
    --output /tmp/warm_$2.json > $R/logs/warm_$2.log 2>&1; echo "warm $2 rc $? at $(date +%T)"
}
decode() {
  for run in low_rank:1 merged:1 low_rank:2 merged:2; do
    IFS=: read -r maps n <<< "$run"
    t b1-$maps-$n; CUDA_VISIBLE_DEVICES=0 PPD_DEEP_MAPS=$maps timeout 300 python -m eval.batch_speed $ENGINE $BS \
      --output $R/batch_speed_b1_${maps}_$n.json > $R/logs/b1_${maps}_$n.log 2>&1
    echo "rc $?"; grep -i "^batch\|ms a pass" $R/logs/b1_${maps}_$n.log | tail -4
  done
  for maps in low_rank merged; do
    t profile-$maps; CUDA_VISIBLE_DEVICES=0 PPD_DEEP_MAPS=$maps timeout 300 python -m eval.step_profile $ENGINE --context 300 \
      --batch_size 1 --steps 32 --trees $T/tree_128.json --top 90 --output $R/profile_b1_$maps.json > $R/logs/profile_$maps.log 2>&1
    tail -3 $R/logs/profile_$maps.log
  done
  t decode-done
}
side() {
  t gpu-tests; CUDA_VISIBLE_DEVICES=1 timeout 300 python -m pytest -q tests/test_deep_prompts.py -k "merged or every_step_mode" \
    > $R/logs/gpu_tests.log 2>&1; tail -1 $R/logs/gpu_tests.log
  t long8k; CUDA_VISIBLE_DEVICES=1 PPD_GROUPED_SDPA=matmul timeout 480 python -m eval.long_context $ENGINE --attention dense \
    --contexts 8192 --data_path /root/ppd-stage/sharegpt_first3000.json --batch_sizes 1 16 --methods baseline \
    --trees $T/tree_16.json $T/tree_64.json --max_new_tokens 128 --max_seq_len 8448 --output $R/long_context_matmul_8k.json \
    --plot $R/long_context_matmul_8k.png > $R/logs/long8k.log 2>&1; echo "rc $?"; grep -v Warn $R/logs/long8k.log | tail -8
  t side-done
}
t data-and-warm; warm 0 low_rank > /root/res/warm0.log 2>&1 & warm 1 merged > /root/res/warm1.log 2>&1 &
SOURCE=/root/ppd-stage/sharegpt_first3000.json SAMPLES=3000 bash results/train/scaling/run.sh data | tail -1
t data-done; wait; cat /root/res/warm0.log /root/res/warm1.log; du -sh $PPD_COMPILE_CACHE
decode > /root/res/decode.log 2>&1 &
side > /root/res/side.log 2>&1 &
wait; cat /root/res/decode.log /root/res/side.log
export EPOCHS=3 EVAL_SIZE=0.03
t train; EXTRA="--capture_step --group_by_width --torch_compile" TAG=-captured-grouped-compiled-unbound RUNS="1:8::3e-3 2:4::3e-3" \
  bash results/train/scaling/run.sh quality | tail -8
t end; du -sh $PPD_COMPILE_CACHE; ls $PPD_COMPILE_CACHE | head; echo "JOB DONE"
