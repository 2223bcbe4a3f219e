"""Long prompts of real conversation text, written as a conversations file, for training at long context.

Usage:
    python -m data_gen.long_prompts --output_path data/long_prompts.json --count 2000 \\
        --min_tokens 1024 --max_tokens 7936 [--start 3000] [--stride 4] [--data_path SOURCE] [--model MODEL]

Each record is one user turn (``ppd.long_prompts``: a transcript of consecutive source conversations, then the
question of the conversation after them) whose chat prompt has a length drawn uniformly from ``--min_tokens`` to
``--max_tokens`` (``--seed``). The model then answers them like any conversations file, and the replies are cut
and distilled as usual::

    python -m data_gen.generate --dataset_type conversations --data_path data/long_prompts.json \\
        --output_path data/long_sd --max_turns 1 --max_new_tokens 256 --model_max_length 8192
    python -m data_gen.generate --dataset_type finetune --data_path data/long_sd --output_path data/long_cuts \\
        --model_max_length 8192 --cuts_per_conversation 32 --num_prompt_tokens 5
    python -m data_gen.generate --dataset_type distillation --data_path data/long_cuts ... --teacher forced

Prompt tokens trained on such data have seen the positions and the attention spread they meet at long context
(``eval.long_context`` decodes them). The prompts use the source's conversations from ``--start`` on only:
``eval.long_context`` cuts its prompts from the first conversations, so the default start keeps its text out of the
training data (each record names the conversations it uses, ``long_prompt.first`` to ``long_prompt.question``).
Prompts that the source cannot fill stop the file early, with a warning; the file is written atomically.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys

from tqdm.auto import tqdm

from ppd.files import atomic_write_json
from ppd.long_prompts import SLACK, conversation_source, iter_long_prompts
from ppd.models import DEFAULT_MODEL, load_tokenizer

logger = logging.getLogger("data_gen")

DEFAULT_START = 3000  # past the conversations eval.long_context cuts its prompts from (the first ~100)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m data_gen.long_prompts", description=__doc__.split("\n")[0])
    parser.add_argument("--output_path", required=True, help="JSON file of conversations (one user turn each)")
    parser.add_argument("--count", type=int, required=True, help="prompts to write")
    parser.add_argument("--min_tokens", type=int, default=1024, help="shortest prompt, in chat-template tokens")
    parser.add_argument("--max_tokens", type=int, default=7936,
                        help="longest prompt (leave room for the reply within the model's context)")
    parser.add_argument("--start", type=int, default=DEFAULT_START,
                        help="first usable source conversation the prompts may use (default: %(default)s)")
    parser.add_argument("--stride", type=int, default=4,
                        help="questions at least this many conversations apart, so that transcripts overlap less")
    parser.add_argument("--data_path", default=None, help="conversations (default: the embedded ShareGPT file)")
    parser.add_argument("--model", "--model_name_or_path", dest="model", default=DEFAULT_MODEL,
                        help="alias, folder or hub id whose tokenizer and chat template count the tokens")
    parser.add_argument("--chat_template", default="auto", help="auto | plain | none | FILE.jinja (see data_gen)")
    parser.add_argument("--seed", type=int, default=42, help="seed of the prompt lengths")
    return parser


def check_args(args: argparse.Namespace) -> None:
    if args.count < 1:
        raise ValueError(f"--count must be at least 1, got {args.count}")
    if not SLACK < args.min_tokens <= args.max_tokens:
        raise ValueError(f"--min_tokens {args.min_tokens} and --max_tokens {args.max_tokens}: need "
                         f"{SLACK} < min_tokens <= max_tokens")
    if args.start < 0 or args.stride < 1:
        raise ValueError(f"--start must be at least 0 and --stride at least 1, got {args.start} and {args.stride}")


def build(args: argparse.Namespace) -> list[dict]:
    """The records, in order: ShareGPT-style conversations of one human turn, with what each prompt is made of."""
    tokenizer = load_tokenizer(args.model, args.chat_template)
    rng = random.Random(args.seed)
    lengths = [rng.randint(args.min_tokens, args.max_tokens) for _ in range(args.count)]
    description, conversations = conversation_source(args.data_path)
    if args.start >= len(conversations):
        raise ValueError(f"--start {args.start} is past the source's {len(conversations)} usable conversations")
    records = []
    prompts = iter_long_prompts(tokenizer, lengths, args.data_path, start=args.start, stride=args.stride)
    for prompt in tqdm(prompts, total=args.count, unit="prompt", desc="long prompts"):
        records.append({
            "id": f"long-{prompt.question}-{len(prompt.ids)}",
            "conversations": [{"from": "human", "value": prompt.text}],
            "long_prompt": {"tokens": len(prompt.ids), "first": prompt.first, "question": prompt.question,
                            "source": description},
        })
    if len(records) < args.count:
        logger.warning("the source's conversations from %d on hold text for %d prompts, not %d", args.start,
                       len(records), args.count)
    return records


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = make_parser().parse_args(argv)
    try:
        check_args(args)
        records = build(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    atomic_write_json(args.output_path, records)
    tokens = sorted(r["long_prompt"]["tokens"] for r in records)
    if tokens:
        print(f"{len(records)} prompts of {tokens[0]}-{tokens[-1]} tokens (median {tokens[len(tokens) // 2]}) from "
              f"conversations {records[0]['long_prompt']['first']}-{max(r['long_prompt']['question'] for r in records)}"
              f" -> {args.output_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
