"""Sampling with ppd: lossless verification against typical acceptance and the baseline, per temperature.

Usage:
    python -m eval.sampling --bench mt_bench --temperatures 0.7 1.0 --max_new_tokens 256 \\
        --output_dir results/sampling/h100 [--limit K] [--top_p P] [--top_k K] [--seed S] \\
        [-- any further eval.gen_answers flags, e.g. --dtype bfloat16 --capture compiled_graph]

One run answers the benchmark (MT-Bench: both turns) with greedy ppd and the greedy baseline (temperature
0, the reference accept length), then, at each temperature, with the engine's baseline, ppd with lossless
verification (the default) and ppd with typical acceptance, one after another through ``eval.gen_answers``
(its warm-ups, records and resumption) on one decoder loaded once, so that every step kind is compiled
and captured once for the whole run. Answers go to
``OUTPUT_DIR/answers/{bench}-{variant}-t{temperature}.jsonl``; a run started again skips the answers
already there.

Writes ``OUTPUT_DIR/summary.json`` and ``summary.md``: per temperature and variant, answers, new tokens,
tokens/s (sum of new tokens / sum of wall time), accept length (new tokens / decoding steps), tokens/s over
the baseline's at the same temperature, and accept length as a share of greedy ppd's; and
``accept_length.png``, accept length and speed-up by temperature.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ppd.cli import load_decoder_or_exit
from ppd.config import DecodeConfig

from . import gen_answers
from .benchmarks import BENCHMARKS
from .records import write_summary
from .report import read_records, speed_totals

# name -> (gen_answers method, acceptance); greedy runs have no acceptance rule.
VARIANTS = {"baseline": ("baseline", "lossless"), "ppd_lossless": ("ppd", "lossless"),
            "ppd_typical": ("ppd", "typical")}
GREEDY_VARIANTS = {"baseline": ("baseline", "lossless"), "ppd": ("ppd", "lossless")}


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.sampling", description=__doc__.split("\n")[0])
    parser.add_argument("--bench", default="mt_bench", choices=BENCHMARKS)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--top_k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max_new_tokens", type=int, default=256)
    parser.add_argument("--limit", type=int, default=None, help="the first K questions only")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("gen_answers_args", nargs="*", help="after --: passed to every eval.gen_answers run")
    return parser


def runs(args: argparse.Namespace) -> list[tuple[float, str, str, str]]:
    """(temperature, variant, method, acceptance) of every run, greedy first."""
    planned = [(0.0, name, method, acceptance) for name, (method, acceptance) in GREEDY_VARIANTS.items()]
    for temperature in args.temperatures:
        planned += [(temperature, name, method, acceptance) for name, (method, acceptance) in VARIANTS.items()]
    return planned


def answers_path(args: argparse.Namespace, temperature: float, variant: str) -> Path:
    return Path(args.output_dir) / "answers" / f"{args.bench}-{variant}-t{temperature:g}.jsonl"


def gen_answers_argv(args: argparse.Namespace, temperature: float, method: str, acceptance: str) -> list[str]:
    argv = ["--bench", args.bench, "--method", method, "--model", args.model, "--temperature", str(temperature),
            "--top_p", str(args.top_p), "--top_k", str(args.top_k), "--acceptance", acceptance,
            "--seed", str(args.seed), "--max_new_tokens", str(args.max_new_tokens)]
    if args.limit is not None:
        argv += ["--limit", str(args.limit)]
    return argv + list(args.gen_answers_args)


def totals(path: Path) -> dict:
    records = read_records([str(path)])
    return {**speed_totals(records), "environment": records[0].get("environment") if records else None,
            "dtype": records[0].get("dtype") if records else None}


def summarise(args: argparse.Namespace) -> list[dict]:
    rows = [{"temperature": t, "variant": v, **totals(answers_path(args, t, v))} for t, v, _, _ in runs(args)]
    greedy_ppd = next(r for r in rows if r["temperature"] == 0 and r["variant"] == "ppd")
    for row in rows:
        base = next(r for r in rows if r["temperature"] == row["temperature"] and r["variant"] == "baseline")
        row["speedup_vs_baseline"] = (row["tokens_per_s"] / base["tokens_per_s"]
                                      if row["tokens_per_s"] and base["tokens_per_s"] else None)
        row["accept_vs_greedy_ppd"] = (row["accept_length"] / greedy_ppd["accept_length"]
                                       if row["variant"] != "baseline" and greedy_ppd["accept_length"] else None)
    return rows


def table(rows: list[dict]) -> str:
    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    lines = ["| temperature | variant | answers | tokens/s | accept length | vs baseline | accept / greedy ppd |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['temperature']:g} | {r['variant']} | {r['answers']} | {fmt(r['tokens_per_s'], '.1f')} | "
                     f"{fmt(r['accept_length'], '.2f')} | {fmt(r['speedup_vs_baseline'], '.2f')}x | "
                     f"{fmt(r['accept_vs_greedy_ppd'], '.0%')} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = sorted({r["temperature"] for r in rows if r["temperature"] > 0})
    figure, (accept, speed) = plt.subplots(1, 2, figsize=(10, 4))
    greedy = next(r for r in rows if r["temperature"] == 0 and r["variant"] == "ppd")
    for variant, marker in (("ppd_lossless", "o"), ("ppd_typical", "s")):
        chosen = [next(r for r in rows if r["temperature"] == t and r["variant"] == variant) for t in temperatures]
        accept.plot(temperatures, [r["accept_length"] for r in chosen], marker=marker, label=variant)
        speed.plot(temperatures, [r["speedup_vs_baseline"] for r in chosen], marker=marker, label=variant)
    accept.axhline(greedy["accept_length"], color="grey", linestyle="--", label="greedy ppd")
    accept.axhline(0.85 * greedy["accept_length"], color="grey", linestyle=":", label="85% of greedy")
    speed.axhline(1.0, color="black", linewidth=0.8)
    accept.set(xlabel="temperature", ylabel="accept length (tokens per step)")
    speed.set(xlabel="temperature", ylabel="tokens/s over the baseline's")
    for axis in (accept, speed):
        axis.legend()
        axis.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        for temperature in args.temperatures:
            if temperature <= 0:
                raise ValueError(f"--temperatures are the sampled ones (> 0; greedy always runs), got {temperature}")
            DecodeConfig(temperature=temperature, top_p=args.top_p, top_k=args.top_k, max_new_tokens=args.max_new_tokens)
    except ValueError as error:
        parser.error(str(error))
    planned = [(t, v, gen_answers_argv(args, t, m, a) + ["--output", str(answers_path(args, t, v))])
               for t, v, m, a in runs(args)]
    ppd_argv = next(argv for t, v, argv in planned if v == "ppd")
    loaded = load_decoder_or_exit(gen_answers.make_parser().parse_args(ppd_argv), with_prompt_tokens=True)
    for temperature, variant, run_argv in planned:
        print(f"== {args.bench}, temperature {temperature:g}: {variant} -> {run_argv[-1]}", file=sys.stderr, flush=True)
        status = gen_answers.main(run_argv, loaded)
        if status:
            return status
    rows = summarise(args)
    output = Path(args.output_dir)
    env = rows[0].pop("environment") or {}
    for row in rows[1:]:
        row.pop("environment")
    settings = {key: getattr(args, key) for key in ("bench", "model", "temperatures", "top_p", "top_k", "seed",
                                                    "max_new_tokens", "limit", "gen_answers_args")}
    write_summary(output, {"settings": settings, "command": "python -m eval.sampling " + " ".join(
        argv if argv is not None else sys.argv[1:]), "environment": env, "rows": rows}, table(rows))
    plot(rows, output / "accept_length.png", f"{args.bench}, {env.get('device', 'unknown device')}, {rows[0]['dtype']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
