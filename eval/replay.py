"""Replay tree sets on known greedy answers: each one's accept length, without decoding.

Usage:
    python -m eval.replay --answers results/answers/mt_bench-baseline.jsonl \\
        --trees results/trees/tree_*.json [--choices fixed confident] [--adapter DIR] [--top_k 10] [--limit K] \\
        [--paths_output results/trees/path_stats.json] [--output results/replay/mt_bench.json]
    python -m eval.replay --conversations data/self_distill --eval_size 0.02 --seed 42 --trees ...

The answers are either the records of ``eval.gen_answers`` made with temperature 0 (any method: greedy text
is the same), each turn's prompt rebuilt as gen_answers built it, or the replies of a ``conversations``
dataset of ``data_gen.generate`` made greedily, each prompt the chat template over the conversation before
the reply. ``--eval_size``/``--seed`` pick the same held-out conversations as ``ppd.training.heldout_split``
does on that dataset (``--eval_size 0``: all of them). One packed forward per answer gives the prompt
tokens' guesses at every position; ``ppd.replay`` then counts the steps greedy PPD takes with each tree set
(by default the one the decoder would use: ``--tree``, the adapter's for this device and dtype, or the
packaged one), each as its file says or, with ``--choices``, with its candidates chosen each way named
(``fixed`` paths, or ``confident``: chosen per step from the guesses' probabilities), and with ``--lookup L`` a
prompt-lookup chain of L nodes beside each fixed tree (``ppd.decoding.lookup``; 0: none). ``--paths_output``
writes how often each path of ranks was accepted, for ``eval.build_trees --paths``: count them on held-out
conversations, never on benchmark answers, so that the trees are not fitted to the questions they are
measured on. Replaying answers made in another dtype takes their text as this dtype's.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from ppd.chat import chat_input_ids
from ppd.cli import LOAD_ERRORS, add_adapter_args, add_model_args, load_decoder_or_exit
from ppd.models import DEFAULT_MODEL, resolve_model
from ppd.replay import DEFAULT_CUTS_PER_FORWARD, DEFAULT_SLOTS_PER_FORWARD, PathStats, guess_top, match_paths, replay
from ppd.training import PromptTokenModel, heldout_split
from ppd.tree import CandidateChoice, TreeSet

from .benchmarks import load_benchmark
from .gen_answers import prompt_ids, turn_messages
from .records import UNKNOWN, environment, recorded, write_json

MIN_TOP_K = 10


@dataclass
class Answer:
    prompt: list[int]
    tokens: list[int]  # every token the decoder emitted, the final EOS included


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.replay", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--answers", help="JSONL of eval.gen_answers (temperature 0)")
    source.add_argument("--conversations", help="a conversations dataset of data_gen.generate (greedy replies)")
    parser.add_argument("--eval_size", type=float, default=0.02,
                        help="conversations: held out as in train.train (share or count; 0 = all)")
    parser.add_argument("--seed", type=int, default=42, help="conversations: as in train.train")
    add_model_args(parser)
    parser.set_defaults(model=None)  # answers: the model that wrote them
    add_adapter_args(parser)
    parser.add_argument("--trees", nargs="+", default=None,
                        help="tree-set JSON files to replay (default: the tree set the decoder would use)")
    parser.add_argument("--choices", nargs="+", choices=[c.value for c in CandidateChoice], default=None,
                        help="replay each tree set with its candidates chosen each of these ways (default: as each "
                             "set says)")
    parser.add_argument("--top_k", type=int, default=None,
                        help=f"ranks kept per guess (default: the trees' largest top_k, at least {MIN_TOP_K})")
    parser.add_argument("--limit", type=int, default=None, help="replay the first K answers only")
    parser.add_argument("--cuts_per_forward", type=int, default=DEFAULT_CUTS_PER_FORWARD,
                        help="positions per forward pass, at most (bounds memory)")
    parser.add_argument("--slots_per_forward", type=int, default=DEFAULT_SLOTS_PER_FORWARD,
                        help="batch rows x width of a forward pass, at most (bounds memory)")
    parser.add_argument("--paths_output", default=None, help="path_stats.json: accepted paths (eval.build_trees)")
    parser.add_argument("--output", default=None, help="result JSON")
    return parser


def read_records(path: str) -> list[dict]:
    """Greedy answer records of eval.gen_answers, the first run of each question and turn."""
    records, seen = [], set()
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{number} is not JSON") from None
        missing = {"bench", "question_id", "turn", "token_ids", "text"} - set(record)
        if missing:
            raise ValueError(f"{path}:{number} is not an eval.gen_answers record: no {', '.join(sorted(missing))}")
        if recorded(record, "temperature") != 0:
            raise ValueError(f"{path}:{number} was sampled (temperature {recorded(record, 'temperature')}): "
                             "replay needs greedy answers")
        records.append(record)
    if not records:
        raise ValueError(f"{path} holds no answers")
    for field in ("bench", "model"):
        if len(values := {str(recorded(r, field)) for r in records}) > 1:
            raise ValueError(f"{path} mixes answers of several {field}s: {sorted(values)}")
    records.sort(key=lambda r: r.get("run", 0))
    firsts = []
    for record in records:
        key = (record["question_id"], record["turn"])
        if key not in seen:
            seen.add(key)
            firsts.append(record)
    return firsts


def answers_of_records(records: list[dict], tokenizer) -> list[Answer]:
    """Each record's prompt as eval.gen_answers built it: its turn after the earlier turns' recorded answers."""
    bench = records[0]["bench"]
    questions = {q.question_id: q for q in load_benchmark(bench)}
    texts = {(r["question_id"], r["turn"]): r["text"] for r in records}
    answers = []
    for record in sorted(records, key=lambda r: (r["question_id"], r["turn"])):
        qid, turn = record["question_id"], record["turn"]
        question = questions.get(qid)
        if question is None or not 0 <= turn < len(question.turns):
            raise ValueError(f"{bench} has no question {qid!r} with a turn {turn}")
        earlier = [(qid, t) for t in range(turn)]
        if missing := [t for q, t in earlier if (q, t) not in texts]:
            raise ValueError(f"question {qid!r} turn {turn}: the answers to its earlier turns {missing} are missing")
        ids = prompt_ids(tokenizer, bench, turn_messages(question.turns, [texts[k] for k in earlier]))
        answers.append(Answer(ids, list(record["token_ids"])))
    return answers


def read_conversations(path: str, eval_size: float, seed: int):
    """The held-out rows of a greedy conversations dataset, and its metadata."""
    import datasets

    from ppd.dataset_info import DatasetType, PPDDatasetInfo

    dataset = datasets.load_from_disk(path)
    info = PPDDatasetInfo.of(dataset)
    if info.dataset_type != DatasetType.CONVERSATIONS.value:
        raise ValueError(f"{path} is a {info.dataset_type} dataset, not conversations "
                         "(`python -m data_gen.generate --dataset_type conversations`)")
    if info.generation.get("temperature", 0) != 0:
        raise ValueError(f"{path} holds sampled replies (temperature {info.generation['temperature']}): "
                         "replay needs greedy ones")
    _, held_out = heldout_split(dataset, eval_size, seed)
    return (dataset if held_out is None else held_out), info


def answers_of_conversations(rows, tokenizer, eos_id: int | None) -> list[Answer]:
    """Each reply of each conversation, its prompt the chat template over the messages before it. A reply
    that ended at EOS gets that EOS back (the dataset stores replies without it)."""
    answers = []
    for row in rows:
        messages = row["messages"]
        at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if len(at) != len(row["reply_token_ids"]):
            raise ValueError(f"conversation {row['id']!r} has {len(at)} assistant messages but "
                             f"{len(row['reply_token_ids'])} replies")
        for i, reply, reason in zip(at, row["reply_token_ids"], row["finish_reasons"]):
            tokens = list(reply)
            if reason == "eos":
                if eos_id is None:
                    raise ValueError("the replies ended at EOS but the model names no EOS token")
                tokens.append(eos_id)
            answers.append(Answer(chat_input_ids(tokenizer, messages[:i]), tokens))
    return answers


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be at least 1")
    if args.top_k is not None and args.top_k < 1:
        parser.error("--top_k must be at least 1")
    if args.lookup and CandidateChoice.CONFIDENT.value in (args.choices or []):
        parser.error("--lookup chains are built beside fixed trees only: not with --choices confident")
    # What the user names is read before the model loads.
    try:
        named_trees = {name: TreeSet.load(name) for name in args.trees or []}
        if args.answers:
            records = read_records(args.answers)
            made_by = str(recorded(records[0], "model"))
            args.model = args.model or (made_by if made_by != UNKNOWN else DEFAULT_MODEL)
            source = {"answers": args.answers}
        else:
            rows, info = read_conversations(args.conversations, args.eval_size, args.seed)
            args.model = args.model or DEFAULT_MODEL
            source = {"conversations": args.conversations, "eval_size": args.eval_size, "seed": args.seed}
    except LOAD_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    loaded = load_decoder_or_exit(args)
    decoder, tokenizer = loaded.decoder, loaded.tokenizer
    prompt_tokens = decoder.prompt_tokens
    trees = named_trees or {loaded.tree: decoder.trees}
    dtype = str(decoder.dtype).removeprefix("torch.")
    try:
        for name, tree_set in trees.items():
            if tree_set.num_prompt_tokens != prompt_tokens.num_prompt_tokens:
                raise ValueError(f"{name} is built for N={tree_set.num_prompt_tokens} prompt tokens, the adapter "
                                 f"has N={prompt_tokens.num_prompt_tokens}")
        top_k = args.top_k or max(MIN_TOP_K, *(t.top_k for t in trees.values()))
        if too_wide := [name for name, t in trees.items() if t.top_k > top_k]:
            raise ValueError(f"--top_k {top_k} is below the top_k of {', '.join(too_wide)}")
        if args.answers:
            if made_by != UNKNOWN and resolve_model(made_by)[1].model_id != loaded.info.model_id:
                raise ValueError(f"{args.answers} holds answers of {made_by}, not of {args.model}")
            if dtypes := {str(recorded(r, "dtype")) for r in records} - {dtype, UNKNOWN}:
                print(f"note: the answers were made in {', '.join(sorted(dtypes))}, replayed in {dtype}",
                      file=sys.stderr)
            answers = answers_of_records(records, tokenizer)
        else:
            info.check_model(loaded.info.model_id)
            eos = decoder.eos_token_ids
            eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id in eos else min(eos, default=None)
            answers = answers_of_conversations(rows, tokenizer, eos_id)
    except LOAD_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    answers = [a for a in answers if a.tokens][: args.limit]
    if not answers:
        print("error: no answers to replay", file=sys.stderr)
        return 2

    model = PromptTokenModel(loaded.model, prompt_tokens)
    with tqdm(total=len(answers), unit="answer", desc="guesses") as bar:
        guesses = guess_top(model, [a.prompt + a.tokens for a in answers], [len(a.prompt) for a in answers], top_k,
                            args.cuts_per_forward, args.slots_per_forward, progress=bar.update)
    paths = [match_paths(ids, a.prompt + a.tokens, len(a.prompt)) for (ids, _), a in zip(guesses, answers)]
    new_tokens = sum(len(a.tokens) for a in answers)
    V = prompt_tokens.num_ensemble
    results = []
    for name, named_set in trees.items():
        variants = [named_set.chosen(c) for c in args.choices] if args.choices else [named_set]
        for tree_set in variants if args.lookup is None else [v.with_lookup(args.lookup) for v in variants]:
            steps = sum(replay(tree_set, p, len(a.tokens), log_probs, (a.prompt, a.tokens))[1]
                        for p, a, (_, log_probs) in zip(paths, answers, guesses))
            results.append({"tree": name, "choice": tree_set.choice.value, "lookup": tree_set.lookup,
                            "rows": tree_set.max_rows(V),
                            "top_k": tree_set.top_k, "new_tokens": new_tokens, "steps": steps,
                            "accept_length": new_tokens / steps if steps else float(new_tokens)})

    print(f"{len(answers)} answers, {new_tokens} tokens, {loaded.adapter} prompt tokens, {dtype}")
    print("| tree | choice | lookup chain | rows per step | accept length |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['tree']} | {r['choice']} | {r['lookup']} | {r['rows']} | {r['accept_length']:.3f} |")
    if args.paths_output:
        stats = PathStats(prompt_tokens.num_prompt_tokens, top_k, metadata={
            "source": source, "model": loaded.info.model_id, "adapter": loaded.adapter, "num_ensemble": V,
            "dtype": dtype, "answers": len(answers)})
        for p in paths:
            stats.add(p)
        Path(args.paths_output).parent.mkdir(parents=True, exist_ok=True)
        stats.save(args.paths_output)
        print(f"accepted paths of {stats.positions} positions -> {args.paths_output}")
    if args.output:
        write_json(args.output, {"source": source, "model": loaded.info.model_id, "adapter": loaded.adapter,
                                 "dtype": dtype, "top_k": top_k, "answers": len(answers), "new_tokens": new_tokens,
                                 "trees": results, "path_stats": args.paths_output,
                                 "environment": environment(decoder.device)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
