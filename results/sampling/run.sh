#!/usr/bin/env bash
# Lossless sampling on one GPU (H100 or H200), after staging the packages (../shared/gpu/README.md):
#   bash results/sampling/run.sh check bench   # GPU tests of sampling under capture; the MT-Bench comparison
# The benchmark keeps its answers in /root/sampling while the machine stays warm and resumes there: call
# `bench` again until it prints the table. Each call copies what exists to $OUT/sampling.
set -uo pipefail
export PYTHONPATH=/root/ppd-site:$PWD HF_HUB_OFFLINE=1
R=/root/sampling
mkdir -p "$R/logs"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$R/logs/gpu.txt"
for phase in "$@"; do
  start=$(date +%s)
  case $phase in
    check)
      timeout 240 python -m pytest -q tests/test_lossless_sampling.py tests/test_engine.py tests/test_batcher.py \
        -k gpu > "$R/logs/gpu_tests.log" 2>&1; rc=$? ;;
    bench)
      timeout "${BENCH_TIMEOUT:-500}" python -m eval.sampling --bench mt_bench --limit 40 --temperatures 0.7 1.0 \
        --max_new_tokens 256 --output_dir "$R/mt_bench" -- --dtype bfloat16 --capture compiled_graph \
        --max_seq_len 2048 >> "$R/logs/bench.log" 2>&1; rc=$? ;;
    *) echo "unknown phase $phase"; rc=2 ;;
  esac
  echo "$phase: exit $rc in $(( $(date +%s) - start )) s" | tee -a "$R/logs/phases.txt"
done
mkdir -p "${OUT:-/tmp/out}" && cp -r "$R" "${OUT:-/tmp/out}/"
tail -n 25 "$R/logs/bench.log" 2>/dev/null | grep -v "it/s\|turn/s" | tail -n 15
