#!/usr/bin/env bash
# Twenty-third session, second lease: the tree step's attention at 300 tokens of context, by PPD_GROUPED_SDPA
# mode. First each mode's kernels under --capture graph (no compilation: the attention kernels are the ones the
# compiled step calls too) at batch 1 and 16; then split against the default under compiled_graph, end to end.
set -u
cd /root/tree
export PYTHONPATH=/root/ppd-site:/root/tree HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/root/inductor
t() { echo "== $(date +%T) $*"; }
R=/root/res/v18; mkdir -p $R/logs
T=results/train/v7/runs/maps16-lr3e-3-e3/trees
{
  for b in 16 1; do
    for m in auto split folded matmul; do
      t profile-graph-$m-b$b; PPD_GROUPED_SDPA=$m timeout 200 python -m eval.step_profile --dtype bfloat16 \
        --capture graph --context 300 --batch_size $b --steps 32 --trees $T/tree_16.json $T/tree_64.json --top 12 \
        --output $R/profile_graph_${m}_b$b.json > $R/logs/profile_graph_${m}_b$b.log 2>&1; echo "rc $?"
      grep -A4 "^| tree" $R/logs/profile_graph_${m}_b$b.log | tail -n 3
    done
  done
  t pick-split; PPD_GROUPED_SDPA=split timeout 480 python -m eval.pick_tree --dtype bfloat16 --capture compiled_graph \
    --trees $T/tree_16.json $T/tree_64.json --steps 32 --batch_sizes 16 1 --output $R/pick_split.json \
    > $R/logs/pick_split.log 2>&1; echo "rc $?"; grep -E "^batch|^\|" $R/logs/pick_split.log | tail -n 12
  t end
} > /root/res/job.log 2>&1
echo "JOB DONE" >> /root/res/job.log
