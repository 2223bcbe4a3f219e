"""Tables of speed and quality from ``eval.gen_answers`` JSONL files: markdown, JSON and a PNG chart.

Usage:
    python -m eval.report results/answers/*.jsonl --output_dir results/report

Per benchmark, dtype and method: answers, tokens/s (sum of new tokens / sum of wall time), accept length
(new tokens / decoding steps), speed-up over ``hf_static`` (the strongest transformers baseline),
``baseline``, ``hf`` and ``pld`` on the same benchmark in the same dtype, the share of answers
token-identical to the baseline's (same question, turn and run), HumanEval pass@1 (every completion run
against its tests in its own process, with a time limit) and GSM8K accuracy.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .benchmarks import load_benchmark
from .grading import gsm8k_correct, humaneval_completion, humaneval_passes
from .records import write_json

METHOD_ORDER = ("hf", "pld", "hf_static", "baseline", "ppd")
SPEEDUP_REFERENCES = ("hf_static", "baseline", "hf", "pld")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.report", description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", help="JSONL files written by eval.gen_answers")
    parser.add_argument("--output_dir", default=None, help="write report.md, report.json and report.png here")
    parser.add_argument("--timeout_s", type=float, default=10.0, help="HumanEval time limit per program")
    return parser


def read_records(files: list[str]) -> list[dict]:
    records = []
    for name in files:
        for number, line in enumerate(Path(name).read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise ValueError(f"{name}:{number} is not JSON ({error})") from None
    return records


def _key(record: dict) -> tuple:
    return record["question_id"], record["turn"], record.get("run", 0)


def _dtype(record: dict) -> str:
    """Records of runs before dtypes were recorded say nothing: they form their own group ("-")."""
    return record.get("dtype") or "-"


def quality(bench: str, records: list[dict], timeout_s: float) -> float | None:
    """HumanEval pass@1 or GSM8K accuracy of these answers (first runs only); None for other benchmarks."""
    if bench not in ("humaneval", "gsm8k"):
        return None
    questions = {q.question_id: q for q in load_benchmark(bench)}
    first = [r for r in records if r.get("run", 0) == 0 and r["turn"] == 0]
    if not first:
        return None
    if bench == "gsm8k":
        return sum(gsm8k_correct(r["text"], questions[r["question_id"]].reference["answer"]) for r in first) / len(first)

    def passes(record: dict) -> bool:
        ref = questions[record["question_id"]].reference
        return humaneval_passes(ref["prompt"], humaneval_completion(record["text"]), ref["test"], ref["entry_point"],
                                timeout_s)

    with ThreadPoolExecutor(max_workers=4) as pool:
        return sum(pool.map(passes, first)) / len(first)


def summarise(records: list[dict], timeout_s: float = 10.0) -> list[dict]:
    groups: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for record in records:
        groups[(record["bench"], _dtype(record), record["method"])].append(record)
    rows = []
    for (bench, dtype, method), group in groups.items():
        tokens = sum(r["new_tokens"] for r in group)
        wall = sum(r["wall_time_s"] for r in group)
        steps = sum(r["steps"] for r in group)
        rows.append({"bench": bench, "dtype": dtype, "method": method, "answers": len(group), "new_tokens": tokens,
                     "wall_time_s": wall, "tokens_per_s": tokens / wall if wall else None,
                     "accept_length": tokens / steps if steps else None,
                     "startup_s": max((r.get("startup_s") or 0.0) for r in group),
                     "quality": quality(bench, group, timeout_s)})
    for row in rows:
        setting = (row["bench"], row["dtype"])
        same = {r["method"]: r for r in rows if (r["bench"], r["dtype"]) == setting}
        for reference in SPEEDUP_REFERENCES:
            other = same.get(reference)
            row[f"speedup_vs_{reference}"] = (row["tokens_per_s"] / other["tokens_per_s"]
                                              if other and other["tokens_per_s"] and row["tokens_per_s"] else None)
        baseline = {_key(r): r["token_ids"] for r in groups.get((*setting, "baseline"), [])}
        mine = [r for r in groups[(*setting, row["method"])] if _key(r) in baseline]
        row["identical_to_baseline"] = (sum(r["token_ids"] == baseline[_key(r)] for r in mine) / len(mine)
                                        if mine else None)
        row["compared_with_baseline"] = len(mine)
    order = {m: i for i, m in enumerate(METHOD_ORDER)}
    return sorted(rows, key=lambda r: (r["bench"], r["dtype"], order.get(r["method"], len(order)), r["method"]))


def _fmt(value, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def markdown(rows: list[dict]) -> str:
    vs = " | ".join(f"vs {m}" for m in SPEEDUP_REFERENCES)
    lines = [f"| benchmark | dtype | method | answers | tokens/s | accept length | {vs} "
             "| identical to baseline | pass@1 / accuracy |", "|" + "---|" * (8 + len(SPEEDUP_REFERENCES))]
    for r in rows:
        speedups = " | ".join(_fmt(r[f"speedup_vs_{m}"], "{:.2f}x") for m in SPEEDUP_REFERENCES)
        lines.append(
            f"| {r['bench']} | {r['dtype']} | {r['method']} | {r['answers']} | {_fmt(r['tokens_per_s'], '{:.1f}')} | "
            f"{_fmt(r['accept_length'], '{:.2f}')} | {speedups} | {_fmt(r['identical_to_baseline'], '{:.1%}')} | "
            f"{_fmt(r['quality'], '{:.1%}')} |")
    return "\n".join(lines) + "\n"


def chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = sorted({(r["bench"], r["dtype"]) for r in rows})
    methods = [m for m in METHOD_ORDER if any(r["method"] == m for r in rows)]
    methods += sorted({r["method"] for r in rows} - set(methods))
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(settings), 3.6))
    for i, method in enumerate(methods):
        values = [next((r["tokens_per_s"] or 0 for r in rows
                        if (r["bench"], r["dtype"]) == setting and r["method"] == method), 0) for setting in settings]
        ax.bar([x + i * width for x in range(len(settings))], values, width, label=method)
    labels = [bench if dtype == "-" else f"{bench}\n{dtype}" for bench, dtype in settings]
    ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(settings))], labels)
    ax.set_ylabel("tokens / s")
    ax.legend(frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        rows = summarise(read_records(args.files), args.timeout_s)
    except (ValueError, KeyError) as error:
        print(f"report: error: {error}", file=sys.stderr)
        return 2
    table = markdown(rows)
    print(table, end="")
    if args.output_dir:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.md").write_text(table)
        write_json(out / "report.json", {"files": args.files, "rows": rows})
        chart(rows, out / "report.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
