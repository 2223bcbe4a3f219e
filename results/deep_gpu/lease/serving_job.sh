# Sourced by the serving jobs (h100/v32, v34, v35): `source results/deep_gpu/lease/serving_job.sh vNN` after `set -u`.
# On top of job_env.sh (the tree, packages, caches, R and t): the compiled artifacts a lease carries in .gpu_keep
# (PPD_COMPILE_CACHE: the latest compiled_vNN_h100.tgz, unpacked by `unpack_kept`, packed again by `pack_kept`), the
# commands the parts share (E: engine flags, C: the continuous batcher's speed at MT-Bench, L: the load benchmark
# with a launched server, S: its server's flags, buckets to 64) and `rows`, which prints a part's exit status and its
# table's first lines.
source /root/tree/results/deep_gpu/lease/job_env.sh "${1:?usage: source serving_job.sh vNN}"
export PPD_COMPILE_CACHE=/root/keep/compiled
mkdir -p "$PPD_COMPILE_CACHE"
kept=$(ls /root/tree/.gpu_keep/compiled_v*_h100.tgz 2>/dev/null | sort | tail -n 1)  # the latest lease's (vNN)
E="--dtype bfloat16 --capture compiled_graph"
C="python -m eval.batch_speed $E --batching continuous --bench mt_bench --max_new_tokens 256 --max_seq_len 1024"
L="python -m eval.load --launch --model smollm2-135m-instruct --bench mt_bench --max_tokens 256"
S="--server_args=$E --max_seq_len 1024 --max_batch 64"
rows() { echo "rc $1"; grep -E "^\||slow garbage" "$2" | head -n "${3:-6}" | cut -c1-300; }
unpack_kept() {
  if [ -f "$kept" ]; then t "kept $kept"; tar xzf "$kept" -C /root/keep && du -sm "$PPD_COMPILE_CACHE"; fi
}
# The compiled artifacts as they stand, packed in 15 MiB parts for peek.sh to bring back once (as v31's were), where
# they fit beside the results' archive (64 MiB in all); the next lease carries them in .gpu_keep.
pack_kept() {
  mkdir -p /root/keep/out && tar czf /root/keep/compiled.tgz -C /root/keep compiled
  local size; size=$(stat -c %s /root/keep/compiled.tgz); echo "compiled.tgz $size bytes"
  if (( size <= 45 * 1048576 )); then
    split -b 15m /root/keep/compiled.tgz /root/keep/out/compiled.tgz. && touch /root/keep/packed
  fi
}
