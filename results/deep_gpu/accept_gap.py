"""Accept length of live PPD decoding, one MT-Bench first turn at a time, by dtype and capture mode.

    python results/deep_gpu/accept_gap.py --modes float32:eager bfloat16:eager bfloat16:compiled_graph \
        --questions 20 --max_new_tokens 128

Each mode decodes with the tree the packaged adapter names for its device and dtype (on a CUDA device: the
bf16 batch policy's batch-1 tree, 64 rows; in fp32 the adapter's fp32 tree, 130 rows). Replay gives one accept
length for both dtypes (``eval.replay --dtype``); this says whether the live steps agree with each other, mode by
mode (``h200/v7/accept_by_mode.json``: bf16 eager, graph and compiled-graph 1.91-1.94 on the first 20 first turns).
"""

import argparse
import json
import sys

import torch

from eval.batch_speed import prompts_for
from ppd.config import DecodeConfig
from ppd.ppd_model import PPDModel


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--modes", nargs="+", default=["float32:eager", "bfloat16:eager", "bfloat16:compiled_graph"])
    parser.add_argument("--questions", type=int, default=20)
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    results = {}
    for mode in args.modes:
        dtype, capture = mode.split(":")
        ppd = PPDModel.from_pretrained(device=args.device, dtype=dtype)
        dec = ppd.decoder
        prompts = prompts_for(ppd.tokenizer, "mt_bench", args.questions)  # the first turns, as eval.batch_speed's
        config = DecodeConfig(method="ppd", max_new_tokens=args.max_new_tokens, capture=capture)
        dec.generate(prompts[0], config)  # warm-up: compiles and captures
        steps = tokens = 0
        texts = []
        for ids in prompts:
            out = dec.generate(ids, config)
            steps += out.steps
            tokens += out.new_tokens
            texts.append(out.token_ids)
        results[mode] = {"accept_length": tokens / steps, "tokens": tokens, "steps": steps, "answers": texts}
        tables = dec.tables_for(1)
        print(f"{mode}: accept length {tokens / steps:.3f} ({tokens} tokens, {steps} steps, tree rows "
              f"{tables.num_rows if tables else 1})", flush=True)
        del ppd, dec
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
