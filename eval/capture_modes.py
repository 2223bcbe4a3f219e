"""Step time of every way the engine can run its step, side by side: the measurement behind ``auto``.

Usage:
    python -m eval.capture_modes --modes eager graph compiled_graph reduce_overhead \\
        --trees results/trees/h200/trees/tree_64.json --baseline --dtype bfloat16 --contexts 300 3000 \\
        --output results/core/capture_modes.json [--random_weights CONFIG_DIR] [--budget_s 400]

For each mode, context length and tree set (and the one-row step with ``--baseline``) this times the step
as ``eval.step_latency`` does, after an untimed warm-up that compiles and captures, and reports that
warm-up's seconds. ``--random_weights`` builds the model from a ``config.json`` with random weights and
random prompt tokens: step times depend on shapes, not on weights, so the modes can be compared where the
real weights are not at hand (acceptance, and so tokens per second, cannot). ``--budget_s`` skips what
is left once that many seconds have passed (each skip is recorded).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import torch

from ppd.cli import add_adapter_args, add_engine_args, add_model_args, load_decoder_or_exit, tree_files
from ppd.config import CaptureMode, PromptTokenConfig
from ppd.decoder import Decoder
from ppd.models import default_device, resolve_dtype
from ppd.prompt_tokens import PromptTokens

from .records import environment, write_json
from .step_latency import step_time


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.capture_modes", description=__doc__.split("\n")[0])
    add_model_args(parser)
    add_adapter_args(parser)
    add_engine_args(parser)
    parser.add_argument("--modes", nargs="+", default=["eager", "graph", "compiled_graph", "reduce_overhead"],
                        choices=[m.value for m in CaptureMode if m is not CaptureMode.AUTO])
    parser.add_argument("--trees", nargs="+", default=[], help="tree sets to time (default: the adapter's)")
    parser.add_argument("--baseline", action="store_true", help="also time the one-row step")
    parser.add_argument("--contexts", type=int, nargs="+", default=[300], help="prompt tokens before the timed steps")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--random_weights", default=None, metavar="CONFIG_DIR",
                        help="a folder with config.json: random weights and prompt tokens instead of a real model")
    parser.add_argument("--budget_s", type=float, default=None, help="skip what is left after this many seconds")
    parser.add_argument("--output", default=None)
    return parser


def _random_decoder(args) -> tuple[Decoder, str]:
    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch.device(args.device) if args.device else default_device()
    dtype = resolve_dtype(args.dtype, device)
    config = AutoConfig.from_pretrained(args.random_weights)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    model.requires_grad_(False)
    hidden = config.hidden_size
    tokens = PromptTokens(PromptTokenConfig(hidden_size=hidden, vocab_size=config.vocab_size, base_model="random"),
                          torch.randn(3, hidden) * 0.02)
    return Decoder(model, tokens, max_seq_len=args.max_seq_len), f"random weights ({args.random_weights})"


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.random_weights:
        decoder, source = _random_decoder(args)
    else:
        loaded = load_decoder_or_exit(args)
        decoder, source = loaded.decoder, loaded.info.model_id
    decoders = ({name: decoder.with_trees(trees)
                 for name, trees in tree_files(args.trees, args.tree_choice, args.lookup).items()}
                or {"adapter's tree": decoder})
    start = time.perf_counter()
    results = []
    for mode in args.modes:
        jobs = ([("baseline (1 row)", decoder, "baseline")] if args.baseline else []) + [
            (name, d, "ppd") for name, d in decoders.items()]
        for context, (name, d, method) in ((c, job) for c in args.contexts for job in jobs):
            row = {"mode": mode, "context": context, "tree": name}
            if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
                results.append({**row, "skipped": "time budget spent"})
                continue
            try:
                with torch.no_grad():
                    row.update(step_time(d, method, context, args.steps, mode))
            except Exception as error:  # one mode failing must not hide the others' figures
                traceback.print_exc()
                row["error"] = f"{type(error).__name__}: {error}"[:500]
            results.append(row)
            print(row, flush=True)
    print(f"\n{source}, {decoder.dtype}")
    print("| mode | context | tree | rows | step ms | warm-up s (compile + capture) |\n|---|---|---|---|---|---|")
    for r in results:
        if "step_ms" in r:
            print(f"| {r['mode']} | {r['context']} | {r['tree']} | {r['rows']} | {r['step_ms']:.2f} | "
                  f"{r['warmup_s']:.1f} |")
        else:
            print(f"| {r['mode']} | {r['context']} | {r['tree']} | - | {r.get('error') or r.get('skipped')} | - |")
    if args.output:
        write_json(args.output, {"model": source, "contexts": args.contexts, "dtype": str(decoder.dtype),
                                 **environment(decoder.device), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
