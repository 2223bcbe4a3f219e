"""Decoder throughput by batch size: PPD (the adapter's batch policy, or fixed trees) against the engine's
baseline, on real prompts, in one run.

Usage:
    python -m eval.batch_speed --batch_sizes 1 2 4 8 16 32 64 128 --bench mt_bench --max_new_tokens 256 \\
        --dtype bfloat16 --output results/serving/batch_speed_h200.json --plot results/serving/batch_speed_h200.png \\
        [--trees results/trees/h200/trees/tree_64.json]

Batch B decodes the first max(B, P) first-turn prompts of the benchmark (``--prompts`` P, default 32; cycled
past its end, and rounded up to whole batches), each in the model's chat template, as static batches of B
(``Decoder.generate``) one after another: throughput is every row's new tokens over the wall time of those
batches, each until its last row stops. A small batch thus still decodes many prompts: one prompt's accept
length is no measure of a benchmark's (MT-Bench's first question replays 1.98 tokens a step with the 64-row
tree, its 80 first turns 2.32). ``ppd`` is the decoder as loaded (the adapter's batch policy when it
ships one for this device and dtype: its tree for each bucket, or the one-row step); each ``--trees``
file adds a ``ppd:<file>`` variant verifying every batch with that one tree set. Each batch size is
warmed up untimed first, every variant (capture and compilation, and one short generation) before any is
timed; then each batch of prompts is decoded by every variant in turn before the next batch, so that a
machine's drift falls on all variants alike. Each row also splits the wall time: the prefills' (until each
batch's prefill is read back) and the rest per forward pass (each batch's longest row's passes, host loop
included), and how long its batches waited for their slowest rows: ``passes`` (the batches' longest rows' steps,
summed) against ``mean_row_steps`` (a row's steps, averaged) times the number of batches. Greedy outputs of every
variant are compared with the baseline's. Writes JSON, a table and a plot of the speed-up by batch size.

``--batching continuous`` measures what a server sustains instead: the serving engine's batcher
(``ppd.serving.ContinuousBatcher``, as ``application.serve`` runs it) with B rows is handed max(P, 4B) prompts
at once, and each row that finishes takes the next waiting prompt (its prefill between two steps), so the
batch stays full but for the last prompts' drain, and no row waits for a batch's slowest. Throughput is every
prompt's new tokens over the wall time from the first submission to the last answer; each variant warms its
batcher up (every bucket up to B) and decodes one untimed round of B short answers first, then all prompts,
one variant after another. ``ms_per_pass`` is then the wall time over the batch's steps (admissions' prefills
included), ``mean_rows`` the running rows a step averaged, and ``admission_steps`` (where prefills run in a
staging row, on a GPU) the steps a joining prompt spent, on average, waiting for that row and with its prefill
in flight there before its row joined the batch.
``--batchers`` compares the batcher's own settings in the same process, so that each graph compiles once: each
``NAME=FIELD:VALUE,...`` (``BatcherConfig`` fields, e.g. ``levers=admissions:before_step,backlog:waited``;
``default`` alone for the environment's settings) runs every variant under it, named ``<variant>@NAME``, and each
speed-up is over the baseline under the same settings. ``--rounds R`` decodes the prompts R times, every variant
in turn each round (one batcher each, warmed up and started before the first), and sums them, so that drift falls
on all alike.
Each batch size's rows are written to ``--output`` as soon as they are measured: a run cut off (a time limit,
a machine taken back) keeps them, and the same command run again measures only the batch sizes missing; a
cut-off file of other settings is refused (one line, exit status 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

from ppd.cli import add_adapter_args, add_engine_args, add_model_args, load_decoder_or_exit, tree_files
from ppd.config import DecodeConfig
from ppd.serving import BatcherConfig, ContinuousBatcher
from ppd.serving.batcher import AdmissionSteps

from .benchmarks import load_benchmark
from .gen_answers import prompt_ids, turn_messages
from .records import PartialRun, SettingsMismatch, environment, run_settings


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.batch_speed", description=__doc__.split("\n")[0])
    add_model_args(parser)
    add_adapter_args(parser)
    add_engine_args(parser)
    parser.add_argument("--batch_sizes", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--bench", default="mt_bench", choices=["mt_bench", "alpaca_eval", "humaneval", "gsm8k"])
    parser.add_argument("--max_new_tokens", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=32,
                        help="prompts each batch size decodes, at least (in batches of the batch size)")
    parser.add_argument("--trees", nargs="*", default=[], help="fixed tree sets to compare with the policy")
    parser.add_argument("--batching", choices=["static", "continuous"], default="static",
                        help="static batches one after another (default), or the serving engine's continuous "
                             "batcher kept full of waiting prompts")
    parser.add_argument("--batchers", nargs="+", default=None, metavar="NAME=FIELD:VALUE,...",
                        help="continuous batching: batcher settings to compare in one process, each run with every "
                             "variant (named <variant>@NAME), e.g. default levers=admissions:before_step,"
                             f"backlog:waited; fields: {', '.join(BATCHER_FIELDS)}")
    parser.add_argument("--rounds", type=int, default=1,
                        help="continuous batching: times every variant decodes the prompts, in turn (default: 1)")
    parser.add_argument("--output", default=None, help="JSON file")
    parser.add_argument("--plot", default=None, help="PNG of the speed-up by batch size")
    return parser


# The BatcherConfig fields ``--batchers`` may set: the batch's size, queue and capture are the benchmark's own.
BATCHER_FIELDS = tuple(f.name for f in dataclasses.fields(BatcherConfig)
                       if f.name not in ("max_batch", "max_queue", "capture"))


def batcher_settings(specs: list[str]) -> dict[str, dict]:
    """``--batchers``' ``NAME=FIELD:VALUE,...`` (or ``default``) as {name: BatcherConfig fields}, each checked
    by building its config; ValueError names what is wrong."""
    types = {f.name: f.type for f in dataclasses.fields(BatcherConfig)}
    found = {}
    for spec in specs:
        name, _, fields = spec.partition("=")
        if not name or "@" in name or name in found or (not fields and name != "default"):
            raise ValueError(f"--batchers {spec!r}: expected NAME=FIELD:VALUE,... (or 'default') with a new NAME "
                             "and no '@' in it")
        settings = {}
        for item in filter(None, fields.split(",")):
            field, _, value = item.partition(":")
            if field not in BATCHER_FIELDS or not value:
                raise ValueError(f"--batchers {spec!r}: {item!r} is not FIELD:VALUE with FIELD one of "
                                 f"{', '.join(BATCHER_FIELDS)}")
            if types[field] in (bool, "bool"):
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(f"--batchers {spec!r}: {field} takes true or false, got {value!r}")
                value = value.lower() in ("true", "1")
            elif types[field] in (int, "int"):
                if not value.isdigit():
                    raise ValueError(f"--batchers {spec!r}: {field} takes a whole number, got {value!r}")
                value = int(value)
            settings[field] = value
        BatcherConfig(**settings)  # its own checks
        found[name] = settings
    return found


def baseline_of(variant: str) -> str:
    """The baseline a variant's speed-up is over: the one under the same batcher settings."""
    _, at, settings = variant.partition("@")
    return f"baseline{at}{settings}"


def prompts_for(tokenizer, bench: str, count: int) -> list[list[int]]:
    questions = load_benchmark(bench)
    return [prompt_ids(tokenizer, bench, turn_messages(questions[i % len(questions)].turns[:1], []))
            for i in range(count)]


QUEUED_ROUNDS = 4  # continuous batching: prompts handed to a batcher of B rows, at least, in multiples of B


def prompt_count(prompts: int, batch: int, continuous: bool = False) -> int:
    """Prompts batch size ``batch`` decodes: at least ``prompts`` and ``batch`` (``QUEUED_ROUNDS`` batches'
    worth, ``continuous``), in whole batches."""
    least = max(prompts, QUEUED_ROUNDS * batch if continuous else batch)
    return -(-least // batch) * batch


def variant_name(tree_file: str) -> str:
    """The name a ``--trees`` file's variant goes by in the rows: ``ppd:<file name>``."""
    return f"ppd:{Path(tree_file).name}"


def run(args: argparse.Namespace) -> tuple[dict, PartialRun]:
    """Every batch size's rows (those a cut-off run of the same settings left in ``--output`` are not measured
    again), and the record that writes them."""
    loaded = load_decoder_or_exit(args)
    decoder = loaded.decoder
    device = decoder.device
    # Each batch size is written as soon as it is measured.
    partial = PartialRun(args.output, run_settings(args, device, ("batch_sizes", "output", "plot")))
    methods = {"baseline": (decoder, "baseline"), "ppd": (decoder, "ppd")}
    for name, trees in tree_files(args.trees, args.tree_choice, args.lookup).items():
        methods[variant_name(name)] = (decoder.with_trees(trees), "ppd")
    # name: (decoder, method, BatcherConfig fields)
    variants = ({f"{name}@{label}": (*method, settings) for label, settings in args.batchers.items()
                 for name, method in methods.items()} if args.batchers else
                {name: (*method, {}) for name, method in methods.items()})
    header = {"model": loaded.info.model_id, "adapter": loaded.adapter, "tree": loaded.tree, "bench": args.bench,
              "max_new_tokens": args.max_new_tokens, "capture": args.capture,
              "batching": args.batching, "dtype": str(decoder.dtype).removeprefix("torch."), **environment(device)}
    continuous = args.batching == "continuous"
    prompts = prompts_for(loaded.tokenizer, args.bench,
                          max(prompt_count(args.prompts, b, continuous) for b in args.batch_sizes))
    for batch in args.batch_sizes:
        if len(partial.measured(batch_size=batch)) == len(variants):
            print(f"batch {batch:4d} | measured already in {args.output}", file=sys.stderr)
            continue
        count = prompt_count(args.prompts, batch, continuous)
        measure = continuous_rows if continuous else static_rows
        outputs, rows = measure(variants, prompts[:count], batch, args)
        for row in rows:
            print(f"batch {batch:4d} | {row['variant']} | {row['tokens_per_s']:9.1f} tokens/s | accept length "
                  f"{row['accept_length'] or 0:.2f} | {row['ms_per_pass']:.2f} ms a pass, "
                  + (f"{row['mean_rows']:.1f} rows a step{admissions(row['admission_steps'])}" if continuous
                     else f"prefills {row['prefill_s']:.2f} s")
                  + f" | warm-up {row['warmup_s']:.0f} s ({len(row['captures'])} graphs, the slowest "
                  f"{max((c['seconds'] for c in row['captures']), default=0):.0f} s)", file=sys.stderr)
        speeds = {r["variant"]: r["tokens_per_s"] for r in rows}
        for row in rows:
            baseline = baseline_of(row["variant"])
            row["identical_to_baseline"] = sum(a == b for a, b in zip(outputs[row["variant"]], outputs[baseline])
                                               ) / count
            row["speedup"] = row["tokens_per_s"] / speeds[baseline]
        partial.add(rows, header)
    rows = [r for batch in args.batch_sizes for r in partial.measured(batch_size=batch)]
    return {**header, "rows": rows}, partial


def captured_since(decoder, before: int) -> list[dict]:
    """The graphs ``decoder`` captured after its first ``before`` (the first of a step kind compiles it)."""
    return [{"tree": c.kind.tree, "batch_size": c.batch_size, "width": c.width, "seconds": c.seconds}
            for c in decoder.captures[before:]]


def admissions(steps: dict) -> str:
    """``admission_steps`` in words, where prompts joined through a staging row."""
    if not steps["admissions"]:
        return ""
    return (f", {steps['admissions']} joined after {steps['waiting']:.1f} steps waiting and "
            f"{steps['in_flight']:.1f} in flight")


def result_row(batch: int, name: str, decoder, method: str, count: int, outs: list, wall: float,
               args: argparse.Namespace, **timing) -> dict:
    tokens = sum(o.new_tokens for o in outs)
    steps = sum(o.steps for o in outs)
    tables = (decoder.tables_for_batch(batch, args.capture, static=args.batching == "static")
              if method == "ppd" else None)
    return {"batch_size": batch, "variant": name, "batching": args.batching,
            "tree_rows": tables.num_rows if tables else 1, "prompts": count, "new_tokens": tokens,
            "wall_time_s": wall, "tokens_per_s": tokens / wall, "accept_length": tokens / steps if steps else None,
            **timing}


def static_rows(variants: dict, prompts: list[list[int]], batch: int,
                args: argparse.Namespace) -> tuple[dict, list[dict]]:
    """Each variant's greedy outputs and row, decoding ``prompts`` as static batches of ``batch``."""
    batches = [prompts[i: i + batch] for i in range(0, len(prompts), batch)]
    # Every variant compiles and captures first. The timed batches then take turns: each batch of prompts
    # is decoded by every variant before the next, so that the machine's drift, and whatever follows a
    # compilation, fall on all variants alike.
    warmups = {}
    for name, (dec, method, _) in variants.items():
        before = len(dec.captures)
        seconds = dec.warmup(batch_sizes=[batch], methods=[method], capture=args.capture)
        warmups[name] = (seconds, captured_since(dec, before))
        dec.generate(batches[0], DecodeConfig(method=method, max_new_tokens=8, capture=args.capture))
    configs = {name: DecodeConfig(method=method, max_new_tokens=args.max_new_tokens, capture=args.capture)
               for name, (_, method, _) in variants.items()}
    outs = {name: [] for name in variants}
    walls = dict.fromkeys(variants, 0.0)
    prefills = dict.fromkeys(variants, 0.0)  # each batch's time to its prefill's read-back
    passes = dict.fromkeys(variants, 0)  # forward passes after the prefill: each batch's longest row's
    for inputs in batches:
        for name, (dec, _, _) in variants.items():
            start = time.perf_counter()
            out = dec.generate(inputs, configs[name])
            walls[name] += time.perf_counter() - start
            outs[name] += out
            prefills[name] += out[0].prefill_time_s
            passes[name] += max(o.steps for o in out)
    rows = [result_row(batch, name, dec, method, len(prompts), outs[name], walls[name], args,
                       warmup_s=warmups[name][0], captures=warmups[name][1], prefill_s=prefills[name],
                       ms_per_pass=1e3 * (walls[name] - prefills[name]) / max(passes[name], 1),
                       max_steps=max(o.steps for o in outs[name]), passes=passes[name],
                       mean_row_steps=sum(o.steps for o in outs[name]) / len(outs[name]))
            for name, (dec, method, _) in variants.items()]
    return {name: [o.token_ids for o in outs[name]] for name in variants}, rows


def continuous_rows(variants: dict, prompts: list[list[int]], batch: int,
                    args: argparse.Namespace) -> tuple[dict, list[dict]]:
    """Each variant's greedy outputs (its first round's) and row, decoding ``prompts`` through a continuous
    batcher of ``batch`` rows, ``args.rounds`` times (see the module docstring)."""
    batchers, warmups = {}, {}
    try:
        # Every batcher is warmed up before any starts: the first to start freezes the heap with every warm-up's
        # objects in it, so that the collector walks the same heap whichever variant runs.
        for name, (dec, method, settings) in variants.items():
            batchers[name] = ContinuousBatcher(dec, BatcherConfig(max_batch=batch, max_queue=len(prompts),
                                                                  capture=args.capture, **settings))
            before = len(dec.captures)
            warmups[name] = (batchers[name].warmup(methods=(method,)), captured_since(dec, before))
        for name, (_, method, _) in variants.items():
            short = DecodeConfig(method=method, max_new_tokens=8, capture=args.capture)
            for stream in [batchers[name].start().submit(ids, short) for ids in prompts[:batch]]:
                stream.result()
            batchers[name].admission_steps = AdmissionSteps()  # the timed prompts' admissions only
        steps_before = {name: batcher.batch_steps for name, batcher in batchers.items()}
        runs = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, (_, method, _) in variants.items():
                runs[name].append(timed_run(batchers[name], prompts, DecodeConfig(
                    method=method, max_new_tokens=args.max_new_tokens, capture=args.capture)))
    finally:
        for batcher in batchers.values():
            batcher.close()
    rows = []
    for name, (dec, method, settings) in variants.items():
        outs = [o for run in runs[name] for o in run["outs"]]
        wall, steps = sum(r["wall"] for r in runs[name]), batchers[name].batch_steps - steps_before[name]
        rows.append(result_row(batch, name, dec, method, len(prompts), outs, wall, args, warmup_s=warmups[name][0],
                               captures=warmups[name][1], ms_per_pass=1e3 * wall / max(steps, 1),
                               mean_rows=sum(o.steps for o in outs) / max(steps, 1),
                               admission_steps=batchers[name].admission_steps.means(), batcher=settings,
                               rounds=args.rounds, round_tokens_per_s=[sum(o.new_tokens for o in r["outs"]) / r["wall"]
                                                                       for r in runs[name]]))
    return {name: [o.token_ids for o in runs[name][0]["outs"]] for name in variants}, rows


def timed_run(batcher: ContinuousBatcher, prompts: list[list[int]], config: DecodeConfig) -> dict:
    """One timed round: every prompt submitted to a started ``batcher`` at once; its answers and wall time."""
    start = time.perf_counter()
    outs = [stream.result() for stream in [batcher.submit(ids, config) for ids in prompts]]
    return {"outs": outs, "wall": time.perf_counter() - start}


def table(result: dict) -> str:
    variants = list(dict.fromkeys(r["variant"] for r in result["rows"]))
    speedups = [v for v in variants if v != baseline_of(v)]
    lines = ["| batch | " + " | ".join(f"{v} tokens/s" for v in variants) + " | "
             + " | ".join(f"{v} speed-up (rows, accept length)" for v in speedups) + " |",
             "|---" * (1 + len(variants) + len(speedups)) + "|"]
    for batch in dict.fromkeys(r["batch_size"] for r in result["rows"]):
        here = {r["variant"]: r for r in result["rows"] if r["batch_size"] == batch}
        cells = [f"{here[v]['tokens_per_s']:.0f}" for v in variants]
        cells += [f"{here[v]['speedup']:.2f}x ({here[v]['tree_rows']}, {here[v]['accept_length'] or 0:.2f})"
                  for v in speedups]
        lines.append(f"| {batch} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for variant in dict.fromkeys(r["variant"] for r in result["rows"]):
        if variant == baseline_of(variant):
            continue
        here = sorted((r for r in result["rows"] if r["variant"] == variant), key=lambda r: r["batch_size"])
        ax.plot([r["batch_size"] for r in here], [r["speedup"] for r in here], marker="o", label=variant)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="baseline")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("throughput / baseline")
    ax.set_title(f"{result['model']}, {result['dtype']}, {result['device']}, "
                 f"{result.get('batching', 'static')} batching", fontsize=10)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.prompts < 1:
        parser.error("--prompts must be at least 1")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.batching != "continuous" and (args.batchers or args.rounds != 1):
        parser.error("--batchers and --rounds apply to --batching continuous")
    if args.batchers:
        try:
            args.batchers = batcher_settings(args.batchers)
        except ValueError as error:
            parser.error(str(error))
    try:
        with torch.no_grad():
            result, partial = run(args)
    except SettingsMismatch as error:
        print(f"batch_speed: error: {error}", file=sys.stderr)
        return 2
    print(f"{result['model']} ({result['adapter']}, {result['tree']}) on {result['device']}, {result['dtype']}, "
          f"{result['bench']}, max_new_tokens={result['max_new_tokens']}, {result['batching']} batching")
    print(table(result))
    partial.finish({**result, "command": " ".join(["python -m eval.batch_speed", *(argv or sys.argv[1:])])})
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
