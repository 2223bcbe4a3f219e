#!/usr/bin/env bash
# Second lease of a machine with 4 GPUs: completes the MT-Bench grid of the first (the fp32 baseline's last
# 54 answers; hf and pld on all 80 questions), runs HumanEval, GSM8K and Alpaca Eval against hf_static, and
# times the step per tree size and capture mode. Run from the repository root with the model and data
# packages installed, once per call, with the seconds that call may use:
#   WORK=/root/work bash results/eval/h200_captured/run2.sh SECONDS
# Every step is resumable (run_suite shards append and skip what is complete; a measurement whose JSON
# exists is skipped), so the same command in the next call goes on where the last one stopped.
# $WORK/suite starts as the first lease's MT-Bench answers, split into run_suite's shard files.
set -u
budget=${1:?seconds}
W=${WORK:-/root/work}; S=$W/suite; L=$W/logs; mkdir -p "$S" "$L"
T=results/trees/h200/trees
SIZES="$T/tree_16.json $T/tree_32.json $T/tree_64.json $T/tree_128.json $T/tree_256.json $T/tree_512.json"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
python3 -c "from ppd import load_model; load_model('smollm2-135m-instruct', device='cpu')" > "$L/convert.log" 2>&1
left() { echo $((budget - SECONDS)); }
suite() {  # DEVICES run_suite-flags...: one grid, stopped at the call's end
  local devices=$1; shift
  (( $(left) > 30 )) || return 0
  python3 -m eval.run_suite --devices $devices --max_new_tokens 256 --output_dir "$S" --deadline_s "$(left)" "$@" \
    >> "$L/suite.log" 2>&1
}
once() {  # GPU NAME SECONDS command...: a measurement, skipped once its JSON exists
  local gpu=$1 name=$2 limit=$3; shift 3
  [ -f "$W/$name.json" ] && return 0
  (( limit > 30 )) || return 0
  CUDA_VISIBLE_DEVICES=$gpu timeout "$limit" "$@" --output "$W/$name.json" > "$L/$name.log" 2>&1
}

# first, one job per GPU: the GPU tests, the step per tree size (both dtypes, and reduce-overhead in bf16),
# the fp32 baseline's missing answers
[ -f "$L/gpu_tests.done" ] || (CUDA_VISIBLE_DEVICES=0 timeout 180 python3 -m pytest -q -p no:cacheprovider \
  tests/test_engine.py -k gpu > "$L/gpu_tests.log" 2>&1; touch "$L/gpu_tests.done") &
once 1 step_sizes_bfloat16 300 python3 -m eval.capture_modes --modes compiled_graph reduce_overhead \
  --trees $SIZES --baseline --dtype bfloat16 --budget_s 270 &
once 2 step_sizes_float32 300 python3 -m eval.capture_modes --modes compiled_graph \
  --trees $SIZES --baseline --dtype float32 --budget_s 270 &
suite 3 --benches mt_bench --methods baseline --dtypes float32 --shard_size 200
wait
# then the grids, most wanted first
suite "0 1 2 3" --benches humaneval gsm8k alpaca_eval --methods hf_static baseline ppd --dtypes bfloat16 \
  --limit gsm8k=100 alpaca_eval=100 --shard_size 200
suite "0 1 2 3" --benches mt_bench --methods hf pld --dtypes bfloat16 float32 --shard_size 10
suite "0 1 2 3" --benches humaneval gsm8k alpaca_eval --methods hf_static baseline ppd --dtypes float32 \
  --limit gsm8k=100 alpaca_eval=100 --shard_size 200
echo "call done after $SECONDS s"
grep -h "done in\|FAILED\|deadline" "$L/suite.log" | tail -n 40
