"""Share of answers that are token-identical between two sets of ``eval.gen_answers`` records.

Usage:
    python -m eval.compare_answers --reference eager/*.jsonl --candidate captured/*.jsonl [--method ppd]

Answers are matched by benchmark, method, question, turn and run; only answers present in both sets count.
Prints one line per method and exits 1 when any matched answer differs (so a script can stop on it).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

from .report import read_records


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.compare_answers", description=__doc__.split("\n")[0])
    parser.add_argument("--reference", nargs="+", required=True, help="JSONL files of the reference answers")
    parser.add_argument("--candidate", nargs="+", required=True, help="JSONL files of the answers to check")
    parser.add_argument("--method", default=None, help="compare this method only")
    parser.add_argument("--output", default=None, help="write the comparison as JSON here")
    return parser


def _index(records: list[dict], method: str | None) -> dict[tuple, list[int]]:
    return {(r["bench"], r["method"], r["question_id"], r["turn"], r.get("run", 0)): r["token_ids"]
            for r in records if method is None or r["method"] == method}


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    reference = _index(read_records(args.reference), args.method)
    candidate = _index(read_records(args.candidate), args.method)
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    first_difference = {}
    for key in sorted(reference.keys() & candidate.keys()):
        same = reference[key] == candidate[key]
        counts[key[1]][0] += same
        counts[key[1]][1] += 1
        if not same and key[1] not in first_difference:
            a, b = reference[key], candidate[key]
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            first_difference[key[1]] = {"answer": list(key), "token": at}
    result = {m: {"identical": c[0], "compared": c[1], "first_difference": first_difference.get(m)}
              for m, c in counts.items()}
    for method, r in result.items():
        print(f"{method}: {r['identical']} of {r['compared']} answers identical"
              + (f" (first difference: {r['first_difference']})" if r["first_difference"] else ""))
    if not result:
        print("no answer is in both sets", file=sys.stderr)
        return 2
    if args.output:
        with open(args.output, "w") as sink:
            json.dump(result, sink, indent=1)
    return 0 if all(r["identical"] == r["compared"] for r in result.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
