#!/usr/bin/env bash
# Prompt tokens v3 for the default model: self-distilled data, packed cuts, a search over N/V/lr/epochs/data,
# trees from measured path acceptance. Run from the repository root on a machine with 4 GPUs, with the model and
# data packages installed, one phase per call (each phase resumes what an earlier call left unfinished):
#   WORK=/root/work bash results/train/v3/run.sh PHASE
# Phases: data (GPU 0: the timed one-GPU pipeline's data; GPUs 1-3: the data the search compares),
#         train (GPU 0: the timed training; GPUs 1-3: the search, several runs per GPU),
#         scale (one GPU against two with accelerate; packed against single-cut examples/s).
set -u
phase=${1:?phase}
W=${WORK:-/root/work}; L=$W/logs; mkdir -p "$L"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
SAMPLES=${SAMPLES:-4000}; MAXNEW=${MAXNEW:-256}
N=5              # the datasets carry targets for 5 prompt tokens; runs with fewer use the first ones
CUTS=32          # cuts per conversation (all inside its last reply)
SD="--max_turns 2 --max_new_tokens $MAXNEW --batch_size 128 --decode_method baseline --dtype bfloat16"
BUDGETS="8 16 32 64 128 256 512"
TEACHER="--teacher forced --dtype bfloat16 --batch_tokens 131072 --max_batch_size 256 --shard_size 2048"
TRAIN="--trainer_type distillation --lr_scheduler_type cosine --per_device_train_batch_size 8 --logging_steps 50
  --save_steps 500 --eval_size 0.03 --per_device_eval_batch_size 16 --dataloader_num_workers 2 ${EXTRA_TRAIN:-}"
timed() {  # NAME command...: run, append "NAME seconds" to the timing file
  local name=$1; shift
  local start=$SECONDS
  "$@" > "$L/$name.log" 2>&1
  local rc=$?
  echo "$name $((SECONDS - start)) rc=$rc" >> "$W/timings.txt"
}
data_from() {  # GPU CONVERSATIONS NAME: cuts and forced-teacher targets from a conversations source
  local gpu=$1 src=$2 name=$3
  local from=(--data_path "$src"); [ "$src" = sharegpt ] && from=(--max_samples $SAMPLES)  # the embedded file
  [ -d "$W/$name-cuts" ] || CUDA_VISIBLE_DEVICES=$gpu timed "$name-cuts" python3 -m data_gen.generate \
    --dataset_type finetune "${from[@]}" --output_path "$W/$name-cuts" --num_prompt_tokens $N \
    --cuts_per_conversation $CUTS --shard_size 2048
  [ -d "$W/$name-targets" ] || CUDA_VISIBLE_DEVICES=$gpu timed "$name-targets" python3 -m data_gen.generate \
    --dataset_type distillation --data_path "$W/$name-cuts" --output_path "$W/$name-targets" --num_prompt_tokens $N \
    $TEACHER
}
train_run() {  # GPU NAME "DATA..." flags...: one training run, then its held-out accept length by replay
  local gpu=$1 name=$2 data=$3; shift 3
  local paths=() d; for d in $data; do paths+=("$W/$d-targets"); done
  [ -f "$W/runs/$name/training_log.json" ] || CUDA_VISIBLE_DEVICES=$gpu timed "train-$name" python3 -m train.train \
    --dataset_path "${paths[@]}" --output_dir "$W/runs/$name" $TRAIN "$@" --resume_from_checkpoint latest
  heldout "$gpu" "$name"
}
heldout() {  # GPU NAME: path statistics on the held-out conversations, trees from them, their accept length
  local gpu=$1 r=$W/runs/$2 v
  [ -f "$r/training_log.json" ] || return 0
  [ -f "$r/heldout.json" ] && return 0
  v=$(python3 -c "import json; print(json.load(open('$r/ppd_config.json'))['num_ensemble'])")
  CUDA_VISIBLE_DEVICES=$gpu python3 -m eval.replay --conversations "$W/sd" --eval_size 0.03 --seed 42 --adapter "$r" \
    --dtype float32 --top_k 10 --paths_output "$r/paths.json" --output "$r/paths_pass.json" > "$L/paths-$2.log" 2>&1 &&
  python3 -m eval.build_trees --paths "$r/paths.json" --num_ensemble "$v" --budgets $BUDGETS \
    --output_dir "$r/trees" > "$L/trees-$2.log" 2>&1 &&
  CUDA_VISIBLE_DEVICES=$gpu python3 -m eval.replay --conversations "$W/sd" --eval_size 0.03 --seed 42 --adapter "$r" \
    --dtype float32 --trees $(for b in $BUDGETS; do echo "$r/trees/tree_$b.json"; done) \
    --output "$r/heldout.json" > "$L/heldout-$2.log" 2>&1
}

case $phase in
data)
  # GPU 0, timed: 8,000 ShareGPT conversations answered greedily by the model (2 turns), cuts, targets.
  ( [ -d "$W/sd" ] || CUDA_VISIBLE_DEVICES=0 timed sd-conversations python3 -m data_gen.generate \
      --dataset_type conversations --output_path "$W/sd" --max_samples $SAMPLES $SD
    data_from 0 "$W/sd" sd ) &
  # GPU 1: ShareGPT's own replies (the first 8,000 conversations), same cuts and teacher
  data_from 1 sharegpt sharegpt &
  # GPU 2: sampled self-distillation (T = 0.7) of the next 8,000 conversations... (max_samples counts from 0:
  # a separate source slice is not offered, so sample the same prompts)
  ( [ -d "$W/sd_t07" ] || CUDA_VISIBLE_DEVICES=2 timed sd_t07-conversations python3 -m data_gen.generate \
      --dataset_type conversations --output_path "$W/sd_t07" --max_samples $SAMPLES $SD --temperature 0.7 --seed 7
    data_from 2 "$W/sd_t07" sd_t07 ) &
  wait ;;
search)
  # training speed first, on idle GPUs: two GPUs against one (same global batch), packed against single cuts
  SPEED="--dataset_path $W/sd-targets --max_steps ${SPEED_STEPS:-60}"
  CUDA_VISIBLE_DEVICES=0,1 timed speed-2gpu python3 -m eval.train_speed $SPEED --cuts_per_forward 0 \
    --launcher "accelerate launch --num_processes 2 --multi_gpu" --output "$W/speed_2gpu.json" -- \
    --per_device_train_batch_size 4 &
  CUDA_VISIBLE_DEVICES=2 timed speed-1gpu python3 -m eval.train_speed $SPEED --cuts_per_forward 0 \
    --output "$W/speed_1gpu.json" -- --per_device_train_batch_size 8 &
  CUDA_VISIBLE_DEVICES=3 timed speed-packed python3 -m eval.train_speed $SPEED --cuts_per_forward 1 0 \
    --output "$W/speed_packed.json" -- --per_device_train_batch_size 8 &
  wait
  # the search: one epoch each, several runs sharing a GPU; GPU 0: the reference (2 epochs), alone
  E1="--num_train_epochs 1 --learning_rate 1e-2"
  train_run 0 sd-n3-e2 sd --num_train_epochs 2 --learning_rate 1e-2 &
  ( train_run 1 sd-n3 sd $E1 & train_run 1 sharegpt-n3 sharegpt $E1 &
    train_run 1 mix-n3 "sd sharegpt" $E1 & train_run 1 sdt07-n3 sd_t07 $E1 & wait ) &
  ( train_run 2 sd-n4 sd $E1 --num_prompt_tokens 4 & train_run 2 sd-n5 sd $E1 --num_prompt_tokens 5 &
    train_run 2 sd-v2 sd $E1 --num_ensemble 2 & train_run 2 sd-v3 sd $E1 --num_ensemble 3 & wait ) &
  ( train_run 3 sd-lr3e-2 sd --num_train_epochs 1 --learning_rate 3e-2 &
    train_run 3 sd-lr3e-3 sd --num_train_epochs 1 --learning_rate 3e-3 &
    train_run 3 sd-quarter sd $E1 --max_train_samples 30000 & train_run 3 sd-sdt07 "sd sd_t07" $E1 & wait ) &
  wait
  # every run: MT-Bench accept length by replay of the fp32 baseline's answers, trees from its held-out paths
  gpu=0
  for r in "$W"/runs/*/; do
    name=$(basename "$r")
    [ -f "$r/heldout.json" ] && [ ! -f "$r/mt_bench.json" ] && CUDA_VISIBLE_DEVICES=$gpu python3 -m eval.replay \
      --answers results/eval/h200_captured/answers/mt_bench-baseline-float32-0000.jsonl --adapter "$r" \
      --dtype float32 --trees $(for b in $BUDGETS; do echo "$r/trees/tree_$b.json"; done) \
      --output "$r/mt_bench.json" > "$L/mt_bench-$name.log" 2>&1 &
    gpu=$(( (gpu + 1) % 4 ))
    (( gpu == 0 )) && wait
  done
  wait ;;
esac
for f in "$W"/runs/*/heldout.json; do
  [ -f "$f" ] && python3 -c "
import json, sys; d = json.load(open('$f')); print('$f'.split('/')[-2], [(r.get('rows'), round(r['accept_length'], 3)) for r in d['trees']])" 2>/dev/null
done
cat "$W/timings.txt"
