"""Top-k accuracy of each prompt token on held-out training prompts (never benchmark questions).

Usage:
    python -m eval.accuracy --dataset data/sharegpt_distill [--adapter DIR] --eval_size 0.02 --seed 42 \\
        --output results/trees/accuracy.json

Holds out the same examples as ``train.train`` with the same ``--eval_size`` and ``--seed`` (the
default ones), runs the prompt tokens on them and writes the [N][K] rank-accuracy table (the share of
examples whose target, the teacher's greedy token where stored, sits at each rank of the prompt
token's top-K) in the format ``eval.build_trees --accuracy`` reads.
"""

from __future__ import annotations

import argparse
import sys

import torch

from ppd.cli import add_adapter_args, add_model_args, load_decoder_or_exit
from ppd.dataset_info import PPDDatasetInfo
from ppd.training import PromptTokenCollator, PromptTokenModel, heldout_split, tally_held_out

from .records import environment, write_json


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.accuracy", description=__doc__.split("\n")[0])
    add_model_args(parser)
    add_adapter_args(parser)
    parser.add_argument("--dataset", required=True, help="a dataset made by `python -m data_gen.generate`")
    parser.add_argument("--eval_size", type=float, default=0.02, help="as in train.train (share or count)")
    parser.add_argument("--seed", type=int, default=42, help="as in train.train")
    parser.add_argument("--top_k", type=int, default=10, help="ranks kept per prompt token")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--output", default=None)
    return parser


def measure(model: PromptTokenModel, dataset, top_k: int, batch_size: int) -> torch.Tensor:
    collate = PromptTokenCollator(num_prompt_tokens=model.prompt_tokens.num_prompt_tokens)
    batches = (collate([dataset[i] for i in range(start, min(len(dataset), start + batch_size))])
               for start in range(0, len(dataset), batch_size))
    return tally_held_out(model, batches, top_k, with_loss=False).rank_accuracy().float()


def main(argv: list[str] | None = None) -> int:
    import datasets

    args = make_parser().parse_args(argv)
    loaded = load_decoder_or_exit(args)
    dataset = datasets.load_from_disk(args.dataset)
    info = PPDDatasetInfo.of(dataset)
    info.check_model(loaded.info.model_id)
    _, held_out = heldout_split(dataset, args.eval_size, args.seed)
    if held_out is None:
        print("error: --eval_size 0 leaves nothing to measure on", file=sys.stderr)
        return 2
    prompt_tokens = loaded.decoder.prompt_tokens
    table = measure(PromptTokenModel(loaded.model, prompt_tokens), held_out, args.top_k, args.batch_size)
    cumulative = table.cumsum(-1)
    record = {"rank_accuracy": table.tolist(), "prompt_tokens": prompt_tokens.config.to_dict(),
              "adapter": loaded.adapter, "dataset": {"path": args.dataset, "eval_examples": len(held_out)},
              "top1": cumulative[:, 0].tolist(), "top5": cumulative[:, min(4, args.top_k - 1)].tolist(),
              **environment(loaded.decoder.device)}
    for k in range(table.shape[0]):
        print(f"prompt token {k + 1}: top-1 {cumulative[k, 0]:.3f}, top-5 {cumulative[k, min(4, args.top_k - 1)]:.3f}")
    if args.output:
        write_json(args.output, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
