"""ppd against the engine's baseline on a CPU, per dtype, and against the engine as it ran before its CPU path.

Usage:
    python -m eval.cpu_speed --bench mt_bench --limit 20 --max_new_tokens 128 --output_dir results/cpu/xeon2 \\
        [--dtypes float32 bfloat16] [--capture compile] [--tree FILE]

One run answers the benchmark (MT-Bench: both turns; greedy) with, one after another:

- ``reference``: the engine's float32 baseline as it ran before the CPU path (eager, plain weights), the
  figure the CPU path is measured against; in float32 its answers are transformers' greedy answers;
- for each dtype, the engine's baseline and ppd in the default CPU configuration (``--capture``, packed
  weights where available), one decoder per dtype, so that each step kind compiles once.

Answers go to ``OUTPUT_DIR/answers/{bench}-{variant}.jsonl`` through ``eval.gen_answers`` (warm-ups,
records, resumption: a run started again skips the answers already there). Writes ``summary.json`` and
``summary.md``: per variant, tokens/s (sum of new tokens / sum of wall time), accept length, the speed-up
over the same dtype's baseline and over ``reference``, and the share of answers identical, token for token,
to the same dtype's baseline and to ``reference``; and ``speed.png``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ppd.cli import load_decoder_or_exit

from . import gen_answers
from .benchmarks import BENCHMARKS
from .records import write_summary
from .report import identical_share, read_records, speed_totals

REFERENCE = "reference"


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.cpu_speed", description=__doc__.split("\n")[0])
    parser.add_argument("--bench", default="mt_bench", choices=BENCHMARKS)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--capture", default="compile", choices=["eager", "compile"],
                        help="how the CPU path runs its steps (default: %(default)s)")
    parser.add_argument("--tree", default=None, help="tree set for ppd (default: the adapter's for the CPU and dtype)")
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=20, help="the first K questions (default: %(default)s)")
    parser.add_argument("--output_dir", required=True)
    return parser


def planned_runs(args: argparse.Namespace) -> list[tuple[str, str, list[str]]]:
    """(variant, group, gen_answers flags) of every run; runs of one group share one loaded decoder."""
    common = ["--bench", args.bench, "--model", args.model, "--device", "cpu", "--max_new_tokens",
              str(args.max_new_tokens), "--limit", str(args.limit)]
    runs = [(REFERENCE, REFERENCE, common + ["--method", "baseline", "--dtype", "float32", "--capture", "eager",
                                             "--packed_weights", "off"])]
    for dtype in args.dtypes:
        engine = ["--dtype", dtype, "--capture", args.capture] + (["--tree", args.tree] if args.tree else [])
        runs += [(f"{dtype}_{method}", dtype, common + ["--method", method] + engine) for method in ("baseline", "ppd")]
    return [(variant, group, argv + ["--output", str(answers_path(args, variant))]) for variant, group, argv in runs]


def answers_path(args: argparse.Namespace, variant: str) -> Path:
    return Path(args.output_dir) / "answers" / f"{args.bench}-{variant}.jsonl"


def summarise(args: argparse.Namespace) -> list[dict]:
    records = {variant: read_records([str(answers_path(args, variant))]) for variant, _, _ in planned_runs(args)}
    rows = []
    for variant, group, _ in planned_runs(args):
        mine = records[variant]
        first = mine[0] if mine else {}
        rows.append({"variant": variant, "dtype": first.get("dtype"), "capture": first.get("capture"),
                     "packed_weights": first.get("packed_weights"), **speed_totals(mine),
                     "environment": first.get("environment"),
                     "identical_to_dtype_baseline": identical_share(mine, records.get(f"{group}_baseline", []))[0],
                     "identical_to_reference": identical_share(mine, records[REFERENCE])[0]})
    speed = {r["variant"]: r["tokens_per_s"] for r in rows}
    for row, (variant, group, _) in zip(rows, planned_runs(args)):
        base, ref = speed.get(f"{group}_baseline"), speed[REFERENCE]
        row["speedup_vs_dtype_baseline"] = row["tokens_per_s"] / base if row["tokens_per_s"] and base else None
        row["speedup_vs_reference"] = row["tokens_per_s"] / ref if row["tokens_per_s"] and ref else None
    return rows


def table(rows: list[dict]) -> str:
    def fmt(value, spec, unit=""):
        return "-" if value is None else format(value, spec) + unit

    lines = ["| variant | capture | packed | answers | tokens/s | accept length | vs same-dtype baseline | "
             "vs reference | identical to same-dtype baseline | identical to reference |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['capture']} | {r['packed_weights']} | {r['answers']} | "
                     f"{fmt(r['tokens_per_s'], '.1f')} | {fmt(r['accept_length'], '.2f')} | "
                     f"{fmt(r['speedup_vs_dtype_baseline'], '.2f', 'x')} | {fmt(r['speedup_vs_reference'], '.2f', 'x')} | "
                     f"{fmt(r['identical_to_dtype_baseline'], '.0%')} | {fmt(r['identical_to_reference'], '.0%')} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4))
    names = [r["variant"] for r in rows]
    values = [r["tokens_per_s"] or 0 for r in rows]
    bars = axis.bar(names, values, color=["grey" if n == REFERENCE else "tab:blue" if "baseline" in n else "tab:orange"
                                          for n in names])
    for bar, row in zip(bars, rows):
        label = f"{row['speedup_vs_reference']:.2f}x" if row["speedup_vs_reference"] else ""
        axis.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    axis.set(ylabel="tokens/s", title=title)
    axis.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    loaded = {}
    for variant, group, run_argv in planned_runs(args):
        print(f"== {args.bench}: {variant} -> {run_argv[-1]}", file=sys.stderr, flush=True)
        if group not in loaded:
            loaded[group] = load_decoder_or_exit(gen_answers.make_parser().parse_args(
                [a if a != "baseline" else "ppd" for a in run_argv]), with_prompt_tokens=True)
        status = gen_answers.main(run_argv, loaded[group])
        if status:
            return status
    rows = summarise(args)
    environment = next((r["environment"] for r in rows if r["environment"]), None)
    for row in rows:
        row.pop("environment")
    settings = {key: getattr(args, key) for key in ("bench", "model", "dtypes", "capture", "tree", "max_new_tokens",
                                                    "limit")}
    write_summary(args.output_dir, {"settings": settings, "command": "python -m eval.cpu_speed " + " ".join(
        argv if argv is not None else sys.argv[1:]), "environment": environment, "rows": rows}, table(rows))
    plot(rows, Path(args.output_dir) / "speed.png",
         f"{args.bench}, first {args.limit} questions, {args.max_new_tokens} new tokens, "
         f"{(environment or {}).get('device', 'unknown device')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
