"""Running ahead on a GPU decodes what reading each step first decodes: the same answers, token for token.

    python results/deep_gpu/run_ahead_check.py --dtype float32 --batch_sizes 1 4 --questions 8 --max_new_tokens 128

For each batch size, the first MT-Bench turns are decoded with the packaged adapter, captured compiled steps, PPD
and the baseline, once with ``PPD_RUN_AHEAD=0`` (each step's report read before the next step is queued) and once
with ``1`` (``ppd.decoding.loop.decode`` queues the next step first). Prints and writes, per batch size and
method, how many answers are identical between the two, and between PPD and the baseline in each.
"""

import argparse
import json
import os
import sys

from eval.batch_speed import prompts_for
from ppd.config import DecodeConfig
from ppd.decoding.loop import RUN_AHEAD_ENV
from ppd.ppd_model import PPDModel


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--capture", default="compiled_graph")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    model = PPDModel.from_pretrained(device=args.device, dtype=args.dtype)
    decoder = model.decoder
    prompts = prompts_for(model.tokenizer, "mt_bench", args.questions)
    rows = []
    for batch in args.batch_sizes:
        answers = {}
        for method in ("ppd", "baseline"):
            config = DecodeConfig(method=method, max_new_tokens=args.max_new_tokens, capture=args.capture)
            for ahead in ("0", "1"):
                os.environ[RUN_AHEAD_ENV] = ahead
                answers[method, ahead] = [o.token_ids for i in range(0, len(prompts), batch)
                                          for o in decoder.generate(prompts[i: i + batch], config)]

        def same(a, b) -> int:
            return sum(x == y for x, y in zip(answers[a], answers[b]))

        row = {"batch_size": batch, "answers": len(prompts),
               "ppd_ahead_equals_read_first": same(("ppd", "1"), ("ppd", "0")),
               "baseline_ahead_equals_read_first": same(("baseline", "1"), ("baseline", "0")),
               "ppd_equals_baseline_read_first": same(("ppd", "0"), ("baseline", "0")),
               "ppd_equals_baseline_ahead": same(("ppd", "1"), ("baseline", "1"))}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"dtype": args.dtype, "capture": args.capture, "max_new_tokens": args.max_new_tokens, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
