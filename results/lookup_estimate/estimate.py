"""How much a prompt-lookup branch beside PPD's tree would add to the accept length: an estimate by replay.

Greedy answers are known, so a step's outcome is too (``ppd.replay``). Beside each step's tree this adds a chain of
``L`` tokens found by prompt lookup (the most recent earlier occurrence of the last 3, else 2, else 1 tokens of the
prompt and the text so far, and the ``L`` tokens that followed it). A step accepts the longer of the tree's accepted
path and the chain's matched prefix (the tree on a tie). Where the chain wins, the next step's guesses depend on
what the chain's nodes carry:

- ``bare``: chain nodes carry no prompt tokens. The next step has no guesses: it verifies a chain alone (and the
  root's prompt rows, so that a miss brings guesses back). ``L`` rows more a step.
- ``fed``: every chain node carries the N prompt tokens, so the next step has guesses as after a tree node.
  ``L x (1 + N)`` rows more a step.

Written (twenty-third session) to say whether building it would pay; the decoder has had ``bare`` chains since the
twenty-fourth (``TreeSet.lookup``, ``ppd.decoding.lookup``), and ``ppd.replay.replay`` counts their steps (the
lookup here is its ``lookup_chain``). Writes a JSON record and prints a table.

    python results/lookup_estimate/estimate.py --answers results/eval/h200_captured/answers/mt_bench-baseline-float32-0000.jsonl \\
        --trees results/train/v7/runs/maps16-lr3e-3-e3/trees/tree_{16,32}.json --chains 4 8 \\
        --output results/lookup_estimate/mt_bench.json
"""

from __future__ import annotations

import argparse
import json
import sys

from tqdm.auto import tqdm

from eval.records import environment
from eval.replay import answers_of_records, read_records
from ppd.cli import add_adapter_args, add_model_args, load_decoder_or_exit
from ppd.replay import accepted_depth, chain_matched, fixed_nodes, guess_top, lookup_chain, match_paths, replay
from ppd.training import PromptTokenModel
from ppd.tree import TreeSet


def hybrid_steps(trees: TreeSet, paths, prompt: list[int], answer: list[int], chain: int, fed: bool) -> int:
    """Steps greedy PPD takes for ``answer`` with a lookup chain of ``chain`` tokens beside each step's tree
    (``fed``: chain nodes carry prompt tokens; else a step after a chain's win has no tree)."""
    attached = fixed_nodes(trees)
    n = trees.num_prompt_tokens
    emitted, steps, key = 1, 0, n
    while emitted < len(answer):
        # the root answer[emitted - 1] is emitted; the candidates guess answer[emitted:]
        tree_depth, next_key = 0, n
        if key > 0:
            nodes, match = attached[key], paths[emitted - 1]
            tree_depth = accepted_depth(nodes, match)
            next_key = nodes[match[:tree_depth]]
        chain_depth = chain_matched(lookup_chain(prompt + answer[:emitted], chain), answer, emitted) if chain else 0
        if chain_depth > tree_depth:
            depth, next_key = chain_depth, (n if fed else 0)
        else:
            depth = tree_depth
            if key == 0:
                next_key = n  # a miss after a bare chain: the root's prompt rows
        key = next_key
        emitted += depth + 1
        steps += 1
    return steps


def lookup_steps(prompt: list[int], answer: list[int], chain: int) -> int:
    """Steps of prompt lookup alone: a chain of ``chain`` tokens a step, no tree."""
    emitted, steps = 1, 0
    while emitted < len(answer):
        emitted += chain_matched(lookup_chain(prompt + answer[:emitted], chain), answer, emitted) + 1
        steps += 1
    return steps


LOOP = 32  # an answer loops where its last LOOP tokens occurred earlier in it, verbatim


def loops(answer: list[int]) -> bool:
    """Whether ``answer`` ends in a verbatim repeat of an earlier block of :data:`LOOP` tokens."""
    if len(answer) < 2 * LOOP:
        return False
    tail = answer[-LOOP:]
    return any(answer[i:i + LOOP] == tail for i in range(len(answer) - 2 * LOOP + 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--answers", required=True, help="JSONL of eval.gen_answers (temperature 0)")
    add_model_args(parser)
    parser.set_defaults(model=None)
    add_adapter_args(parser)
    parser.add_argument("--trees", nargs="+", required=True)
    parser.add_argument("--chains", nargs="+", type=int, default=[4, 8], help="lookup chain lengths")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    records = read_records(args.answers)
    args.model = args.model or records[0].get("model")
    loaded = load_decoder_or_exit(args)
    prompt_tokens = loaded.decoder.prompt_tokens
    answers = [a for a in answers_of_records(records, loaded.tokenizer) if a.tokens][: args.limit]
    named = {name: TreeSet.load(name) for name in args.trees}
    top_k = max(10, *(t.top_k for t in named.values()))
    model = PromptTokenModel(loaded.model, prompt_tokens)
    with tqdm(total=len(answers), unit="answer", desc="guesses") as bar:
        guesses = guess_top(model, [a.prompt + a.tokens for a in answers], [len(a.prompt) for a in answers], top_k,
                            progress=bar.update)
    paths = [match_paths(ids, a.prompt + a.tokens, len(a.prompt)) for (ids, _), a in zip(guesses, answers)]
    n = prompt_tokens.num_prompt_tokens
    subsets = {"all": [True] * len(answers)}
    subsets["looping"] = [loops(a.tokens) for a in answers]
    subsets["not looping"] = [not x for x in subsets["looping"]]
    rows = []
    for subset, keep in subsets.items():
        picked = [(p, a) for p, a, k in zip(paths, answers, keep) if k]
        if picked:
            rows += estimate_rows(named, picked, args.chains, n, prompt_tokens.num_ensemble, subset)
    new_tokens = sum(len(a.tokens) for a in answers)
    print(f"{len(answers)} answers, {new_tokens} tokens ({args.answers}); "
          f"{sum(subsets['looping'])} end in a verbatim loop of {LOOP} tokens")
    print("| answers | tree | chain | chain nodes | rows a step | accept length |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['answers']} ({r['count']}) | {r['tree']} | {r['chain']} | {r['chain_nodes']} | {r['rows']} | "
              f"{r['accept_length']:.3f} |")
    if args.output:
        from ppd.files import atomic_write_json

        atomic_write_json(args.output, {"answers": args.answers, "count": len(answers), "new_tokens": new_tokens,
                                        "looping": sum(subsets["looping"]), "adapter": loaded.adapter, "rows": rows,
                                        "command": "python " + " ".join(sys.argv),
                                        "environment": environment(loaded.decoder.device)})
    return 0


def estimate_rows(named: dict[str, TreeSet], picked, chains, n: int, ensemble: int, subset: str) -> list[dict]:
    """Accept lengths over the (match paths, answer) pairs ``picked``: each tree alone, with each chain length
    bare and fed, and prompt lookup alone."""
    answers = [a for _, a in picked]
    new_tokens = sum(len(a.tokens) for a in answers)
    base = {"answers": subset, "count": len(answers), "new_tokens": new_tokens}
    rows = []
    for name, trees in named.items():
        tree_rows = trees.max_rows(ensemble)
        alone = sum(replay(trees, p, len(a.tokens))[1] for p, a in picked)
        check = sum(hybrid_steps(trees, p, a.prompt, a.tokens, 0, False) for p, a in picked)
        if check != alone:
            raise SystemExit(f"the hybrid walk without a chain took {check} steps, replay {alone}: a bug here")
        rows.append({**base, "tree": name, "chain": 0, "chain_nodes": "-", "rows": tree_rows,
                     "accept_length": new_tokens / alone})
        for chain in chains:
            for fed in (False, True):
                steps = sum(hybrid_steps(trees, p, a.prompt, a.tokens, chain, fed) for p, a in picked)
                rows.append({**base, "tree": name, "chain": chain, "chain_nodes": "fed" if fed else "bare",
                             "rows": tree_rows + chain * (1 + n if fed else 1), "accept_length": new_tokens / steps})
    for chain in chains:  # prompt lookup alone (transformers' prompt_lookup_num_tokens, one chain a step)
        steps = sum(lookup_steps(a.prompt, a.tokens, chain) for a in answers)
        rows.append({**base, "tree": "none (prompt lookup alone)", "chain": chain, "chain_nodes": "bare",
                     "rows": chain, "accept_length": new_tokens / steps})
    return rows


if __name__ == "__main__":
    sys.exit(main())
