#!/usr/bin/env bash
# Twenty-first session, second lease (one H200): 8K batch 16 again, eager, in float32 and bfloat16, for the shipped
# and the mixed prompt tokens: is the accept length that the compiled bf16 runs gave (1.56 and 1.42) the prompts',
# or the dtype's and step's?
set -u
cd /root/tree
export PYTHONPATH=/root/ppd-site:/root/tree HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OUT=/root/res
t() { echo "== $(date +%T) $*"; }
R=/root/res/long/eager; mkdir -p $R/logs
gunzip -kf /root/ppd-stage/sharegpt_first3000.json.gz
H=results/train/long/h200
for dtype in float32 bfloat16; do
  for run in shipped mixed; do
    A=ppd/adapters/smollm2-135m-instruct; [ $run = mixed ] && A=.gpu/job/mixed
    t $dtype $run; timeout 200 python -m eval.long_context --dtype $dtype --capture eager --contexts 8192 --batch_sizes 16 \
      --methods ppd baseline --adapter $A --tree $H/$run/trees/tree_16.json --max_new_tokens 128 --max_seq_len 8448 \
      --data_path /root/ppd-stage/sharegpt_first3000.json --output $R/long_context_8k_b16_${dtype}_$run.json > $R/logs/${dtype}_$run.log 2>&1
    echo "rc $?"; grep "^| 8192" $R/logs/${dtype}_$run.log
  done
done
t end; echo "JOB DONE"
