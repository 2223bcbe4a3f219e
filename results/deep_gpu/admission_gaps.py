"""What a request joining the batch costs the rows already running, read off an ``eval.load`` record.

Every streamed chunk a client received is timed (``chunk_times_s``, from the request's ``sent_s``). A gap between
two chunks of one request is put in a class by how many other requests received their first token inside it
(each such first token is one admission: the batcher drains its queued steps, prefills the joining request alone
and copies it in while the running rows wait). The median gap of each class, against the gaps with no admission
inside, is what one admission stalls the running rows; the share of the level's time that went to admissions and
what the throughput would be without them follow (the rows' own gaps kept as they were).

    python results/deep_gpu/admission_gaps.py results/deep_gpu/h200/v22/load_bfloat16.json.gz [--clients 16 4]
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import statistics
from pathlib import Path


def load(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def gaps_by_admissions(records: list[dict]) -> dict[int, list[float]]:
    """Every chunk gap (s) of the records, by the number of first tokens of other requests inside it (3: 3 or more)."""
    firsts = sorted(r["sent_s"] + r["ttft_s"] for r in records)
    found: dict[int, list[float]] = {}
    for r in records:
        times = [r["sent_s"] + t for t in r["chunk_times_s"]]
        for before, after in zip(times, times[1:]):
            inside = bisect.bisect_right(firsts, after) - bisect.bisect_right(firsts, before)
            found.setdefault(min(inside, 3), []).append(after - before)
    return found


def level_summary(records: list[dict]) -> dict:
    found = gaps_by_admissions(records)
    plain = statistics.median(found.get(0, [0.0]))
    one = statistics.median(found[1]) if found.get(1) else None
    stall = None if one is None else one - plain
    start = min(r["sent_s"] for r in records)
    wall = max(r["sent_s"] + r["e2e_s"] for r in records) - start
    tokens = sum(r["completion_tokens"] for r in records)
    share = None if stall is None else min(len(records) * stall / wall, 1.0)
    return {"requests": len(records), "tokens_per_s": tokens / wall, "gap_p50_ms": 1e3 * plain,
            "gap_with_one_admission_ms": None if one is None else 1e3 * one,
            "stall_per_admission_ms": None if stall is None else 1e3 * stall,
            "gaps": {k: len(v) for k, v in sorted(found.items())},
            "admission_share": share,
            "tokens_per_s_without_stalls": None if share is None else tokens / (wall * (1 - share))}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("load_json", type=Path, help="an eval.load --output file (.json or .json.gz)")
    parser.add_argument("--clients", type=int, nargs="+", default=None, help="levels to read (default: all)")
    parser.add_argument("--output", type=Path, default=None, help="write the summary as JSON here")
    args = parser.parse_args(argv)
    data = load(args.load_json)
    levels = args.clients or sorted({r["clients"] for r in data["records"]})
    rows = []
    print("| clients | method | tokens/s | chunk gap p50 ms | gap with one admission ms | stall per admission ms "
          "| time in admissions | tokens/s without the stalls |")
    print("|---|---|---|---|---|---|---|---|")
    for clients in levels:
        for method in data["methods"]:
            records = [r for r in data["records"] if r["clients"] == clients and r["method"] == method
                       and not r["warmup"] and r["error"] is None]
            if not records:
                continue
            s = {"clients": clients, "method": method, **level_summary(records)}
            rows.append(s)

            def num(x, f="{:.1f}"):
                return "-" if x is None else f.format(x)
            print(f"| {clients} | {method} | {s['tokens_per_s']:,.0f} | {s['gap_p50_ms']:.2f} | "
                  f"{num(s['gap_with_one_admission_ms'])} | {num(s['stall_per_admission_ms'])} | "
                  f"{num(s['admission_share'], '{:.0%}')} | {num(s['tokens_per_s_without_stalls'], '{:,.0f}')} |")
    if args.output:
        args.output.write_text(json.dumps({"source": str(args.load_json), "levels": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
