"""Tables of speed and quality from ``eval.gen_answers`` JSONL files: markdown, JSON and a PNG chart.

Usage:
    python -m eval.report results/answers/*.jsonl --output_dir results/report

Per benchmark, dtype and method: answers, tokens/s (sum of new tokens / sum of wall time), accept length
(new tokens / decoding steps), speed-up over ``hf_static`` (the strongest transformers baseline),
``baseline``, ``hf`` and ``pld`` on the same benchmark in the same dtype, the share of answers
token-identical to the baseline's (same question, turn and run), HumanEval pass@1 (every completion run
against its tests in its own process, with a time limit) and GSM8K accuracy. Where questions have categories
(MT-Bench's, Alpaca Eval's source sets, those of a question file), the same speed figures per category too
(``categories`` in report.json, a second table in report.md); answers of runs that did not record their
category take it from their built-in benchmark.

Answers of a question file (``eval.gen_answers --question_file``) are labelled with the file's name as their
benchmark; answers of files with the same name but other contents are not compared or averaged.

Only like is compared with like: within one benchmark and dtype, every method's answers must come from the
same model, temperature, max_new_tokens, device and question file (name and content), and within one method
also from the same adapter and tree (PPD brings prompt tokens and a tree, the other methods have none).
Answers that differ in any of these are refused with an error naming the field, its values and their files;
a field that records of an earlier run lack counts as the value "unknown". Give such answers to separate
reports. Input without answers (no file, only empty files) is an error too.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .benchmarks import BENCHMARKS, load_benchmark
from .grading import gsm8k_correct, humaneval_completion, humaneval_passes
from .records import recorded, write_json

METHOD_ORDER = ("hf", "pld", "hf_static", "baseline", "ppd")
SPEEDUP_REFERENCES = ("hf_static", "baseline", "hf", "pld")
# What answers must share to be compared: all methods of one benchmark and dtype, and the answers of one method.
# The capture mode may differ (every mode decodes the same tokens; resumed shards have switched it).
SHARED_SETTINGS = ("model", "temperature", "max_new_tokens", "device")
# Shared too: which question file, and its content (answers of built-in benchmarks have none).
QUESTION_FILE_SETTINGS = ("question_file", "question_file_sha256")
METHOD_SETTINGS = ("adapter", "tree")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.report", description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", help="JSONL files written by eval.gen_answers")
    parser.add_argument("--output_dir", default=None, help="write report.md, report.json and report.png here")
    parser.add_argument("--timeout_s", type=float, default=10.0, help="HumanEval time limit per program")
    return parser


def read_answers(files: list[str]) -> tuple[list[dict], list[str]]:
    """Every record of ``files``, and the file each one came from."""
    records, sources = [], []
    for name in files:
        try:
            text = Path(name).read_text(encoding="utf-8")
        except FileNotFoundError:
            hint = " (a pattern that matched no file?)" if any(c in name for c in "*?[") else ""
            raise ValueError(f"{name}: no such file{hint}") from None
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise ValueError(f"{name}:{number} is not JSON ({error})") from None
                sources.append(name)
    return records, sources


def read_records(files: list[str]) -> list[dict]:
    return read_answers(files)[0]


def _key(record: dict) -> tuple:
    return record["question_id"], record["turn"], record.get("run", 0)


def speed_totals(records: list[dict]) -> dict:
    """Answers, new tokens, decoding steps and wall seconds of a set of answers, with their tokens/s (sum of
    new tokens / sum of wall time) and accept length (new tokens / steps)."""
    tokens = sum(r["new_tokens"] for r in records)
    steps = sum(r["steps"] for r in records)
    wall = sum(r["wall_time_s"] for r in records)
    return {"answers": len(records), "new_tokens": tokens, "steps": steps, "wall_time_s": wall,
            "tokens_per_s": tokens / wall if wall else None, "accept_length": tokens / steps if steps else None}


def identical_share(records: list[dict], reference: list[dict]) -> tuple[float | None, int]:
    """The share of ``records`` token-identical to ``reference``'s answer to the same question, turn and run
    (``None`` where none has one there), and how many had one."""
    tokens = {_key(r): r["token_ids"] for r in reference}
    compared = [r for r in records if _key(r) in tokens]
    share = sum(r["token_ids"] == tokens[_key(r)] for r in compared) / len(compared) if compared else None
    return share, len(compared)


def _dtype(record: dict) -> str:
    """Records of runs before dtypes were recorded say nothing: they form their own group ("-")."""
    return record.get("dtype") or "-"


def _names(files: list[str], shown: int = 3) -> str:
    more = f" and {len(files) - shown} more" if len(files) > shown else ""
    return ", ".join(files[:shown]) + more


def _one_value(answers: list[tuple[dict, str]], fields: tuple[str, ...], where: str) -> None:
    """Raise ValueError if these (record, file) pairs do not all have the same value of each field."""
    for field in fields:
        files: dict = defaultdict(list)  # value -> the files that hold it
        for record, source in answers:
            if source not in files[value := recorded(record, field)]:
                files[value].append(source)
        if len(files) > 1:
            values = "; ".join(f"{value!r} in {_names(names)}" for value, names in files.items())
            raise ValueError(f"{where} mixes answers made with different {field}: {values}. Only answers with the "
                             "same model, temperature, max_new_tokens, device and question file per benchmark and "
                             "dtype, and the same adapter and tree per method, are averaged or compared: give these "
                             "to separate reports")


def check_settings(records: list[dict], sources: list[str]) -> None:
    """Refuse to average or compare answers made with different settings (see the module's docstring)."""
    by_bench: dict[tuple[str, str], list[tuple[dict, str]]] = defaultdict(list)
    for record, source in zip(records, sources):
        by_bench[(record["bench"], _dtype(record))].append((record, source))
    for (bench, dtype), answers in by_bench.items():
        where = bench if dtype == "-" else f"{bench} in {dtype}"
        for method in sorted({record["method"] for record, _ in answers}):
            _one_value([a for a in answers if a[0]["method"] == method],
                       SHARED_SETTINGS + QUESTION_FILE_SETTINGS + METHOD_SETTINGS, f"{method} on {where}")
        _one_value(answers, SHARED_SETTINGS + QUESTION_FILE_SETTINGS, where)


def quality(bench: str, records: list[dict], timeout_s: float) -> float | None:
    """HumanEval pass@1 or GSM8K accuracy of these answers (first runs only); None for other benchmarks and for
    question files."""
    if bench not in ("humaneval", "gsm8k") or any(r.get("question_file") for r in records):
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


def summarise(records: list[dict], timeout_s: float = 10.0, sources: list[str] | None = None) -> list[dict]:
    """One row per benchmark, dtype and method; ``sources`` (the file of each record) names files in errors."""
    check_settings(records, sources or [f"record {i + 1}" for i in range(len(records))])
    groups: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for record in records:
        groups[(record["bench"], _dtype(record), record["method"])].append(record)
    rows = []
    for (bench, dtype, method), group in groups.items():
        rows.append({"bench": bench, "dtype": dtype, "method": method, **speed_totals(group),
                     "startup_s": max((r.get("startup_s") or 0.0) for r in group),
                     "quality": quality(bench, group, timeout_s),
                     **{field: recorded(group[0], field) for field in SHARED_SETTINGS + METHOD_SETTINGS},
                     **{field: group[0].get(field) for field in QUESTION_FILE_SETTINGS}})
    _compare(rows, groups, ("bench", "dtype"))
    order = {m: i for i, m in enumerate(METHOD_ORDER)}
    return sorted(rows, key=lambda r: (r["bench"], r["dtype"], order.get(r["method"], len(order)), r["method"]))


def _compare(rows: list[dict], groups: dict[tuple, list[dict]], setting: tuple[str, ...]) -> None:
    """Add to each row its speed-up over every reference method and its share of answers identical to the
    baseline's, among the rows with the same values of the ``setting`` fields; ``groups``: each row's answers,
    by those values and the method."""
    for row in rows:
        same = {r["method"]: r for r in rows if all(r[f] == row[f] for f in setting)}
        for reference in SPEEDUP_REFERENCES:
            other = same.get(reference)
            row[f"speedup_vs_{reference}"] = (row["tokens_per_s"] / other["tokens_per_s"]
                                              if other and other["tokens_per_s"] and row["tokens_per_s"] else None)
        values = tuple(row[f] for f in setting)
        row["identical_to_baseline"], row["compared_with_baseline"] = identical_share(
            groups[(*values, row["method"])], groups.get((*values, "baseline"), []))


def categories_of(records: list[dict]) -> list[str]:
    """Each record's question category: as recorded, else (answers of runs that did not record it) its built-in
    benchmark's, else "" (none)."""
    known: dict[str, dict[str, str]] = {}
    categories = []
    for record in records:
        if "category" in record:
            categories.append(record["category"] or "")
            continue
        bench = record["bench"]
        if bench not in known:
            known[bench] = {}
            if bench in BENCHMARKS and not record.get("question_file"):
                try:
                    known[bench] = {q.question_id: q.category for q in load_benchmark(bench)}
                except FileNotFoundError:  # its package is not installed here: no categories
                    pass
        categories.append(known[bench].get(str(record["question_id"]), ""))
    return categories


def summarise_categories(records: list[dict]) -> list[dict]:
    """One row per benchmark, dtype, category and method, for the benchmarks and dtypes whose questions have
    categories: answers, tokens/s, accept length, speed-ups over the same category's reference methods and
    the identical-to-baseline share. Check the answers' settings first (:func:`summarise` does)."""
    groups: dict[tuple[str, str, str, str], list[dict]] = defaultdict(list)
    for record, category in zip(records, categories_of(records)):
        groups[(record["bench"], _dtype(record), category, record["method"])].append(record)
    with_categories = {(bench, dtype) for bench, dtype, category, _ in groups if category}
    rows = [{"bench": bench, "dtype": dtype, "category": category, "method": method, **speed_totals(group)}
            for (bench, dtype, category, method), group in groups.items() if (bench, dtype) in with_categories]
    _compare(rows, groups, ("bench", "dtype", "category"))
    order = {m: i for i, m in enumerate(METHOD_ORDER)}
    return sorted(rows, key=lambda r: (r["bench"], r["dtype"], r["category"], order.get(r["method"], len(order)),
                                       r["method"]))


def _fmt(value, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def markdown(rows: list[dict], by_category: bool = False) -> str:
    """The table of :func:`summarise`'s rows, or (``by_category``) of :func:`summarise_categories`' rows,
    which have a category column and no quality column ("" when there are none)."""
    if not rows:
        return ""
    vs = " | ".join(f"vs {m}" for m in SPEEDUP_REFERENCES)
    category = "category | " if by_category else ""
    quality = "" if by_category else " pass@1 / accuracy |"
    lines = [f"| benchmark | dtype | {category}method | answers | tokens/s | accept length | {vs} "
             f"| identical to baseline |{quality}", "|" + "---|" * (8 + len(SPEEDUP_REFERENCES))]
    for r in rows:
        speedups = " | ".join(_fmt(r[f"speedup_vs_{m}"], "{:.2f}x") for m in SPEEDUP_REFERENCES)
        cells = [r["bench"], r["dtype"], *([r["category"] or "-"] if by_category else []), r["method"],
                 str(r["answers"]), _fmt(r["tokens_per_s"], "{:.1f}"), _fmt(r["accept_length"], "{:.2f}"), speedups,
                 _fmt(r["identical_to_baseline"], "{:.1%}"), *([] if by_category else [_fmt(r["quality"], "{:.1%}")])]
        lines.append("| " + " | ".join(cells) + " |")
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
        records, sources = read_answers(args.files)
        if not records:
            raise ValueError(f"no answers in {_names(args.files)}: nothing to report")
        rows = summarise(records, args.timeout_s, sources)
        categories = summarise_categories(records)
    except (ValueError, KeyError) as error:
        print(f"report: error: {error}", file=sys.stderr)
        return 2
    table = markdown(rows)
    if categories:
        table += "\nPer category:\n\n" + markdown(categories, by_category=True)
    print(table, end="")
    if args.output_dir:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.md").write_text(table)
        write_json(out / "report.json", {"files": args.files, "rows": rows, "categories": categories})
        chart(rows, out / "report.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
