"""MT-Bench speed of the deep prompt tokens (now shipped) against the plain ones shipped before them, on a GPU.

Batch 1, bf16, the captured step (compiled_graph), each adapter with its own 64-row tree (``tree_cuda.json``),
the engine's baseline beside them, the first ``--limit`` questions (first turn), ``--max_new_tokens`` each.
    python results/train/v4/gpu_check.py --limit 10 --max_new_tokens 256 --output results/train/v4/gpu_check.json
"""

import argparse
import json
import time

import torch

from eval.benchmarks import load_benchmark
from ppd.chat import chat_input_ids
from ppd.decoder import Decoder, eos_ids_of
from ppd.models import load_model
from ppd.prompt_tokens import PromptTokens, packaged_adapter
from ppd.tree import TreeSet


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max_new_tokens", type=int, default=256)
    parser.add_argument("--output", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--capture", default="compiled_graph")
    args = parser.parse_args()
    model, tokenizer, info = load_model("smollm2-135m-instruct", device=args.device, dtype=torch.bfloat16)
    questions = load_benchmark("mt_bench")[: args.limit]
    prompts = [chat_input_ids(tokenizer, [{"role": "user", "content": q.turns[0]}]) for q in questions]
    shipped = packaged_adapter(info.model_id)
    adapters = {"deep (shipped now)": shipped, "plain (shipped before)": "results/train/v4/shipped_before"}
    rows = []
    for name, folder in adapters.items():
        decoder = Decoder(model, PromptTokens.from_pretrained(folder, model), TreeSet.load(f"{folder}/tree_cuda.json"),
                          eos_ids_of(model, tokenizer), max_seq_len=1024)
        methods = ["ppd", "baseline"] if not rows else ["ppd"]
        for method in methods:
            start = time.perf_counter()
            decoder.warmup([1], methods=[method], capture=args.capture)
            warm = time.perf_counter() - start
            tokens = steps = 0
            wall = 0.0
            for ids in prompts:
                out = decoder.generate(ids, method=method, max_new_tokens=args.max_new_tokens, capture=args.capture)
                tokens, steps, wall = tokens + out.new_tokens, steps + out.steps, wall + out.wall_time_s
            label = name if method == "ppd" else "baseline"
            rows.append({"variant": label, "tokens_per_s": tokens / wall, "accept_length": tokens / steps,
                         "new_tokens": tokens, "warmup_s": warm})
            print(json.dumps(rows[-1]), flush=True)
            json.dump({"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
                       "torch": torch.__version__, "dtype": "bfloat16", "capture": args.capture,
                       "questions": args.limit, "max_new_tokens": args.max_new_tokens,
                       "rows": rows}, open(args.output, "w"), indent=1)


if __name__ == "__main__":
    main()
