#!/usr/bin/env bash
# Waits for the long replies' first two shards (1,024 prompts), stops the job, renames them as the shards of a
# 1,024-prompt run (the shard names carry the shard count) and starts the job again on those prompts.
set -u
while [ "$(ls -d /root/work-long/sd.shards/shard-0000[01]-of-00004 2>/dev/null | wc -l)" -lt 2 ]; do sleep 2; done
pkill -f ".gpu/job/job.sh"; pkill -f "results/train/long/run.sh"; pkill -f "data_gen.generate"; sleep 5
cd /root/work-long/sd.shards && for i in 0 1; do mv shard-0000$i-of-00004 shard-0000$i-of-00002; done
rm -rf .shard-* ; ls -a; date
