#!/usr/bin/env bash
# Prompt tokens v5: the deep prompt tokens of v4 on twice the self-distilled data and more epochs, made and
# trained on two GPUs of one host (nvidia-h100-x2), with the 1- against 2-GPU training speed on that data.
#   bash results/train/v5/run.sh check data            # graph-mode GPU tests; data on both GPUs
#   bash results/train/v5/run.sh speed train pack      # examples/s 1 vs 2 GPUs; the run; results to $OUT
# Run after staging the packages (../shared/gpu/README.md). Each phase skips what an earlier call finished
# (training resumes from its last checkpoint). The held-out paths, trees and replays run afterwards on any
# machine from what `pack` returns (results/train/v5/README.md).
set -uo pipefail
export PYTHONPATH=/root/ppd-site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
W=${WORK:-/root/work-v5}; R=${OUT:-/tmp/out}/v5
mkdir -p "$W/logs" "$R"
SAMPLES=${SAMPLES:-6000}; EPOCHS=${EPOCHS:-3}; STEPS=${STEPS:-120}; N=5; CUTS=32
TWO="accelerate launch --multi_gpu --num_processes 2"
TRAIN="--trainer_type distillation --lr_scheduler_type cosine --per_device_train_batch_size 8 --num_prompt_tokens 3
  --learning_rate 1e-2 --deep --dataloader_num_workers 2"
timed() {  # NAME command...: its output to logs/NAME.log, "NAME seconds rc" to timings.txt
  local name=$1; shift; local start=$SECONDS
  "$@" > "$W/logs/$name.log" 2>&1; local rc=$?
  echo "$name $((SECONDS - start)) rc=$rc" | tee -a "$W/timings.txt"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$W/logs/gpu.txt"
for phase in "$@"; do
  case $phase in
    check)  # the CUDA-graph step (no compilation) since the cache grows on request: deep and plain tokens
      timed gpu-tests timeout 200 python -m pytest -q -x tests/test_deep_prompts.py tests/test_engine.py \
        tests/test_batcher.py tests/test_lossless_sampling.py -k "graph and not compiled" ;;
    data)
      [ -d "$W/sd" ] || timed sd-conversations $TWO -m data_gen.generate --dataset_type conversations \
        --output_path "$W/sd" --max_samples "$SAMPLES" --max_turns 2 --max_new_tokens 256 --batch_size 256 \
        --decode_method baseline --dtype bfloat16
      [ -d "$W/sd-cuts" ] || timed sd-cuts python -m data_gen.generate --dataset_type finetune --data_path "$W/sd" \
        --output_path "$W/sd-cuts" --num_prompt_tokens $N --cuts_per_conversation $CUTS --shard_size 2048
      [ -d "$W/sd-targets" ] || timed sd-targets $TWO -m data_gen.generate --dataset_type distillation \
        --data_path "$W/sd-cuts" --output_path "$W/sd-targets" --num_prompt_tokens $N --teacher forced \
        --dtype bfloat16 --batch_tokens 131072 --max_batch_size 256 --shard_size 2048 ;;
    speed)  # packed cuts, the same flags, 1 process on one visible GPU (train.train refuses one that sees
            # two), then 2 processes
      [ -f "$R/train_speed_1gpu.json" ] || CUDA_VISIBLE_DEVICES=0 timed speed-1gpu python -m eval.train_speed --dataset_path "$W/sd-targets" \
        --max_steps "$STEPS" --cuts_per_forward 0 --output "$R/train_speed_1gpu.json" -- $TRAIN
      [ -f "$R/train_speed_2gpu.json" ] || timed speed-2gpu python -m eval.train_speed --dataset_path "$W/sd-targets" \
        --max_steps "$STEPS" --cuts_per_forward 0 --launcher "$TWO" --output "$R/train_speed_2gpu.json" -- $TRAIN ;;
    train)  # the candidate: 2 GPUs x 8 conversations per step, held-out 3 %, checkpoints to resume from
      [ -f "$W/runs/deep-e$EPOCHS/training_log.json" ] || timed "train-deep-e$EPOCHS" $TWO -m train.train \
        --dataset_path "$W/sd-targets" --output_dir "$W/runs/deep-e$EPOCHS" $TRAIN --num_train_epochs "$EPOCHS" \
        --eval_size 0.03 --per_device_eval_batch_size 16 --logging_steps 50 --save_steps 100 \
        --resume_from_checkpoint latest ;;
    pack)  # one archive back: the adapters (checkpoints' too: a run cut off still returns its latest), their
           # logs, the conversations (for held-out replay); logs follow below
      tar -C "$W" -czf "$R/v5.tgz" sd $(cd "$W" && ls runs/*/prompt_tokens.safetensors runs/*/ppd_config.json \
        runs/*/training_log.json runs/*/checkpoint-*/{prompt_tokens.safetensors,ppd_config.json,trainer_state.json} \
        2>/dev/null)
      ls -la "$R" ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
cat "$W/timings.txt" 2>/dev/null
cp "$W/timings.txt" "$R/" 2>/dev/null; tar -C "$W" -czf "$R/logs.tgz" logs
