"""Generate an answer to one prompt with PPD or the autoregressive baseline, and report the speed.

Usage:
    python -m application.generate --model smollm2-135m-instruct --prompt "Why is the sky blue?" \
        --max_new_tokens 128 --method ppd [--adapter DIR] [--temperature T] [--json] [--compare]

The prompt is wrapped in the model's chat template as one user message (its default system prompt
included); ``--raw`` sends it as plain text instead. ``--json`` prints one JSON object with the text,
token ids and statistics (``new_tokens``, ``steps``, ``accept_length``, ``tokens_per_s``).
``--compare`` answers the prompt with the autoregressive baseline and with PPD, in the same process and
settings (after one short untimed warm-up of each), prints PPD's answer and then both side by side:
tokens/s, accept length, the speed-up and whether the two answers are identical token for token.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from ppd.chat import chat_input_ids, plain_input_ids
from ppd.cli import (add_adapter_args, add_decode_args, add_engine_args, add_model_args, decode_config,
                     load_decoder_or_exit)
from ppd.config import CaptureMode
from ppd.decoder import PromptTooLongError
from ppd.decoding.graphs import resolve_mode


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m application.generate", description=__doc__.split("\n")[0])
    add_model_args(parser)
    add_adapter_args(parser)
    add_engine_args(parser)
    add_decode_args(parser)
    parser.add_argument("--prompt", required=True, help="the user message")
    parser.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the answer")
    parser.add_argument("--compare", action="store_true",
                        help="answer with the baseline and with PPD and print both side by side (--method is ignored)")
    return parser


def compare(decoder, ids: list[int], config) -> dict:
    """The baseline's and PPD's answers to ``ids`` under ``config``, each after a short untimed warm-up (which
    also compiles, where the engine compiles). Returns each method's output and the speed-up."""
    outputs = {}
    if resolve_mode(config.capture, decoder.device) is not CaptureMode.EAGER:
        print("compiling the decoding steps first (minutes on a small CPU the first time; torch caches the "
              "compiled code for later runs; PPD_CAPTURE=eager skips compiling)", file=sys.stderr, flush=True)
    for method in ("baseline", "ppd"):
        run = replace(config, method=method)
        decoder.warmup(methods=[method], capture=config.capture, sampling=run)
        decoder.generate(ids, replace(run, max_new_tokens=min(8, run.max_new_tokens)))
        outputs[method] = decoder.generate(ids, run)
    speedup = outputs["ppd"].tokens_per_s / outputs["baseline"].tokens_per_s
    return {"outputs": outputs, "speedup": speedup,
            "identical": outputs["ppd"].token_ids == outputs["baseline"].token_ids}


def comparison_table(result: dict) -> str:
    lines = ["| method | new tokens | steps | accept length | tokens/s |", "|---|---|---|---|---|"]
    for method, out in result["outputs"].items():
        lines.append(f"| {method} | {out.new_tokens} | {out.steps} | {out.accept_length:.2f} | {out.tokens_per_s:.1f} |")
    same = "yes" if result["identical"] else "no (greedy answers can differ where two tokens' logits tie to rounding)"
    return "\n".join(lines + ["", f"speed-up of ppd over the baseline: {result['speedup']:.2f}x; "
                                   f"identical answers: {same}"])


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        config = decode_config(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    loaded = load_decoder_or_exit(args, with_prompt_tokens=args.method == "ppd" or args.compare)
    tokenizer = loaded.tokenizer
    if args.raw:
        ids = plain_input_ids(tokenizer, args.prompt)
    else:
        ids = chat_input_ids(tokenizer, [{"role": "user", "content": args.prompt}])
    try:
        if args.compare:
            return _print_comparison(args, loaded, ids, config)
        out = loaded.decoder.generate(ids, config)
    except PromptTooLongError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
    if args.json:
        record = {"text": text, "token_ids": out.token_ids, "prompt_tokens": len(ids), "method": args.method,
                  "model": loaded.info.model_id, "adapter": loaded.adapter, "tree": loaded.tree,
                  **out.stats()}
        print(json.dumps(record))
    else:
        print(text)
        print(f"[{args.method}] {out.new_tokens} tokens in {out.steps} steps, accept length "
              f"{out.accept_length:.2f}, {out.tokens_per_s:.1f} tokens/s", file=sys.stderr)
    return 0


def _print_comparison(args, loaded, ids: list[int], config) -> int:
    result = compare(loaded.decoder, ids, config)
    decoder = loaded.decoder
    mode = resolve_mode(config.capture, decoder.device).value
    setup = (f"{loaded.info.model_id} on {decoder.device.type}, {str(decoder.dtype).removeprefix('torch.')}, "
             f"capture {mode}, weights {'packed' if decoder.packed else 'plain'}, tree {loaded.tree}")
    if args.json:
        print(json.dumps({"prompt_tokens": len(ids), "setup": setup, "speedup": result["speedup"],
                          "identical": result["identical"],
                          **{m: {"text": loaded.tokenizer.decode(o.token_ids, skip_special_tokens=True),
                                 "token_ids": o.token_ids, **o.stats()} for m, o in result["outputs"].items()}}))
        return 0
    print(loaded.tokenizer.decode(result["outputs"]["ppd"].token_ids, skip_special_tokens=True))
    print(f"\n{setup}\n")
    print(comparison_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
