"""Latency of one decoding forward pass as a function of the rows it carries (the tree size).

Usage:
    python -m eval.forward_latency --model smollm2-135m-instruct --rows 1 2 4 8 16 32 64 \
        --context 200 --repeats 8 --output results/core/forward_latency_cpu.json

Each measurement runs the model's forward for ``rows`` new rows against ``context`` cached tokens through
the decoder's own cache and mask path, after two warm-up calls. Writes JSON and prints a table.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from ppd.attention import step_mask
from ppd.cli import add_model_args
from ppd.kv_cache import KVCache
from ppd.models import load_model

from .records import environment, write_json


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.forward_latency", description=__doc__.split("\n")[0])
    add_model_args(parser)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--context", type=int, default=200, help="tokens already in the cache")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--output", default=None)
    return parser


def measure(model, rows: int, context: int, repeats: int) -> float:
    """Mean seconds of one forward of ``rows`` causal rows after ``context`` cached entries."""
    device = model.get_input_embeddings().weight.device
    cache = KVCache(model.config.num_hidden_layers, 1, context + rows, device)
    lengths = torch.tensor([context], device=device)
    embeds = model.get_input_embeddings()(torch.randint(0, 1000, (1, rows), device=device))
    tree = torch.tril(torch.ones(rows, rows, dtype=torch.bool, device=device))
    mask = step_mask(tree, lengths, context + rows, embeds.dtype)
    positions = lengths[:, None] + torch.arange(rows, device=device)[None]

    def forward():
        cache.prepare(positions, context + rows)
        model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)

    with torch.inference_mode():
        for _ in range(2):
            forward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            forward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeats


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    model, _, info = load_model(args.model, device=args.device, dtype=args.dtype,
                                load_in_4bit=args.load_in_4bit, load_in_8bit=args.load_in_8bit)
    device = model.get_input_embeddings().weight.device
    results = [{"rows": r, "latency_ms": 1e3 * measure(model, r, args.context, args.repeats)} for r in args.rows]
    record = {"model": info.model_id, "context": args.context, "dtype": str(model.dtype), **environment(device),
              "results": results}
    print("| rows | latency (ms) |\n|---|---|")
    for r in results:
        print(f"| {r['rows']} | {r['latency_ms']:.1f} |")
    if args.output:
        write_json(args.output, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
