"""How much of the teacher's probability mass the stored top-k keeps, and what storing it costs.

Usage:
    python -m eval.topk_mass data/sharegpt_distill_k1000 --ks 1 5 10 20 50 100 200 500 1000 \
        --output results/data_gen/topk_mass.json

Reads a distillation dataset made with a large ``--top_k`` and reports, for each smaller k, the mean
share of probability mass its first k entries hold (per prompt token), with the bytes per example of
top-k storage (int32 id + float32 log-probability per entry) against full-vocabulary float32 logits.
Writes JSON and prints a table.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from ppd.dataset_info import DatasetType, PPDDatasetInfo
from ppd.models import DEFAULT_MODEL

from .records import write_json


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.topk_mass", description=__doc__.split("\n")[0])
    parser.add_argument("dataset", help="a distillation dataset from `python -m data_gen.generate`")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 5, 10, 20, 50, 100, 200])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the dataset's model, for its vocabulary size")
    parser.add_argument("--output", default=None)
    return parser


def mass_table(logprobs: np.ndarray, ks: list[int]) -> list[dict]:
    """``logprobs`` [rows, N, K] sorted descending -> per k: mean kept mass per prompt token, and its spread."""
    cumulative = np.exp(logprobs.astype(np.float64)).cumsum(-1)  # [rows, N, K]
    table = []
    for k in ks:
        kept = cumulative[:, :, k - 1]
        table.append({"k": k, "mass_mean": kept.mean(0).round(5).tolist(),
                      "mass_p10": np.percentile(kept, 10, axis=0).round(5).tolist()})
    return table


def main(argv: list[str] | None = None) -> int:
    import datasets
    from transformers import AutoConfig

    from ppd.models import resolve_model

    args = make_parser().parse_args(argv)
    dataset = datasets.load_from_disk(args.dataset)
    info = PPDDatasetInfo.of(dataset)
    if info.dataset_type != DatasetType.DISTILLATION.value:
        print(f"error: {args.dataset} is a {info.dataset_type} dataset, not a distillation one", file=sys.stderr)
        return 2
    too_large = [k for k in args.ks if k > info.top_k]
    if too_large:
        print(f"error: the dataset stores top-{info.top_k}; cannot report k = {too_large}", file=sys.stderr)
        return 2
    path, model_info = resolve_model(args.model)
    info.check_model(model_info.model_id)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    logprobs = np.array(dataset["teacher_topk_logprobs"], dtype=np.float32)  # [rows, N, K]
    n = info.num_prompt_tokens
    table = mass_table(logprobs, sorted(args.ks))
    full_bytes = n * vocab * 4
    for row in table:
        row["bytes_per_example"] = n * row["k"] * 8
        row["smaller_than_full_vocab"] = round(full_bytes / row["bytes_per_example"], 1)
    record = {"dataset": args.dataset, "rows": len(dataset), "model": info.model, "num_prompt_tokens": n,
              "vocab_size": vocab, "teacher_dtype": info.teacher_dtype, "full_vocab_bytes_per_example": full_bytes,
              "table": table}
    print(f"{len(dataset)} examples, N = {n}, vocabulary {vocab}: full-vocabulary float32 logits take "
          f"{full_bytes / 1024:.0f} KiB per example")
    print("| k | mass kept, prompt token 1..N (mean) | 10th percentile | bytes / example | smaller by |")
    print("|---|---|---|---|---|")
    for row in table:
        print(f"| {row['k']} | {' / '.join(f'{m:.3f}' for m in row['mass_mean'])} | "
              f"{' / '.join(f'{m:.3f}' for m in row['mass_p10'])} | {row['bytes_per_example']} | "
              f"{row['smaller_than_full_vocab']}x |")
    if args.output:
        write_json(args.output, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
