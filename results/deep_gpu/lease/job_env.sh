# Sourced by a job script that launch.sh started: `source results/deep_gpu/lease/job_env.sh vNN`. Works in the
# tree's copy in /root/tree with the staged packages and the machine's Inductor cache, writes under /root/res/vNN
# (R), and gives `t`, which stamps a log line with the time.
cd /root/tree
export PYTHONPATH=/root/ppd-site:/root/tree HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=/root/inductor
R=/root/res/${1:?usage: source job_env.sh vNN}
mkdir -p "$R/logs"
t() { echo "== $(date +%T) $*"; }
