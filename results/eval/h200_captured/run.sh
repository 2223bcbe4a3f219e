#!/usr/bin/env bash
# The captured engine against every baseline on one machine with 4 GPUs: one chain of jobs per GPU, so no
# two timed runs share a GPU. Run from the repository root with the model and data packages installed:
#   WORK=/root/work bash results/eval/h200_captured/run.sh [SECONDS]
# Each gen_answers job appends to its own JSONL and resumes where it stopped, so running the script again
# after it was cut by SECONDS completes what is missing. Answers, logs and picks are left under $WORK.
set -u
budget=${1:-540}
W=${WORK:-/root/work}; A=$W/answers; L=$W/logs; mkdir -p "$A" "$L"
T=results/trees/h200/trees
TREES="$T/tree_16.json $T/tree_32.json $T/tree_64.json $T/tree_128.json $T/tree_256.json $T/tree_512.json"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
python3 -c "from ppd import load_model; load_model('smollm2-135m-instruct', device='cpu')" > "$L/convert.log" 2>&1

rm -f "$W/STOP"
ga() {  # GPU NAME gen_answers-flags...
  local gpu=$1 name=$2; shift 2
  [ -f "$W/STOP" ] && return
  CUDA_VISIBLE_DEVICES=$gpu python3 -m eval.gen_answers --bench mt_bench --max_new_tokens 256 \
    --output "$A/$name.jsonl" "$@" >> "$L/$name.log" 2>&1
}
pick() {  # DTYPE GPU: time every tree under both capture modes, keep the best (eval.pick_tree)
  [ -f "$W/pick_$1.json" ] || CUDA_VISIBLE_DEVICES=$2 python3 -m eval.pick_tree --trees $TREES \
    --captures graph compiled_graph --dtype "$1" --output "$W/pick_$1.json" > "$L/pick_$1.log" 2>&1 \
    || touch "$W/pick_$1.failed"
}
get() {  # DTYPE FIELD DEFAULT: a field of the pick (waits for it; the default if the pick failed)
  while [ ! -f "$W/pick_$1.json" ] && [ ! -f "$W/pick_$1.failed" ]; do sleep 5; done
  python3 -c "import json; print(json.load(open('$W/pick_$1.json'))['$2'])" 2>/dev/null || echo "$3"
}
ppd_args() {
  echo --method ppd --dtype "$1" --tree "$(get "$1" best_tree $T/tree_64.json)" --capture "$(get "$1" best_tree_capture graph)"
}
base_args() { echo --method baseline --dtype "$1" --capture "$(get "$1" baseline_capture graph)"; }

chain0() {
  pick float32 0
  ga 0 mt_bench-ppd-float32 $(ppd_args float32)
  ga 0 eager-mt_bench-ppd-float32 $(ppd_args float32 | sed 's/--capture [a-z_]*/--capture eager/') --limit 10
}
chain1() {
  pick bfloat16 1
  ga 1 mt_bench-ppd-bfloat16 $(ppd_args bfloat16)
  ga 1 mt_bench-baseline-bfloat16 $(base_args bfloat16)
}
chain2() {
  timeout 200 python3 -m pytest -q -p no:logging -p no:cacheprovider tests/test_engine.py -k gpu > "$L/gpu_tests.log" 2>&1
  ga 2 mt_bench-hf_static-float32 --method hf_static --dtype float32
  ga 2 mt_bench-baseline-float32 $(base_args float32)
  ga 2 eager-mt_bench-baseline-float32 --method baseline --dtype float32 --capture eager --limit 10
}
chain3() {
  ga 3 mt_bench-hf_static-bfloat16 --method hf_static --dtype bfloat16
  for dtype in float32 bfloat16; do
    for method in hf pld; do ga 3 "mt_bench-$method-$dtype" --method "$method" --dtype "$dtype" --limit 10; done
  done
}

chain0 & p0=$!; chain1 & p1=$!; chain2 & p2=$!; chain3 & p3=$!
( sleep "$budget"; touch "$W/STOP"; pkill -f eval.gen_answers; pkill -f eval.pick_tree; pkill -f pytest ) & stopper=$!
wait $p0 $p1 $p2 $p3
kill $stopper 2>/dev/null
echo "done after $SECONDS s"
