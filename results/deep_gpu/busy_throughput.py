"""Busy tokens/s of recorded load runs: ``eval.load``'s summary again from the requests a JSON file kept.

`eval.load` now reports, beside each level's tokens/s, the tokens/s while every client still had a request in flight
(``busy_tokens_per_s``: up to the moment the level's last counted request was sent). Runs recorded before that have
every request's send time and chunks, so the figure can be read from them afterwards:

    python results/deep_gpu/busy_throughput.py results/deep_gpu/h200/v2*/load*.json.gz > busy_throughput.md
"""

from __future__ import annotations

import gzip
import json
import sys

from eval.load import busy_tokens_per_s


def rows_of(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        run = json.load(f)
    counted = [r for r in run["records"] if not r.get("warmup")]
    rows = []
    for level in run["summary"]:
        mine = [r for r in counted if r["clients"] == level["clients"] and r["method"] == level["method"]]
        ok = [r for r in mine if not r.get("error")]
        rows.append({"file": path, "clients": level["clients"], "method": level["method"],
                     "tokens_per_s": level["output_tokens_per_s"],
                     "busy_tokens_per_s": busy_tokens_per_s(ok, [r.get("sent_s") for r in mine])})
    return rows


def main(paths: list[str]) -> int:
    print("| run | clients | ppd tokens/s | baseline | ratio | ppd busy tokens/s | baseline busy | busy ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for path in paths:
        rows = rows_of(path)
        for level in sorted({r["clients"] for r in rows}):
            found = {r["method"]: r for r in rows if r["clients"] == level}
            ppd, base = found.get("ppd"), found.get("baseline")
            if not (ppd and base):
                continue
            ratio = ppd["tokens_per_s"] / base["tokens_per_s"]
            busy = (f"{ppd['busy_tokens_per_s']:,.0f} | {base['busy_tokens_per_s']:,.0f} | "
                    f"{ppd['busy_tokens_per_s'] / base['busy_tokens_per_s']:.2f}x"
                    if ppd["busy_tokens_per_s"] and base["busy_tokens_per_s"] else "- | - | -")
            name = path.split("results/deep_gpu/")[-1]
            whole = f"{ppd['tokens_per_s']:,.0f} | {base['tokens_per_s']:,.0f} | {ratio:.2f}x"
            print(f"| {name} | {level} | {whole} | {busy} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
