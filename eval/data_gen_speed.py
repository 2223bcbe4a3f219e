"""Throughput of dataset generation: the truncated and distillation datasets (examples per second, with the
greedy and the teacher-forced teacher) and self-distilled conversations (generated tokens per second).

Usage:
    python -m eval.data_gen_speed --finetune_samples 2000 --distill_samples 64 --conversation_samples 8 \
        --max_new_tokens 64 --output results/data_gen/speed_cpu.json
    python -m eval.data_gen_speed --finetune_samples 4000 --distill_samples 4000 --dtype bfloat16 \
        --batch_tokens 65536 --conversation_samples 512 --max_new_tokens 256 --batch_size 128 \
        --output results/data_gen/speed_gpu.json

Runs ``data_gen.generate`` in one process on the first records of the embedded ShareGPT file (truncated
dataset), then distils the first rows of that result with each ``--teachers`` entry, then lets the model
answer the first user turns of the first ``--conversation_samples`` records itself, in a temporary folder.
Throughput counts the work of the shards (tokenising, cutting, teacher forward passes, decoding), not
loading the model; the decoder's first batches (CUDA graph capture and compilation on a GPU) are inside it.
Writes JSON and prints a table.
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
    parser.add_argument("--teachers", nargs="+", choices=["greedy", "forced"], default=["greedy", "forced"],
                        help="distillation teachers to time, on the same rows")
    parser.add_argument("--conversation_samples", type=int, default=16,
                        help="records the model answers itself (0: skip the conversations dataset)")
    parser.add_argument("--max_new_tokens", type=int, default=128, help="conversations: tokens per reply, at most")
    parser.add_argument("--max_turns", type=int, default=2, help="conversations: user turns answered, at most")
    parser.add_argument("--batch_size", type=int, default=64, help="conversations: prompts per decoding batch")
    parser.add_argument("--decode_methods", nargs="+", choices=["ppd", "baseline"], default=None,
                        help="conversations: decoding methods to time, one run each (default: data_gen's choice)")
    parser.add_argument("--num_prompt_tokens", type=int, default=3)
    parser.add_argument("--top_k", type=int, default=generate.DEFAULT_TOP_K)
    parser.add_argument("--batch_tokens", type=int, default=16384)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--load_in_4bit", action="store_true")
    parser.add_argument("--output", default=None)
    return parser


def _run(argv: list[str]) -> tuple[dict, float, dict]:
    """The summary of one data_gen run, its wall time and its generation settings (conversations)."""
    (args,) = generate.make_parser().parse_args_into_dataclasses(args=argv)
    started = time.perf_counter()
    info = generate.run(args)
    return info.summary, time.perf_counter() - started, info.generation


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    common = ["--model", args.model, "--num_prompt_tokens", str(args.num_prompt_tokens)]
    dtype = ["--dtype", args.dtype] if args.dtype else []
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        truncated = str(Path(tmp) / "truncated")
        summary, wall, _ = _run(["--dataset_type", "finetune", "--output_path", truncated,
                                 "--max_samples", str(args.finetune_samples), *common])
        rows.append({"dataset_type": "finetune", "items": summary["items"], "rows": summary["rows"],
                     "work_s": summary["seconds"], "wall_s": wall, "rows_per_s": summary["rows_per_s"],
                     "mean_input_tokens": summary["input_tokens"] / summary["rows"]})
        extra = ["--top_k", str(args.top_k), "--batch_tokens", str(args.batch_tokens), *dtype]
        extra += ["--load_in_4bit"] if args.load_in_4bit else []
        for teacher in args.teachers:
            summary, wall, _ = _run(["--dataset_type", "distillation", "--data_path", truncated, "--teacher",
                                     teacher, "--output_path", str(Path(tmp) / f"distill_{teacher}"),
                                     "--max_samples", str(args.distill_samples), *common, *extra])
            rows.append({"dataset_type": "distillation", "teacher": teacher, "items": summary["items"],
                         "rows": summary["rows"], "work_s": summary["seconds"], "wall_s": wall,
                         "rows_per_s": summary["rows_per_s"],
                         "mean_input_tokens": summary["input_tokens"] / summary["rows"],
                         "input_tokens_per_s": summary["input_tokens"] / summary["seconds"],
                         "topk_mass_mean": summary.get("topk_mass_mean")})
        for method in (args.decode_methods or [None]) if args.conversation_samples > 0 else []:
            chosen = ["--decode_method", method] if method else []
            summary, wall, generation = _run(["--dataset_type", "conversations", "--output_path",
                                              str(Path(tmp) / f"conv_{method}"), "--max_samples",
                                              str(args.conversation_samples), "--max_new_tokens",
                                              str(args.max_new_tokens), "--max_turns", str(args.max_turns),
                                              "--batch_size", str(args.batch_size), *chosen, *dtype,
                                              "--model", args.model])
            rows.append({"dataset_type": "conversations", "method": generation["method"],
                         "capture": generation["capture"], "items": summary["items"], "rows": summary["rows"],
                         "replies": summary["replies"], "generated_tokens": summary["generated_tokens"],
                         "work_s": summary["seconds"], "wall_s": wall, "rows_per_s": summary["rows_per_s"],
                         "generated_tokens_per_s": summary["generated_tokens_per_s"],
                         "skipped": summary["skipped"]})
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    record = {"environment": environment(device), "settings": vars(args), "results": rows}
    print("| dataset | teacher / method | examples | mean input tokens | work s | examples/s | tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        tokens = r.get("input_tokens_per_s") or r.get("generated_tokens_per_s")
        mean_input = f"{r['mean_input_tokens']:.0f}" if "mean_input_tokens" in r else "-"
        print(f"| {r['dataset_type']} | {r.get('teacher') or r.get('method') or '-'} | {r['rows']} | {mean_input} | "
              f"{r['work_s']:.1f} | {r['rows_per_s']:.2f} | {f'{tokens:.0f}' if tokens else '-'} |")
    print("tokens/s: input tokens for distillation, generated tokens for conversations")
    if args.output:
        write_json(args.output, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
