#!/usr/bin/env bash
# Lossless sampling on one GPU (H100 or H200), after staging the packages (../shared/gpu/README.md):
#   bash results/sampling/run.sh check bench   # GPU tests of sampling under capture; the MT-Bench comparison
# The benchmark keeps its answers in /root/sampling while the machine stays warm and resumes there: call
# `bench` again until it prints the table. Answers already in results/sampling/h100/answers (brought back
# from an earlier machine) are resumed from. Each call copies the answers, summary and logs to $OUT.
set -uo pipefail
export PYTHONPATH=/root/ppd-site:$PWD HF_HUB_OFFLINE=1
R=/root/sampling
mkdir -p "$R/logs" "$R/mt_bench/answers"
for f in results/sampling/h100/answers/*.jsonl; do
  [ -e "$R/mt_bench/answers/$(basename "$f")" ] || cp "$f" "$R/mt_bench/answers/"
done
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$R/logs/gpu.txt"
for phase in "$@"; do
  start=$(date +%s)
  case $phase in
    check)
      timeout "${CHECK_TIMEOUT:-240}" python -m pytest -q tests/test_lossless_sampling.py tests/test_engine.py \
        tests/test_batcher.py -k gpu -rA > "$R/logs/gpu_tests.log" 2>&1; rc=$? ;;
    bench)
      timeout "${BENCH_TIMEOUT:-500}" python -m eval.sampling --bench mt_bench --limit 40 --temperatures 0.7 1.0 \
        --max_new_tokens 256 --output_dir "$R/mt_bench" -- --dtype bfloat16 --capture compiled_graph \
        --max_seq_len 2048 >> "$R/logs/bench.log" 2>&1; rc=$? ;;
    *) echo "unknown phase $phase"; rc=2 ;;
  esac
  echo "$phase: exit $rc in $(( $(date +%s) - start )) s" | tee -a "$R/logs/phases.txt"
done
O=${OUT:-/tmp/out}
mkdir -p "$O/answers" "$O/logs"
cp "$R"/mt_bench/answers/*.jsonl "$O/answers/" 2>/dev/null
cp "$R"/mt_bench/summary.* "$R"/mt_bench/*.png "$O/" 2>/dev/null
cp "$R"/logs/* "$O/logs/"
tail -n 25 "$R/logs/bench.log" 2>/dev/null | grep -v "it/s\|turn/s" | tail -n 15
