#!/usr/bin/env bash
# The deep prompt tokens (shipped since results/train/v4) on a GPU, in phases, one or more per device call:
#   bash results/deep_gpu/run.sh check profile pick     # GPU tests (compiled per test: ~9 min); kernels per step; policy
#   bash results/deep_gpu/run.sh speed long              # decoder throughput by batch; 8K context
# Run after staging the packages (../shared/gpu/README.md). Inductor's cache lives in /root/inductor, so a
# later call on the same warm machine reuses what an earlier one compiled. Writes under $OUT/deep_gpu.
set -uo pipefail
export PYTHONPATH=/root/ppd-site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/root/inductor
R=${OUT:-/tmp/out}/deep_gpu
mkdir -p "$R/logs"
ADAPTER=ppd/adapters/smollm2-135m-instruct
T=results/train/v4/runs/deep-e2/trees
TREES="$T/tree_8.json $T/tree_16.json $T/tree_32.json $T/tree_64.json $T/tree_128.json"
BATCHES="1 2 4 8 16 32 64 128"
ENGINE="--dtype bfloat16 --capture compiled_graph"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$R/logs/gpu.txt"
for phase in "$@"; do
  start=$(date +%s)
  case $phase in
    check)
      timeout 540 python -m pytest -q tests/test_deep_prompts.py tests/test_engine.py tests/test_batcher.py \
        tests/test_tree_attention.py tests/test_lossless_sampling.py -k "gpu or captured or every_step_mode" \
        > "$R/logs/gpu_tests.log" 2>&1; rc=$? ;;
    profile)
      for b in 1 16; do
        timeout 200 python -m eval.step_profile $ENGINE --context 300 --batch_size $b --steps 32 \
          --trees $T/tree_16.json $T/tree_64.json --top 30 --output "$R/profile_b$b.json" > "$R/logs/profile_b$b.log" 2>&1
        rc=$?
      done ;;
    pick)
      timeout 480 python -m eval.pick_tree $ENGINE --batch_sizes $BATCHES --steps 16 --trees $TREES --install \
        --output "$R/policy_pick_bfloat16.json" > "$R/logs/pick.log" 2>&1; rc=$?
      cp "$ADAPTER/policy_cuda_bfloat16.json" "$R/" ;;
    speed)
      timeout 540 python -m eval.batch_speed $ENGINE --batch_sizes $BATCHES --bench mt_bench --max_new_tokens 256 \
        --max_seq_len 1024 --trees "$ADAPTER/tree_cuda.json" --output "$R/batch_speed_bfloat16.json" \
        --plot "$R/batch_speed_bfloat16.png" > "$R/logs/speed.log" 2>&1; rc=$? ;;
    long)
      timeout 540 python -m eval.long_context --attention flex --contexts 1024 8192 --batch_sizes 1 16 \
        --methods ppd baseline hf_static --max_new_tokens 128 --dtype bfloat16 --max_seq_len 8448 \
        --tree $T/tree_16.json --output "$R/long_context_tree16.json" --plot "$R/long_context_tree16.png" \
        > "$R/logs/long.log" 2>&1; rc=$? ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
  echo "$phase: exit $rc in $(( $(date +%s) - start )) s" | tee -a "$R/logs/timings.txt"
done
tail -n 25 "$R"/logs/*.log
