#!/usr/bin/env bash
# Device side: starts a job script detached from the device call, so that it runs on between calls while the
# machine stays held. The job runs from a copy of the working tree in /root/tree (each call lays the working
# tree anew, and a process importing from it while it is copied fails) and writes under /root/res.
#   run(command="bash results/deep_gpu/lease/launch.sh results/deep_gpu/h200/vNN/job.sh")
# Then poll with peek.sh, one call right after another (an idle machine goes back after ~30 s).
set -eu
job=${1:?usage: launch.sh JOB_SCRIPT (a path inside the repository)}
[ -f "$job" ] || { echo "no job script at $job" >&2; exit 2; }
# (from the root the call starts in: v34's second launch, run from /root/tree, removed its own source and ran nothing)
[ "$(pwd -P)" != /root/tree ] || { echo "launch.sh replaces /root/tree: run it from the call's own root" >&2; exit 2; }
rm -rf /root/tree && mkdir -p /root/tree /root/res
tar --exclude=./.gpu -cf - . | tar -xf - -C /root/tree
rm -f /root/res/job.log
setsid nohup bash "/root/tree/$job" > /root/res/launch.log 2>&1 < /dev/null &
echo "launched $job as pid $! at $(date +%T)"
