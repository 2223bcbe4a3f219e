"""Throughput of dataset generation: examples per second for the truncated and the distillation datasets.

Usage:
    python -m eval.data_gen_speed --finetune_samples 2000 --distill_samples 64 \
        --output results/data_gen/speed_cpu.json
    python -m eval.data_gen_speed --finetune_samples 4000 --distill_samples 4000 --dtype bfloat16 \
        --batch_tokens 65536 --output results/data_gen/speed_gpu.json

Runs ``data_gen.generate`` in one process on the first records of the embedded ShareGPT file (truncated
dataset), then distils the first rows of that result, in a temporary folder. Throughput counts the work
of the shards (tokenising, cutting, teacher forward passes), not loading the model. Writes JSON and
prints a table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from data_gen import generate
from ppd.models import DEFAULT_MODEL

from .records import environment, write_json


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.data_gen_speed", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--finetune_samples", type=int, default=2000, help="conversations to truncate")
    parser.add_argument("--distill_samples", type=int, default=64, help="truncated rows to distil")
    parser.add_argument("--num_prompt_tokens", type=int, default=3)
    parser.add_argument("--top_k", type=int, default=generate.DEFAULT_TOP_K)
    parser.add_argument("--batch_tokens", type=int, default=16384)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--load_in_4bit", action="store_true")
    parser.add_argument("--output", default=None)
    return parser


def _run(argv: list[str]) -> tuple[dict, float]:
    (args,) = generate.make_parser().parse_args_into_dataclasses(args=argv)
    started = time.perf_counter()
    info = generate.run(args)
    return info.summary, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    common = ["--model", args.model, "--num_prompt_tokens", str(args.num_prompt_tokens)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        truncated = str(Path(tmp) / "truncated")
        summary, wall = _run(["--dataset_type", "finetune", "--output_path", truncated,
                              "--max_samples", str(args.finetune_samples), *common])
        rows.append({"dataset_type": "finetune", "items": summary["items"], "rows": summary["rows"],
                     "work_s": summary["seconds"], "wall_s": wall, "rows_per_s": summary["rows_per_s"],
                     "mean_input_tokens": summary["input_tokens"] / summary["rows"]})
        extra = ["--top_k", str(args.top_k), "--batch_tokens", str(args.batch_tokens)]
        extra += ["--dtype", args.dtype] if args.dtype else []
        extra += ["--load_in_4bit"] if args.load_in_4bit else []
        summary, wall = _run(["--dataset_type", "distillation", "--data_path", truncated,
                              "--output_path", str(Path(tmp) / "distill"),
                              "--max_samples", str(args.distill_samples), *common, *extra])
        rows.append({"dataset_type": "distillation", "items": summary["items"], "rows": summary["rows"],
                     "work_s": summary["seconds"], "wall_s": wall, "rows_per_s": summary["rows_per_s"],
                     "mean_input_tokens": summary["input_tokens"] / summary["rows"],
                     "input_tokens_per_s": summary["input_tokens"] / summary["seconds"],
                     "topk_mass_mean": summary.get("topk_mass_mean")})
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    record = {"environment": environment(device), "settings": vars(args), "results": rows}
    print("| dataset | examples | mean input tokens | work s | examples/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dataset_type']} | {r['rows']} | {r['mean_input_tokens']:.0f} | {r['work_s']:.1f} | "
              f"{r['rows_per_s']:.2f} |")
    if args.output:
        write_json(args.output, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
