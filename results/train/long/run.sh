#!/usr/bin/env bash
# Prompt tokens for long contexts (one or two GPUs: GPU_A and GPU_B, 0 and 1 by default): the model's own replies to long prompts of real ShareGPT text
# (data_gen.long_prompts, 1,024-7,936 tokens, conversations 3,000 on), trained alone and mixed with the shipped
# recipe's short data, against the shipped tokens: accept length by exact replay on the long replies held out
# (trees of every token set's own held-out paths, and the shipped trees), on MT-Bench, and decoding at 8K.
#   LONG_PROMPTS=<data_gen.long_prompts file> SOURCE=<first 3,000 ShareGPT records> \
#     bash results/train/long/run.sh data runs speed
# Each phase skips what an earlier call left; logs and small results go to $OUT/long.
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:-$PWD} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
W=${WORK:-/root/work-long}; S=${SHORT_WORK:-/root/work-scaling}; R=${OUT:-/tmp/out}/long
mkdir -p "$W/runs" "$R/logs"
N=5; CUTS=32; BUDGETS="16 64 128"
A=${GPU_A:-0}; B=${GPU_B:-1}  # the same GPU twice: the phases' two halves share it (timed decoding runs one by one)
SHIPPED=ppd/adapters/smollm2-135m-instruct; T=results/train/v7/runs/maps16-lr3e-3-e3/trees
TRAIN="--trainer_type distillation --lr_scheduler_type cosine --num_prompt_tokens 3 --deep --map_rank 16
  --learning_rate 1e-2 --map_learning_rate 3e-3 --per_device_train_batch_size 8 --num_train_epochs 3
  --eval_size 0.03 --per_device_eval_batch_size 16 --group_by_width --save_strategy no --dataloader_num_workers 2"
timed() {  # NAME command...: run it, logging to $R/logs/NAME.log, and append "NAME seconds rc" to timings.txt
  local name=$1; shift
  local start=$SECONDS
  "$@" > "$R/logs/$name.log" 2>&1
  local rc=$?
  echo "$name $((SECONDS - start)) s rc=$rc" | tee -a "$R/timings.txt"
  return $rc
}
long_data() {  # on GPU B: the long prompts answered (greedy, 256 tokens), cut (32 a reply) and distilled
  [ -d "$W/sd" ] || CUDA_VISIBLE_DEVICES=$B timed long-sd python -m data_gen.generate --dataset_type conversations \
    --data_path "${LONG_PROMPTS:?}" --output_path "$W/sd" --max_turns 1 --max_new_tokens 256 --model_max_length 8192 \
    --batch_size 64 --decode_method baseline --capture eager --dtype bfloat16 ${LONG_SAMPLES:+--max_samples $LONG_SAMPLES}
  [ -d "$W/cuts" ] || timed long-cuts python -m data_gen.generate --dataset_type finetune --data_path "$W/sd" \
    --output_path "$W/cuts" --num_prompt_tokens $N --cuts_per_conversation $CUTS --model_max_length 8192 --shard_size 2048
  [ -d "$W/targets" ] || CUDA_VISIBLE_DEVICES=$B timed long-targets python -m data_gen.generate --dataset_type distillation \
    --data_path "$W/cuts" --output_path "$W/targets" --num_prompt_tokens $N --teacher forced --dtype bfloat16 \
    --batch_tokens 131072 --max_batch_size 256 --shard_size 2048
}
train_run() {  # GPU NAME DATASETS...: one training run on one GPU
  local gpu=$1 name=$2; shift 2
  [ -f "$W/runs/$name/training_log.json" ] || CUDA_VISIBLE_DEVICES=$gpu timed "train-$name" python -m train.train \
    --dataset_path "$@" --output_dir "$W/runs/$name" $TRAIN
  cp "$W/runs/$name/training_log.json" "$R/training_log_$name.json" 2>/dev/null
}
replay() {  # GPU NAME ADAPTER: held-out long replies (shipped trees; paths -> own trees; own trees), and MT-Bench
  local gpu=$1 name=$2 adapter=$3 out=$R/$2
  mkdir -p "$out"
  local args=(--adapter "$adapter" --dtype float32 --top_k 10)
  [ -f "$out/long_shipped_trees.json" ] || CUDA_VISIBLE_DEVICES=$gpu timed "replay-long-$name" python -m eval.replay \
    --conversations "$W/sd" --eval_size 0.03 --seed 42 "${args[@]}" --trees $(for b in $BUDGETS; do echo $T/tree_$b.json; done) \
    --paths_output "$out/paths_long.json" --output "$out/long_shipped_trees.json"
  [ -d "$out/trees" ] || python -m eval.build_trees --paths "$out/paths_long.json" --num_ensemble 1 --budgets $BUDGETS \
    --output_dir "$out/trees" > "$R/logs/trees-$name.log" 2>&1
  [ -f "$out/long_own_trees.json" ] || CUDA_VISIBLE_DEVICES=$gpu timed "replay-long-own-$name" python -m eval.replay \
    --conversations "$W/sd" --eval_size 0.03 --seed 42 "${args[@]}" \
    --trees $(for b in $BUDGETS; do echo "$out/trees/tree_$b.json"; done) --output "$out/long_own_trees.json"
  [ -f "$out/mt_bench.json" ] || CUDA_VISIBLE_DEVICES=$gpu timed "replay-mt_bench-$name" python -m eval.replay \
    --answers results/eval/h200_captured/answers/mt_bench-baseline-float32-0000.jsonl "${args[@]}" \
    --trees $(for b in $BUDGETS; do echo $T/tree_$b.json; done) --output "$out/mt_bench.json"
}
speed() {  # GPU NAME ADAPTER TREE BATCH: 8K decoding, ppd with TREE against the baseline (eval.long_context)
  local gpu=$1 name=$2 adapter=$3 tree=$4 batch=$5
  local file=$R/$name/long_context_8k_b$batch.json
  [ -f "$file" ] || CUDA_VISIBLE_DEVICES=$gpu PPD_GROUPED_SDPA=split timed "speed-$name-b$batch" python -m eval.long_context \
    --dtype bfloat16 --capture compiled_graph --attention dense --contexts 8192 --batch_sizes "$batch" \
    --methods ppd baseline --adapter "$adapter" --tree "$tree" --max_new_tokens 128 --max_seq_len 8448 \
    ${SOURCE:+--data_path "$SOURCE"} ${SAMPLES_8K:+--samples $SAMPLES_8K} --output "$file"
}
for phase in "$@"; do
  case $phase in
    data)  # the shipped recipe's short data on GPU A (issue 13's run.sh) beside the long data on GPU B
      CUDA_VISIBLE_DEVICES=$A LAUNCH=python SAMPLES=3000 WORK=$S timed short-data bash results/train/scaling/run.sh data &
      long_data; wait ;;
    runs)  # GPU B: long alone, trained and replayed, then the shipped tokens replayed; GPU A: long + short
      { train_run $B long "$W/targets" && replay $B long "$W/runs/long"; replay $B shipped $SHIPPED; } &
      train_run $A mixed "$S/sd-targets" "$W/targets" && replay $A mixed "$W/runs/mixed"; wait ;;
    speed|speed1)  # BEST: the run decoded at 8K, batch 16 with its own 16-row tree (speed1: batch 1, 64 rows),
      # then the shipped tokens with theirs (beside it on GPU B where there are two GPUs)
      batch=16; rows=16; [ $phase = speed1 ] && { batch=1; rows=64; }
      if [ "$A" = "$B" ]; then
        speed $A "${BEST:-mixed}" "$W/runs/${BEST:-mixed}" "$R/${BEST:-mixed}/trees/tree_$rows.json" $batch
        speed $A shipped $SHIPPED "$R/shipped/trees/tree_$rows.json" $batch
      else
        speed $B shipped $SHIPPED "$R/shipped/trees/tree_$rows.json" $batch &
        speed $A "${BEST:-mixed}" "$W/runs/${BEST:-mixed}" "$R/${BEST:-mixed}/trees/tree_$rows.json" $batch; wait
      fi ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
