"""Generate an answer to one prompt with PPD or the autoregressive baseline, and report the speed.

Usage:
    python -m application.generate --model smollm2-135m-instruct --prompt "Why is the sky blue?" \
        --max_new_tokens 128 --method ppd [--adapter DIR] [--temperature T] [--json]

The prompt is wrapped in the model's chat template as one user message (its default system prompt
included); ``--raw`` sends it as plain text instead. ``--json`` prints one JSON object with the text,
token ids and statistics (``new_tokens``, ``steps``, ``accept_length``, ``tokens_per_s``).
"""

from __future__ import annotations

import argparse
import json
import sys

from ppd.chat import chat_input_ids, plain_input_ids
from ppd.cli import (add_adapter_args, add_decode_args, add_engine_args, add_model_args, decode_config,
                     load_decoder_or_exit)
from ppd.decoder import PromptTooLongError


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m application.generate", description=__doc__.split("\n")[0])
    add_model_args(parser)
    add_adapter_args(parser)
    add_engine_args(parser)
    add_decode_args(parser)
    parser.add_argument("--prompt", required=True, help="the user message")
    parser.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the answer")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        config = decode_config(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    loaded = load_decoder_or_exit(args, with_prompt_tokens=args.method == "ppd")
    tokenizer = loaded.tokenizer
    if args.raw:
        ids = plain_input_ids(tokenizer, args.prompt)
    else:
        ids = chat_input_ids(tokenizer, [{"role": "user", "content": args.prompt}])
    try:
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


if __name__ == "__main__":
    sys.exit(main())
