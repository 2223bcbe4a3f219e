#!/usr/bin/env bash
# Prompt tokens v4: deep prompt tokens (an offset per decoder layer at each prompt row, ppd/deep_prompts.py)
# against plain ones, trained on the same self-distilled data as v3 and compared by held-out replay.
# One GPU, one phase per call (each resumes what an earlier call left):
#   WORK=/root/work bash results/train/v4/run.sh data|train|maps|replay
# `maps` (results/train/v6) trains deep prompt tokens with low-rank maps beside deep-e2 on the same data;
# `maps_e3` (results/train/v7) one run of rank-16 maps for 3 epochs at the map learning rate MAP_LR, alone.
set -u
phase=${1:?phase}
W=${WORK:-/root/work}; L=$W/logs; mkdir -p "$L"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
SAMPLES=${SAMPLES:-3000}; N=5; CUTS=32
BUDGETS="8 16 32 64 128 256 512"
TRAIN="--trainer_type distillation --lr_scheduler_type cosine --per_device_train_batch_size 8 --logging_steps 50
  --save_steps 100 --eval_size 0.03 --per_device_eval_batch_size 16 --dataloader_num_workers 2 --num_prompt_tokens 3"
timed() {  # NAME command...: run, append "NAME seconds" to the timing file
  local name=$1; shift
  local start=$SECONDS
  "$@" > "$L/$name.log" 2>&1
  echo "$name $((SECONDS - start)) rc=$?" >> "$W/timings.txt"
}
train_run() {  # NAME flags...
  local name=$1; shift
  [ -f "$W/runs/$name/training_log.json" ] || timed "train-$name" python3 -m train.train --dataset_path "$W/sd-targets" \
    --output_dir "$W/runs/$name" $TRAIN "$@" --resume_from_checkpoint latest
}
heldout() {  # NAME: path statistics on the held-out conversations, trees from them, their accept length
  local r=$W/runs/$1
  [ -f "$r/training_log.json" ] && [ ! -f "$r/heldout.json" ] || return 0
  timed "paths-$1" python3 -m eval.replay --conversations "$W/sd" --eval_size 0.03 --seed 42 --adapter "$r" \
    --dtype float32 --top_k 10 --paths_output "$r/paths.json" --output "$r/paths_pass.json" &&
  python3 -m eval.build_trees --paths "$r/paths.json" --num_ensemble 1 --budgets $BUDGETS \
    --output_dir "$r/trees" > "$L/trees-$1.log" 2>&1 &&
  timed "heldout-$1" python3 -m eval.replay --conversations "$W/sd" --eval_size 0.03 --seed 42 --adapter "$r" \
    --dtype float32 --trees $(for b in $BUDGETS; do echo "$r/trees/tree_$b.json"; done) --output "$r/heldout.json"
}
mt_bench() {  # NAME: MT-Bench accept length, replaying the fp32 baseline's answers (80 questions, both turns)
  local r=$W/runs/$1
  [ -f "$r/heldout.json" ] && [ ! -f "$r/mt_bench.json" ] || return 0
  timed "mt_bench-$1" python3 -m eval.replay \
    --answers results/eval/h200_captured/answers/mt_bench-baseline-float32-0000.jsonl --adapter "$r" \
    --dtype float32 --trees $(for b in $BUDGETS; do echo "$r/trees/tree_$b.json"; done) --output "$r/mt_bench.json"
}

case $phase in
data)  # v3's data: the model answers ShareGPT prompts greedily (2 turns), 32 cuts per reply, forced-teacher targets
  [ -d "$W/sd" ] || timed sd-conversations python3 -m data_gen.generate --dataset_type conversations \
    --output_path "$W/sd" --max_samples $SAMPLES --max_turns 2 --max_new_tokens 256 --batch_size 256 \
    --decode_method baseline --dtype bfloat16
  [ -d "$W/sd-cuts" ] || timed sd-cuts python3 -m data_gen.generate --dataset_type finetune --data_path "$W/sd" \
    --output_path "$W/sd-cuts" --num_prompt_tokens $N --cuts_per_conversation $CUTS --shard_size 2048
  [ -d "$W/sd-targets" ] || timed sd-targets python3 -m data_gen.generate --dataset_type distillation \
    --data_path "$W/sd-cuts" --output_path "$W/sd-targets" --num_prompt_tokens $N --teacher forced \
    --dtype bfloat16 --batch_tokens 131072 --max_batch_size 256 --shard_size 2048 ;;
train)  # the same two epochs, plain and deep, sharing the GPU
  train_run plain-e2 --num_train_epochs 2 --learning_rate 1e-2 &
  train_run deep-e2 --num_train_epochs 2 --learning_rate 1e-2 --deep &
  wait ;;
maps)  # deep-e2 again, and with a rank-16 map per prompt token and layer at two map learning rates
  train_run deep-e2 --num_train_epochs 2 --learning_rate 1e-2 --deep &
  for lr in 1e-3 3e-3; do
    train_run maps16-lr$lr --num_train_epochs 2 --learning_rate 1e-2 --deep --map_rank 16 --map_learning_rate $lr &
  done
  wait ;;
maps_e3)  # rank-16 maps, 3 epochs, map lr $MAP_LR (default 3e-3); run alone, its time is the training cost
  lr=${MAP_LR:-3e-3}
  train_run maps16-lr$lr-e3 --num_train_epochs 3 --learning_rate 1e-2 --deep --map_rank 16 --map_learning_rate $lr ;;
replay)  # every run trained so far
  runs=$(ls "$W/runs" 2>/dev/null)
  for r in $runs; do heldout $r & done; wait
  for r in $runs; do mt_bench $r & done; wait ;;
esac
for f in "$W"/runs/*/heldout.json "$W"/runs/*/mt_bench.json; do
  [ -f "$f" ] && python3 -c "
import json; d = json.load(open('$f')); print('$f'.split('/')[-2], '$f'.split('/')[-1], [(t.get('rows'), round(t['accept_length'], 3)) for t in d['trees']])"
done
cat "$W/timings.txt"
if [ -n "${OUT:-}" ]; then  # the small results back to the caller: adapters, paths, trees, replays, logs
  mkdir -p "$OUT/v4"; cp "$W/timings.txt" "$OUT/v4/" 2>/dev/null; cp -r "$L" "$OUT/v4/" 2>/dev/null
  for r in "$W"/runs/*/; do
    [ -d "$r" ] || continue; d=$OUT/v4/runs/$(basename "$r"); mkdir -p "$d"
    cp "$r"/*.json "$r"/*.safetensors "$d"/ 2>/dev/null; [ -d "$r/trees" ] && cp -r "$r/trees" "$d/"
  done
fi
