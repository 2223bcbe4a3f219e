#!/usr/bin/env bash
# Device side: waits up to WAIT seconds (default 540) for a job started by launch.sh to print "JOB DONE", printing
# its log as it grows, then packs /root/res (the job's outputs, whatever is there so far) into $OUT/res.tar.gz,
# and once copies /root/keep/out's files (parts a job packed for the next lease) beside it.
#   run(command="bash results/deep_gpu/lease/peek.sh 540", timeout_s=600)
set -u
wait_s=${1:-540}; log=/root/res/job.log; end=$((SECONDS + wait_s)); shown=0
while (( SECONDS < end )); do
  if [ -f "$log" ]; then
    n=$(wc -l < "$log"); (( n > shown )) && { sed -n "$((shown + 1)),${n}p" "$log"; shown=$n; }
    grep -q "JOB DONE" "$log" && break
  fi
  sleep 5
done
grep -q "JOB DONE" "$log" 2>/dev/null || echo "(still running at $(date +%T))"
tail -n 3 /root/res/launch.log 2>/dev/null
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
[ -n "${OUT:-}" ] || exit 0
tar czf "$OUT/res.tar.gz" -C /root res
# a job may leave files for the next lease in /root/keep/out and mark them ready with /root/keep/packed; they come
# back once (at most 7 files of 16 MiB beside the archive)
if [ -f /root/keep/packed ] && [ ! -f /root/keep/sent ]; then cp /root/keep/out/* "$OUT"/ && touch /root/keep/sent; fi
ls -la "$OUT"
