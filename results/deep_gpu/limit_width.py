"""Give every tree bucket of the shipped CUDA bf16 batch policy a widest attention (``max_width``): past it the
decoder runs the one-row step. Its evidence, an `eval.long_context` run of the dense step, goes into the
policy's metadata with the rows it rests on.

On one H200 (`h200/v7/long_context_dense.json`) the policy's 128-row tree decoded at 0.94x the baseline over a
prompt of 889 tokens (its steps attending over 2,048 slots) and 0.69x at 8,056 (8,192 slots), where MT-Bench's
short prompts (256 to 1,024 slots) gave 1.55-1.66x; at batch 16 trees of 16 and 64 rows ran at 0.66-0.67x
with 2,048 slots and 0.30-0.39x with 8,192. So trees stop at 1,024 slots.

    python results/deep_gpu/limit_width.py results/deep_gpu/h200/v7/long_context_dense.json 1024
"""

import json
import sys

from ppd.policy import BatchPolicy
from ppd.prompt_tokens import packaged_adapter

measured_path, width = sys.argv[1], int(sys.argv[2])
measured = json.load(open(measured_path))
target = packaged_adapter("HuggingFaceTB/SmolLM2-135M-Instruct") / "policy_cuda_bfloat16.json"
policy = BatchPolicy.load(target)
evidence = [{"context": r["context"], "batch_size": r["batch_size"], "method": r["method"],
             "accept_length": round(r["accept_length"], 3),
             "decode_speedup": round(r["speedup_decode_vs_baseline"], 3)}
            for r in measured["rows"] if r.get("speedup_decode_vs_baseline") and r["method"].startswith("ppd")]
metadata = {**policy.metadata, "max_width": {"width": width, "from": measured_path,
                                             "device": measured["environment"]["device"],
                                             "command": measured["command"], "rows": evidence}}
shipped = BatchPolicy(policy.buckets, policy.trees, metadata,
                      tuple(None if t is None else width for t in policy.trees))
shipped.save(target)
print(f"{shipped.describe()}\nwritten to {target}")
