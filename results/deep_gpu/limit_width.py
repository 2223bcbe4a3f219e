"""Set the widest attention (``max_width``) of buckets of the shipped CUDA bf16 batch policy: past it the decoder
runs the one-row step. Its evidence, an `eval.long_context` run, goes into the policy's metadata with the rows it
rests on (the first setting under ``max_width``, each later one appended to ``max_width_changes``).

    python results/deep_gpu/limit_width.py EVIDENCE.json WIDTH [MAX_BATCH ...]

``WIDTH`` is a slot count or ``none`` (no limit); the buckets are named by their ``max_batch`` (default: every
bucket that runs a tree).

Seventh session: on one H200 (`h200/v7/long_context_dense.json`) the policy's 128-row tree decoded at 0.94x the
baseline over a prompt of 889 tokens (its steps attending over 2,048 slots) and 0.69x at 8,056 (8,192 slots), where
MT-Bench's short prompts (256 to 1,024 slots) gave 1.55-1.66x; at batch 16 trees of 16 and 64 rows ran at 0.66-0.67x
with 2,048 slots and 0.30-0.39x with 8,192. So trees stopped at 1,024 slots:

    python results/deep_gpu/limit_width.py results/deep_gpu/h200/v7/long_context_dense.json 1024

Twenty-third session: tree steps now run the split attention kernel by default on a GPU, and through it the same
128-row tree decoded eight 8K prompts at 1.58x the baseline at batch 1 (`h200/v15b/long_context_8k_b1_samples8.json`,
the kernel then opt-in). Batch 1 lost its limit; 2-8 keep theirs (not timed past 1,024 slots with the kernel):

    python results/deep_gpu/limit_width.py results/deep_gpu/h200/v15b/long_context_8k_b1_samples8.json none 1
"""

import json
import sys

from ppd.policy import BatchPolicy
from ppd.prompt_tokens import packaged_adapter


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit(__doc__)
    measured_path, width_text, *chosen = argv
    width = None if width_text == "none" else int(width_text)
    measured = json.load(open(measured_path))
    target = packaged_adapter("HuggingFaceTB/SmolLM2-135M-Instruct") / "policy_cuda_bfloat16.json"
    policy = BatchPolicy.load(target)
    buckets = [int(b) for b in chosen] or [b for b, t in zip(policy.buckets, policy.trees) if t is not None]
    unknown = sorted(set(buckets) - set(policy.buckets))
    if unknown:
        raise SystemExit(f"no bucket with max_batch {unknown}; the policy's are {list(policy.buckets)}")
    evidence = [{"context": r["context"], "batch_size": r["batch_size"], "method": r["method"],
                 "accept_length": round(r["accept_length"], 3),
                 "decode_speedup": round(r["speedup_decode_vs_baseline"], 3)}
                for r in measured["rows"] if r.get("speedup_decode_vs_baseline") and r["method"].startswith("ppd")]
    record = {"width": width, "buckets": buckets, "from": measured_path,
              "device": measured["environment"]["device"],
              "switches": measured["environment"].get("ppd_switches", {}),
              "command": measured["command"], "rows": evidence}
    metadata = dict(policy.metadata)
    if "max_width" in metadata:
        metadata["max_width_changes"] = [*metadata.get("max_width_changes", []), record]
    else:
        metadata["max_width"] = record
    widths = tuple(width if b in buckets and t is not None else w
                   for b, t, w in zip(policy.buckets, policy.trees, policy.max_widths))
    shipped = BatchPolicy(policy.buckets, policy.trees, metadata, widths)
    shipped.save(target)
    print(f"{shipped.describe()}\nwritten to {target}")


if __name__ == "__main__":
    main(sys.argv[1:])
