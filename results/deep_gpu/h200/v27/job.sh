#!/usr/bin/env bash
# Prepared in the twenty-ninth session for the next H200 lease (not run yet). Stage with LONG=1 (part 4 reads the
# first 3,000 ShareGPT conversations): `LONG=1 bash results/deep_gpu/lease/stage.sh`, then the calls of ../../lease/README.md; outputs in /root/res/v27.
# v26 found ppd at 16 clients bound by its batch-16 tree step on the device (chunks every 2.8 ms; the 32-row tree
# with a chain of 8, 40 rows a batch row: 2,517 us against 1,247 for one row in v25's profile), while the C HTTP
# stack lifted the baseline to 8,282 tokens/s: 1.27x. Buckets 2-16 of the shipped policy run that tree; the smaller
# chained trees were never timed there through the continuous batcher (v20 timed the 16-row one in a static batch of
# 16 only, where a batch waits for its slowest row). By replay on MT-Bench the 16-row tree with the chain accepts
# 2.96 tokens a step against 3.19 for the 32-row one, with 24 rows a step against 40. In the order they matter:
# (1) the server at 16 clients with the 16-row chained tree at every bucket, then with the policy, same run;
# (2) the continuous batcher at 16, 8 and 4 rows: the policy against the 16-row chained tree;
# (3) where the 16-row chained tree's batch-16 step spends its device time (against v25's 40-row profile);
# (4) issue 18's memory at 8K and batch 16: v26's tree runs peaked at 25-28 GiB against 9.8, but each variant's
#     decoder kept its cache allocated for the next; eval.long_context now also gives the peak's rise over what was
#     allocated when the timed generation began. The baseline and the 16-row chained tree alone, in one process;
# (5) if time is left: the server at 16 clients with the 8-row chained tree (17 rows a step).
set -u
source /root/tree/results/deep_gpu/lease/job_env.sh v27
E="--dtype bfloat16 --capture compiled_graph"
S="$E --max_seq_len 1024"
T=results/lookup/trees
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  t load16_tree16; timeout 600 python -m eval.load --launch --model smollm2-135m-instruct \
    --server_args="$S --max_batch 16 --tree $T/tree_16_lookup8.json" --clients 16 --methods ppd baseline \
    --bench mt_bench --max_tokens 256 --output $R/load16_tree16.json > $R/logs/load16_tree16.log 2>&1; echo "rc $?"
  grep -E "^\|" $R/logs/load16_tree16.log | head -4
  t load16; timeout 600 python -m eval.load --launch --model smollm2-135m-instruct --server_args="$S --max_batch 16" \
    --clients 16 --methods ppd baseline --bench mt_bench --max_tokens 256 \
    --output $R/load16.json > $R/logs/load16.log 2>&1; echo "rc $?"; grep -E "^\|" $R/logs/load16.log | head -4
  for f in load16 load16_tree16; do python results/deep_gpu/admission_gaps.py $R/$f.json --output $R/admission_gaps_$f.json; done
  t continuous; timeout 900 python -m eval.batch_speed $E --batching continuous --batch_sizes 16 8 4 --bench mt_bench \
    --max_new_tokens 256 --max_seq_len 1024 --trees $T/tree_16_lookup8.json \
    --output $R/batch_speed_continuous.json --plot $R/batch_speed_continuous.png > $R/logs/continuous.log 2>&1
  echo "rc $?"; grep -E "^\|" $R/logs/continuous.log | cut -c1-240
  t step_profile; timeout 300 python -m eval.step_profile $E --context 300 --batch_size 16 --steps 32 \
    --trees $T/tree_16_lookup8.json --top 40 --output $R/step_profile_b16_tree16.json \
    > $R/logs/step_profile.log 2>&1; echo "rc $?"; tail -n 4 $R/logs/step_profile.log | cut -c1-200
  t long8k_memory; gunzip -kf /root/ppd-stage/sharegpt_first3000.json.gz
  timeout 500 python -m eval.long_context $E --attention dense --contexts 8192 --batch_sizes 16 \
    --methods baseline --trees $T/tree_16_lookup8.json --data_path /root/ppd-stage/sharegpt_first3000.json \
    --max_new_tokens 128 --max_seq_len 8448 --output $R/long_context_8k_b16_memory.json \
    > $R/logs/long8k_memory.log 2>&1; echo "rc $?"; grep -E "^\|" $R/logs/long8k_memory.log | cut -c1-240 | head -4
  t load16_tree8; timeout 400 python -m eval.load --launch --model smollm2-135m-instruct \
    --server_args="$S --max_batch 16 --tree $T/tree_8_lookup8.json" --clients 16 --methods ppd \
    --bench mt_bench --max_tokens 256 --output $R/load16_tree8.json > $R/logs/load16_tree8.log 2>&1; echo "rc $?"
  grep -E "^\|" $R/logs/load16_tree8.log | head -4
  t end
} > /root/res/job.log 2>&1
echo "JOB DONE" >> /root/res/job.log
