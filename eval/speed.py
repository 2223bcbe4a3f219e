"""Tokens/s and accept length of PPD, the engine's autoregressive baseline and transformers' generate.

Usage:
    python -m eval.speed --model smollm2-135m-instruct --methods ppd baseline hf_static hf \
        --max_new_tokens 128 --output results/speed_cpu.json [--prompt TEXT ...] [--repeats 1]

Each prompt is wrapped in the model's chat template. ``hf_static`` is transformers' ``generate`` with
``cache_implementation="static"`` (it compiles the decoding forward); ``hf`` the eager one. Engine
methods compile and capture their steps first; every method then runs two untimed warm-up generations
(for ``hf_static`` one of them twice as long, see ``eval.gen_answers``).
Writes the per-prompt records and a summary to ``--output`` (JSON) and prints a markdown table; greedy
outputs of every method are compared with the baseline's.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from ppd.chat import chat_input_ids
from ppd.cli import add_adapter_args, add_engine_args, add_model_args, load_decoder_or_exit
from ppd.config import DecodeConfig

from .records import environment, write_json

DEFAULT_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash map works and give a Python example.",
    "Write a detailed essay about the history of the printing press.",
]


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.speed", description=__doc__.split("\n")[0])
    add_model_args(parser)
    add_adapter_args(parser)
    add_engine_args(parser)
    parser.add_argument("--methods", nargs="+", default=["ppd", "baseline", "hf_static", "hf"],
                        choices=["ppd", "baseline", "hf_static", "hf"])
    parser.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per prompt and method")
    parser.add_argument("--output", default=None, help="JSON file for the records and summary")
    return parser


def _hf_generate(model, ids: list[int], max_new_tokens: int, static: bool) -> tuple[list[int], float]:
    device = model.get_input_embeddings().weight.device
    inputs = torch.tensor([ids], device=device)
    extra = {"cache_implementation": "static"} if static else {}
    start = time.perf_counter()
    out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_new_tokens,
                         do_sample=False, **extra)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out[0, len(ids):].tolist(), time.perf_counter() - start


def run(args: argparse.Namespace) -> dict:
    loaded = load_decoder_or_exit(args, with_prompt_tokens="ppd" in args.methods)
    prompts = args.prompt or DEFAULT_PROMPTS
    inputs = [chat_input_ids(loaded.tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    records = []
    startup = {}
    for method in args.methods:
        engine = method in ("ppd", "baseline")
        config = DecodeConfig(method=method if engine else "baseline", max_new_tokens=args.max_new_tokens,
                              capture=args.capture)

        def once(ids):
            if not engine:
                tokens, wall = _hf_generate(loaded.model, ids, args.max_new_tokens, static=method == "hf_static")
                return tokens, None, wall
            out = loaded.decoder.generate(ids, config)
            return out.token_ids, out.steps, out.wall_time_s

        if engine:
            startup[method] = loaded.decoder.warmup(methods=[method], capture=args.capture)
        once(inputs[0])  # warm-up
        once(inputs[0] + inputs[0])
        for index, ids in enumerate(inputs):
            for repeat in range(args.repeats):
                tokens, steps, wall = once(ids)
                records.append({"prompt": index, "repeat": repeat, "method": method, "new_tokens": len(tokens),
                                "steps": steps, "wall_time_s": wall, "token_ids": tokens})
    reference = "baseline" if "baseline" in args.methods else args.methods[0]
    baseline = {r["prompt"]: r["token_ids"] for r in records if r["method"] == reference}
    summary = {}
    for method in args.methods:
        rows = [r for r in records if r["method"] == method]
        tokens, wall = sum(r["new_tokens"] for r in rows), sum(r["wall_time_s"] for r in rows)
        steps = sum(r["steps"] or 0 for r in rows)
        summary[method] = {
            "tokens_per_s": tokens / wall,
            "accept_length": tokens / steps if steps else None,
            "identical_to_baseline": sum(r["token_ids"] == baseline[r["prompt"]] for r in rows) / len(rows),
            "new_tokens": tokens,
        }
    return {
        "model": loaded.info.model_id, "adapter": loaded.adapter, "tree": loaded.tree,
        "max_new_tokens": args.max_new_tokens, "capture": args.capture, "startup_s": startup,
        "dtype": str(loaded.decoder.dtype), **environment(loaded.decoder.device),
        "prompts": prompts, "summary": summary, "records": records,
    }


def table(result: dict) -> str:
    lines = ["| method | tokens/s | accept length | identical to baseline |", "|---|---|---|---|"]
    for method, s in result["summary"].items():
        accept = f"{s['accept_length']:.2f}" if s["accept_length"] else "-"
        lines.append(f"| {method} | {s['tokens_per_s']:.1f} | {accept} | {s['identical_to_baseline']:.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    result = run(args)
    print(f"{result['model']} ({result['adapter']}) on {result['device']}, {result['dtype']}, "
          f"max_new_tokens={result['max_new_tokens']}")
    print(table(result))
    if args.output:
        write_json(args.output, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
