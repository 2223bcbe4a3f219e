"""Time of one decoding step, as the engine runs it, for tree sets of any size and the one-row baseline.

Usage:
    python -m eval.step_latency --trees results/trees/h200/trees/tree_*.json [--baseline] \\
        --context 300 --capture compiled_graph --dtype bfloat16 --output results/core/step_latency_h200.json \\
        [--batch_size 16] [--attention flex]

Each measurement decodes a prompt of ``--context`` tokens with the decoder's own loop (the step compiled
and captured as ``--capture`` says, the one host read-back per step included) and takes the time per
step from the time between the prefill's read-back and the end of the run, so the prefill drops out.
Capturing (and compiling) happens in an untimed warm-up and its seconds are reported beside the step time.
Writes JSON and a table.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator

import torch

from ppd.cli import add_adapter_args, add_engine_args, add_model_args, load_decoder_or_exit, tree_files
from ppd.config import DecodeConfig
from ppd.decoder import Decoder

from .records import environment, write_json


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.step_latency", description=__doc__.split("\n")[0])
    add_model_args(parser)
    add_adapter_args(parser)
    add_engine_args(parser)
    parser.add_argument("--trees", nargs="*", default=[], help="tree-set JSON files to time (default: the adapter's)")
    parser.add_argument("--baseline", action="store_true", help="also time the one-row autoregressive step")
    parser.add_argument("--context", type=int, default=300, help="prompt tokens before the timed steps")
    parser.add_argument("--steps", type=int, default=64, help="timed steps per measurement")
    parser.add_argument("--batch_size", type=int, default=1, help="rows decoded together (the same prompt)")
    parser.add_argument("--output", default=None)
    return parser


def timing_prompt(decoder: Decoder, context: int) -> list[int]:
    """The ``context`` token ids a timed or profiled step follows (any ids do: a step's cost depends on the
    lengths, not on the text)."""
    vocab = decoder.model.config.vocab_size
    return [(31 * i + 7) % vocab for i in range(context)]


def tree_decoders(loaded, names: list[str], choice: str | None = None,
                  lookup: int | None = None) -> Iterator[tuple[str, Decoder]]:
    """(name, decoder) for each tree-set file named (candidates chosen as ``choice`` says and a lookup chain of
    ``lookup`` nodes, where given), each a decoder of the loaded model over it; with none named, the loaded
    decoder and the tree set it came with."""
    if not names:
        yield loaded.tree, loaded.decoder
    for name, trees in tree_files(names, choice, lookup).items():
        yield name, loaded.decoder.with_trees(trees)


def step_time(decoder: Decoder, method: str, context: int, steps: int, capture: str = "auto",
              batch_size: int = 1) -> dict:
    """Seconds per step of ``method`` after ``context`` tokens for a batch of ``batch_size`` rows, and
    seconds spent capturing (untimed)."""
    prompt = timing_prompt(decoder, context)

    def run(n: int):
        config = DecodeConfig(method=method, max_new_tokens=n, stop_on_eos=False, capture=capture)
        start = time.perf_counter()
        out = decoder.generate([prompt] * batch_size, config)
        return time.perf_counter() - start, out

    captured = decoder.captures[:]
    warmup, _ = run(steps * 2)  # compiles and captures every width the timed run reaches
    _, out = run(steps)
    # From the prefill's read-back to the end: the steps alone, each with its one host read-back, timed in
    # one run (two runs of different lengths would add the jitter of two long prefills to the difference).
    per_step = (out[0].wall_time_s - out[0].prefill_time_s) / max(max(o.steps for o in out), 1)
    new = [c for c in decoder.captures if c not in captured]
    return {"method": method, "rows": decoder.tables.num_rows if method == "ppd" else 1, "batch_size": batch_size,
            "step_ms": 1e3 * per_step, "warmup_s": warmup, "captures": len(new),
            "capture_s": sum(c.seconds for c in new)}


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    loaded = load_decoder_or_exit(args)
    decoder = loaded.decoder
    results = []
    with torch.no_grad():
        if args.baseline:
            results.append({"tree": "baseline (1 row)", **step_time(decoder, "baseline", args.context, args.steps,
                                                                    args.capture, args.batch_size)})
        for name, decoder in tree_decoders(loaded, args.trees, args.tree_choice, args.lookup):
            results.append({"tree": name, **step_time(decoder, "ppd", args.context, args.steps, args.capture,
                                                      args.batch_size)})
    print("| tree | rows | step ms | capture s |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['tree']} | {r['rows']} | {r['step_ms']:.2f} | {r['capture_s']:.1f} |")
    if args.output:
        write_json(args.output, {"model": loaded.info.model_id, "context": args.context, "capture": args.capture,
                                 "batch_size": args.batch_size, "attention": decoder.attention.value,
                                 "dtype": str(decoder.dtype), **environment(decoder.device), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
