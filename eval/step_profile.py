"""Where a decoding step's time goes: the GPU kernels of the one-row step and of tree steps, per step.

Usage:
    python -m eval.step_profile --trees results/trees/h200/trees/tree_16.json --context 300 \\
        --dtype bfloat16 --output results/core/step_profile.json

For the baseline's one-row step and each tree set: an untimed warm-up (compilation and capture, as
``--capture`` says), then ``--steps`` new tokens decoded under ``torch.profiler`` after a prompt of
``--context`` tokens, the profiler started once the prefill is read back. Reports per step: the wall time,
the number of kernels and their summed device time (the rest of the wall time is the device idle between
kernels: launches, the host's read-back), and the kernels that take the most device time; on a CPU, the
operators and their own CPU time instead. Writes JSON and a markdown table; compare a tree step's lines
with the one-row step's to see what the tree adds.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict

import torch

from ppd.cli import add_adapter_args, add_engine_args, add_model_args, load_decoder_or_exit
from ppd.config import DecodeConfig
from ppd.decoder import Decoder
from ppd.decoding.loop import decode

from .records import environment, write_json
from .step_latency import timing_prompt, tree_decoders


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.step_profile", description=__doc__.split("\n")[0])
    add_model_args(parser)
    add_adapter_args(parser)
    add_engine_args(parser)
    parser.add_argument("--trees", nargs="*", default=[],
                        help="tree-set JSON files to profile (default: the adapter's)")
    parser.add_argument("--with_loaded", action="store_true",
                        help="with --trees: also profile the decoder as loaded (the adapter's tree or batch policy), "
                             "which ran the baseline's steps first, beside the files' decoders of their own")
    parser.add_argument("--context", type=int, default=300, help="prompt tokens before the profiled steps")
    parser.add_argument("--steps", type=int, default=64, help="new tokens decoded under the profiler")
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--top", type=int, default=15, help="kernels listed per step kind")
    parser.add_argument("--sequence", action="store_true",
                        help="also list, per step kind, the kernels of one profiled step in the order they ran "
                             "(the step in the middle of the profiled ones), to see what each layer launches")
    parser.add_argument("--output", default=None)
    return parser


def kernels_per_step(events, on_cpu: bool, steps: int) -> list[list]:
    """``[name, calls, microseconds]`` per step of each device kernel in profiler ``events`` (``on_cpu``: of each
    host operator, by its own CPU time), the most time first."""
    table: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in events:
        if (event.device_type == torch.autograd.DeviceType.CPU) == on_cpu:
            entry = table[event.name]
            entry[0] += 1
            entry[1] += event.self_cpu_time_total if on_cpu else event.time_range.elapsed_us()
    return sorted(([name, count / steps, total / steps] for name, (count, total) in table.items()),
                  key=lambda r: -r[2])


def one_step_sequence(events, per_step: float, steps: int) -> list[str]:
    """The device kernels of one step among ``steps`` profiled ones, in the order they started: the middle step's,
    cut from the time-ordered kernels by ``per_step``, the mean count a step (steps launch the same kernels, so
    the cut falls on a step's first kernel up to the few that vary, such as a sort's passes)."""
    kernels = sorted((e for e in events if e.device_type != torch.autograd.DeviceType.CPU),
                     key=lambda e: e.time_range.start)
    count = round(per_step)
    first = steps // 2 * count
    return [e.name for e in kernels[first:first + count]]


def profile_steps(decoder: Decoder, method: str, args: argparse.Namespace) -> dict:
    """Kernels per step of ``method`` (see the module docstring)."""
    batch = [timing_prompt(decoder, args.context)] * args.batch_size

    def config(n: int) -> DecodeConfig:
        return DecodeConfig(method=method, max_new_tokens=n, stop_on_eos=False, capture=args.capture)

    decoder.generate(batch, config(args.steps * 2))  # compiles and captures
    activities = [torch.profiler.ProfilerActivity.CPU]
    if decoder.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities)
    progress, start = None, None
    for progress in decode(decoder, batch, config(args.steps)):
        if start is None:  # the prefill is read back: profile the steps alone
            profiler.start()
            start = time.perf_counter()
    if decoder.device.type == "cuda":
        torch.cuda.synchronize(decoder.device)
    wall = time.perf_counter() - start
    profiler.stop()
    steps = max(max(progress.steps), 1)
    # on a CPU the operators' own CPU time stands for the kernels'
    events = profiler.events()
    rows = kernels_per_step(events, decoder.device.type == "cpu", steps)
    tables = decoder.tables_for_batch(len(batch), args.capture) if method == "ppd" else None
    result = {"method": method, "rows": tables.num_rows if tables is not None else 1, "steps": steps,
              "wall_us_per_step": 1e6 * wall / steps, "kernels_per_step": sum(r[1] for r in rows),
              "device_us_per_step": sum(r[2] for r in rows),
              "top": [{"kernel": n, "calls_per_step": c, "us_per_step": t} for n, c, t in rows[: args.top]]}
    if args.sequence and decoder.device.type != "cpu":
        result["sequence"] = one_step_sequence(events, result["kernels_per_step"], steps)
    return result


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    loaded = load_decoder_or_exit(args)
    results = []
    with torch.no_grad():
        results.append({"tree": "baseline (1 row)", **profile_steps(loaded.decoder, "baseline", args)})
        if args.with_loaded and args.trees:
            results.append({"tree": f"{loaded.tree} (as loaded)", **profile_steps(loaded.decoder, "ppd", args)})
        for name, decoder in tree_decoders(loaded, args.trees, args.tree_choice, args.lookup):
            results.append({"tree": name, **profile_steps(decoder, "ppd", args)})
    print("| tree | rows | wall us/step | kernels/step | device us/step |\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r['tree']} | {r['rows']} | {r['wall_us_per_step']:.0f} | {r['kernels_per_step']:.0f} | "
              f"{r['device_us_per_step']:.0f} |")
    for r in results:
        print(f"\n{r['tree']}: top kernels per step\n| kernel | calls | us |\n|---|---|---|")
        for k in r["top"]:
            print(f"| {k['kernel'][:90]} | {k['calls_per_step']:.1f} | {k['us_per_step']:.1f} |")
    if args.output:
        write_json(args.output, {"model": loaded.info.model_id, "context": args.context, "capture": args.capture,
                                 "batch_size": args.batch_size, "attention": loaded.decoder.attention.value,
                                 "dtype": str(loaded.decoder.dtype), **environment(loaded.decoder.device),
                                 "command": " ".join(["python -m eval.step_profile", *(argv or sys.argv[1:])]),
                                 "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
