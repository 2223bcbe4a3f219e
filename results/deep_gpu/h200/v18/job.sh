#!/usr/bin/env bash
# Twenty-third session, one H200: (1) confident trees against fixed ones under compiled_graph, step times at
# batch 1 and 16 (300 tokens of context); (2) where the tree step's time goes at batch 4 and 16 against the
# one-row step (eval.step_profile), to find what makes batch 16 cost 2x the one-row step.
set -u
cd /root/tree
export PYTHONPATH=/root/ppd-site:/root/tree HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/root/inductor
t() { echo "== $(date +%T) $*"; }
R=/root/res/v18; mkdir -p $R/logs
T=results/train/v7/runs/maps16-lr3e-3-e3/trees
C=results/dynamic_trees/trees
E="--dtype bfloat16 --capture compiled_graph"
TREES="$T/tree_16.json $T/tree_64.json $C/tree_16_confident.json $C/tree_64_confident.json"
{
  # compile each tree's variants in its own process at once (the CPU's work), then time from Inductor's cache
  t warm
  i=0
  for tr in $TREES; do
    i=$((i+1))
    timeout 560 python -m eval.pick_tree $E --trees $tr --steps 4 --batch_sizes 1 4 16 \
      --output $R/warm_$i.json > $R/logs/warm_$i.log 2>&1 &
  done
  wait; t warmed; tail -n 2 $R/logs/warm_*.log
  t pick; timeout 400 python -m eval.pick_tree $E --trees $TREES --steps 32 --batch_sizes 1 16 \
    --output $R/pick_confident.json > $R/logs/pick_confident.log 2>&1; echo "rc $?"
  tail -n 14 $R/logs/pick_confident.log
  for b in 16 4; do
    t profile-b$b; timeout 400 python -m eval.step_profile $E --context 300 --batch_size $b --steps 32 \
      --trees $T/tree_16.json $T/tree_64.json $C/tree_16_confident.json --top 40 \
      --output $R/profile_b$b.json > $R/logs/profile_b$b.log 2>&1; echo "rc $?"; tail -n 6 $R/logs/profile_b$b.log
  done
  t end
} > /root/res/job.log 2>&1
echo "JOB DONE" >> /root/res/job.log
