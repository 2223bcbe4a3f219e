#!/usr/bin/env bash
# The serving measurements on one GPU (H100 or H200), in phases, each call of the device tool one or more:
#   bash results/serving/run.sh check pick      # GPU tests of the continuous batch; the bf16 batch policy
#   bash results/serving/run.sh speed load      # decoder throughput by batch size; the HTTP server under load
# Run after staging the packages (../shared/gpu/README.md); writes under $OUT/serving. `pick` installs the
# policy into the packaged adapter and copies it to $OUT/serving; put it into the adapter before `speed`.
set -uo pipefail
# FastAPI and uvicorn (for `load`) are not in the GPU image: their wheels go to /root/ppd-web.
export PYTHONPATH=/root/ppd-web:/root/ppd-site:$PWD HF_HUB_OFFLINE=1
R=${OUT:-/tmp/out}/serving
mkdir -p "$R/logs"
ADAPTER=ppd/adapters/smollm2-135m-instruct
TREES="results/trees/cpu/trees/tree_8.json
       results/trees/h200/trees/tree_16.json results/trees/h200/trees/tree_32.json
       results/trees/h200/trees/tree_64.json"
BATCHES="1 2 4 8 16 32 64 128"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$R/logs/gpu.txt"
for phase in "$@"; do
  start=$(date +%s)
  case $phase in
    check)
      timeout 200 python -m pytest -q tests/test_batcher.py tests/test_engine.py -k gpu > "$R/logs/gpu_tests.log" 2>&1; rc=$? ;;
    pick)
      TORCH_LOGS=recompiles timeout 480 python -m eval.pick_tree --dtype bfloat16 --capture compiled_graph --batch_sizes $BATCHES \
        --steps 16 --trees $TREES --install --output "$R/policy_pick_bfloat16.json" > "$R/logs/pick.log" 2>&1; rc=$?
      cp "$ADAPTER/policy_cuda_bfloat16.json" "$R/" ;;
    speed)
      timeout 540 python -m eval.batch_speed --dtype bfloat16 --capture compiled_graph --batch_sizes $BATCHES \
        --bench mt_bench --max_new_tokens 256 --max_seq_len 1024 --trees "$ADAPTER/tree_cuda.json" \
        --output "$R/batch_speed_bfloat16.json" --plot "$R/batch_speed_bfloat16.png" > "$R/logs/speed.log" 2>&1; rc=$? ;;
    load)
      timeout 520 python -m eval.load --launch --model smollm2-135m-instruct \
        --server_args="--dtype bfloat16 --capture compiled_graph --max_batch 64 --max_seq_len 1024" \
        --clients 1 4 16 64 --methods ppd baseline --bench mt_bench --max_tokens 256 \
        --output "$R/load_bfloat16.json" --plot "$R/load_bfloat16.png" > "$R/logs/load.log" 2>&1; rc=$? ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
  echo "$phase: exit $rc in $(( $(date +%s) - start )) s" | tee -a "$R/logs/timings.txt"
done
tail -n 30 "$R"/logs/*.log
