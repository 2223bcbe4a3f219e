"""Wall time of a decoder's prefill with the dense mask against plain causal attention (``PPD_CAUSAL_PREFILL``).

The default model and adapter, B prompts of about L tokens (random ids from the model's vocabulary, each row 7
tokens shorter than the one before, so the rows are padded), PPD with one new token (the prefill and the first
token), eager, alternating off and on three times each:

    python results/cpu/causal_prefill/prefill_time.py 2 3000 --output results/cpu/causal_prefill/b2_3000.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from ppd import DecodeConfig, Decoder, PromptTokens, eos_ids_of, load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("batch", type=int)
    parser.add_argument("length", type=int)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    model, tokenizer, info = load_model("smollm2-135m-instruct")
    tokens = PromptTokens.from_pretrained("ppd/adapters/smollm2-135m-instruct", model)
    decoder = Decoder(model, tokens, eos_token_ids=eos_ids_of(model, tokenizer))
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 20000, (args.length - 7 * b,), generator=generator).tolist()
               for b in range(args.batch)]
    config = DecodeConfig(method="ppd", max_new_tokens=1, capture="eager")
    decoder.generate(prompts, config)  # untimed: the first forward allocates the cache
    seconds, first = {"off": [], "on": []}, {}
    for _ in range(args.repeats):
        for switch in ("off", "on"):
            os.environ["PPD_CAUSAL_PREFILL"] = switch
            start = time.perf_counter()
            outs = decoder.generate(prompts, config)
            seconds[switch].append(time.perf_counter() - start)
            first[switch] = [o.token_ids for o in outs]
    median = {switch: sorted(times)[args.repeats // 2] for switch, times in seconds.items()}
    result = {"batch": args.batch, "prompt_tokens": [len(p) for p in prompts], "seconds": seconds,
              "speed_up_of_median": median["off"] / median["on"],
              "same_first_tokens": first["on"] == first["off"], "dtype": str(next(model.parameters()).dtype),
              "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
              "torch": torch.__version__}
    print(json.dumps(result, indent=1))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
