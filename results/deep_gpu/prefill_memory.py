"""Where a long batched prefill's memory goes: the largest allocations of one prefill, with the code that made them.

A diagnostic for `h200/v27/`, where the 16-row chained tree's timed generation at 8K context and batch 16 raised the
GPU's peak memory 17.5 GiB over what was allocated before it, and the baseline's 4.9 GiB. For each method (the
engine's baseline, ppd, then each ``--trees`` file on a decoder of its own), after the warm-up ``eval.long_context``
runs, it records the CUDA allocator's history (``torch.cuda.memory._record_memory_history``) over one prefill of the
same long prompts (a generation of one new token), then writes the allocations of that prefill larger than
``--min_mib``, largest first, each with the Python frames that made it (this project's, transformers' and torch's
functional code), and the prefill's peak rise. Takes ``eval.long_context``'s options (one context, one batch size).

    python results/deep_gpu/prefill_memory.py --dtype bfloat16 --capture compiled_graph --attention dense \\
        --contexts 8192 --batch_sizes 16 --methods baseline ppd --trees results/lookup/trees/tree_16_lookup8.json \\
        --data_path sharegpt_first3000.json --max_new_tokens 128 --max_seq_len 8448 --output prefill_memory.json
"""

from __future__ import annotations

import json
import linecache
import sys

import torch

from eval.batch_speed import variant_name
from eval.long_context import make_parser
from eval.records import environment
from ppd.cli import load_decoder_or_exit, tree_files
from ppd.config import DecodeConfig
from ppd.long_prompts import long_prompts

# This project's code, the libraries' that make attention, and Inductor's generated modules (in the machine's
# Inductor cache, $TORCHINDUCTOR_CACHE_DIR, or under /tmp/torchinductor_<user>), whose line is the allocation itself.
KEPT_FRAMES = ("/ppd/", "/transformers/", "torch/nn/functional.py", "torch/_inductor/", "torch/_dynamo/", "inductor")


def frames(event: dict, limit: int = 8) -> list[str]:
    """The frames of an allocation worth reading, each with its source line where the file is at hand."""
    kept = []
    for f in event.get("frames", []):
        if any(k in f["filename"] for k in KEPT_FRAMES):
            text = linecache.getline(f["filename"], f["line"]).strip()
            where = f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"
            kept.append(f"{where}: {text}" if text else where)
    return kept[:limit]


def prefill_allocations(decoder, method: str, prompts: list[list[int]], capture: str, min_bytes: int) -> dict:
    device = decoder.device
    config = DecodeConfig(method=method, max_new_tokens=1, capture=capture)
    decoder.warmup(batch_sizes=[len(prompts)], methods=[method], capture=capture)
    decoder.generate(prompts, config)  # the same shapes once, untimed: nothing compiles in the recorded one
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=500_000)
    try:
        decoder.generate(prompts, config)
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    rise = torch.cuda.max_memory_allocated(device) - before
    trace = snapshot["device_traces"][device.index or 0]
    large = sorted((e for e in trace if e["action"] == "alloc" and e["size"] >= min_bytes),
                   key=lambda e: -e["size"])
    return {"method": method, "peak_rise_bytes": rise, "allocations": len(trace),
            "large": [{"mib": e["size"] / 2 ** 20, "frames": frames(e)} for e in large[:40]]}


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    parser.add_argument("--min_mib", type=float, default=256.0, help="allocations listed: at least this many MiB")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("prefill_memory.py reads the CUDA allocator's history: it needs a GPU", file=sys.stderr)
        return 2
    loaded = load_decoder_or_exit(args, with_prompt_tokens=True)
    decoder = loaded.decoder
    context, batch = args.contexts[0], args.batch_sizes[0]
    prompts = long_prompts(loaded.tokenizer, context - args.max_new_tokens, batch, args.data_path)
    variants = [(m, decoder, m) for m in args.methods]
    variants += [(variant_name(f), decoder.with_trees(t), "ppd")
                 for f, t in tree_files(args.trees, args.tree_choice, args.lookup).items()]
    rows = []
    for name, own, method in variants:
        row = {"variant": name, **prefill_allocations(own, method, prompts, args.capture, int(args.min_mib * 2 ** 20))}
        rows.append(row)
        print(f"{name}: the prefill's peak rose {row['peak_rise_bytes'] / 2 ** 30:.2f} GiB; "
              f"{len(row['large'])} allocations of {args.min_mib:g} MiB or more", file=sys.stderr)
        for alloc in row["large"][:6]:
            print(f"  {alloc['mib']:9.1f} MiB  " + " <- ".join(alloc["frames"][:4]), file=sys.stderr)
    result = {"command": " ".join(["python", *sys.argv]), "context": context, "batch_size": batch,
              "prompt_tokens": [len(p) for p in prompts], "environment": environment(decoder.device), "rows": rows}
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
