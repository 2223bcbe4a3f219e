#!/usr/bin/env bash
# Issue 14: decoder throughput by batch without and with the run ahead; fp32 answers of both compared.
set -u
cd /root/tree
export PYTHONPATH=/root/ppd-site:/root/tree HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OUT=/root/res
t() { echo "== $(date +%T) $*"; }
t ahead; DEADLINE=100000 PHASE_CAP=900 bash results/deep_gpu/run.sh ahead | tail -3
grep -h "^batch" /root/res/deep_gpu/logs/ahead*.log; cat /root/res/deep_gpu/logs/ahead_check.log | tail -3
t end; echo "JOB DONE"
