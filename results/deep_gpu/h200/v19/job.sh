#!/usr/bin/env bash
# Prepared in the twenty-third session for the next H200 lease (not run yet): the output head's product by row count
# (head_gemm.py), the batch policy picked again now that GPU tree steps run the split attention kernel by default
# (each tree rated by its MT-Bench replay accept length, so the confident 16-row set is rated for its choice),
# then decoder throughput with it, then the GPU tests.
# Launch as .gpu/job/launch.sh does (a copy of the tree in /root/tree, this script under setsid nohup); outputs go to
# /root/res/v19. One process per phase: the trees of a phase share its compiled steps (one per step kind and batch 1
# or more), so a fresh machine compiles six step variants in `pick` (~10 minutes) and `speed` compiles again.
set -u
cd /root/tree
export PYTHONPATH=/root/ppd-site:/root/tree HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/root/inductor
t() { echo "== $(date +%T) $*"; }
R=/root/res/v19; mkdir -p $R/logs
T=results/train/v7/runs/maps16-lr3e-3-e3/trees
C=results/dynamic_trees/trees
E="--dtype bfloat16 --capture compiled_graph"
{
  # the output head's product alone, by row count and layout (a minute; the autotuned one separately, it compiles)
  t head; timeout 240 python results/deep_gpu/head_gemm.py --layouts linear pad16 pad64 chunks16 chunks48 transposed \
    --output $R/head_gemm.json > $R/logs/head_gemm.log 2>&1; echo "rc $?"; tail -n 17 $R/logs/head_gemm.log
  timeout 300 python results/deep_gpu/head_gemm.py --layouts linear compiled --rows 20 80 288 \
    --output $R/head_gemm_autotuned.json > $R/logs/head_gemm_autotuned.log 2>&1; echo "rc $?"
  tail -n 5 $R/logs/head_gemm_autotuned.log
  t pick; timeout 900 python -m eval.pick_tree $E --batch_sizes 1 2 4 8 16 32 --steps 32 \
    --trees $T/tree_16.json $T/tree_32.json $T/tree_64.json $T/tree_128.json $C/tree_16_confident.json \
    --accept_lengths results/dynamic_trees/mt_bench.json --output $R/pick_split_default.json > $R/logs/pick.log 2>&1; echo "rc $?"; grep -E "^\||policy" $R/logs/pick.log | tail -n 40
  t speed; timeout 900 python -m eval.batch_speed $E --batch_sizes 1 2 4 8 16 32 --bench mt_bench --max_new_tokens 256 \
    --max_seq_len 1024 --output $R/batch_speed_split_default.json --plot $R/batch_speed_split_default.png \
    > $R/logs/speed.log 2>&1; echo "rc $?"; tail -n 14 $R/logs/speed.log
  # run.sh's `check` files, and the split kernel's own GPU tests
  t check; timeout 900 python -m pytest -q tests/test_deep_prompts.py tests/test_engine.py tests/test_batcher.py \
    tests/test_tree_attention.py tests/test_lossless_sampling.py tests/test_split_attention.py \
    -k "gpu or captured or every_step_mode" > $R/logs/gpu_tests.log 2>&1; echo "rc $?"; tail -n 5 $R/logs/gpu_tests.log
  t end
} > /root/res/job.log 2>&1
echo "JOB DONE" >> /root/res/job.log
