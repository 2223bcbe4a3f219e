"""Training throughput in examples (cuts) per second: packed cuts against one cut per forward, two passes
against one.

Usage (any ``train.train`` flags after ``--``; the launcher prefix runs each variant, e.g. on 2 GPUs):

    python -m eval.train_speed --dataset_path data/sd_distill --max_steps 200 \\
        --cuts_per_forward 1 0 --output results/train/train_speed.json -- --per_device_train_batch_size 8
    python -m eval.train_speed ... --launcher "accelerate launch --num_processes 2 --multi_gpu"
    python -m eval.train_speed --dataset_path data/sd_distill --cuts_per_forward 0 --passes 2 1 -- ...

Each variant is a fresh ``train.train`` run of ``--max_steps`` steps without evaluation or checkpoints; its
training log's ``throughput`` (examples trained by all processes / seconds inside ``train()``, model loading
excluded) is what is compared. ``--passes 2 1`` times each of them with the default two-pass forward
(``ppd.two_pass``) and with ``--single_pass``. Writes JSON and prints a table.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from .records import write_json


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.train_speed", description=__doc__.split("\n")[0])
    parser.add_argument("--dataset_path", required=True)
    parser.add_argument("--max_steps", type=int, default=100)
    parser.add_argument("--cuts_per_forward", type=int, nargs="+", default=[1, 0],
                        help="variants to time (0 = every cut of a conversation in one forward)")
    parser.add_argument("--passes", type=int, nargs="+", default=[2], choices=[1, 2],
                        help="forwards to time: 2 = the default two passes, 1 = one pass (train.train --single_pass)")
    parser.add_argument("--launcher", default="", help='command prefix, e.g. "accelerate launch --num_processes 2"')
    parser.add_argument("--output", default=None)
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then flags for train.train")
    return parser


def run_variant(args, cuts: int, passes: int, folder: Path) -> dict:
    extra = [a for a in args.train_args if a != "--"] + (["--single_pass"] if passes == 1 else [])
    launcher = shlex.split(args.launcher) if args.launcher else [sys.executable]
    module = ["-m", "train.train"]
    command = [*launcher, *module, "--dataset_path", args.dataset_path, "--output_dir", str(folder),
               "--max_steps", str(args.max_steps), "--eval_size", "0", "--save_strategy", "no",
               "--report_to", "none", "--cuts_per_forward", str(cuts), *extra]
    subprocess.run(command, check=True)
    log = json.loads((folder / "training_log.json").read_text())
    return {"cuts_per_forward": cuts, "passes": passes, "command": shlex.join(command), "world_size": log["world_size"],
            "steps": args.max_steps, **log["throughput"], "hardware": log["hardware"]}


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ppd-train-speed-") as tmp:
        for cuts in args.cuts_per_forward:
            for passes in args.passes:
                rows.append(run_variant(args, cuts, passes, Path(tmp) / f"cuts{cuts}-passes{passes}"))
    slowest = min(r["examples_per_s"] for r in rows)
    print("| cuts per forward | passes | processes | examples | seconds | examples/s | vs slowest |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        label = "all of a conversation" if r["cuts_per_forward"] == 0 else r["cuts_per_forward"]
        print(f"| {label} | {r['passes']} | {r['world_size']} | {r['examples']} | {r['seconds']:.1f} | "
              f"{r['examples_per_s']:.1f} | {r['examples_per_s'] / slowest:.2f}x |")
    if args.output:
        write_json(args.output, {"dataset_path": args.dataset_path, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
