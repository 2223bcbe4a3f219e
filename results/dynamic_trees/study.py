"""Would trees chosen per step from the prompt tokens' own confidence accept more than fixed trees at equal rows?

A fixed tree set keeps the same candidate paths at every step. The prompt tokens' probabilities say, step by
step, how sure each guess is: where the first guess is sure a chain pays, where it is not a wider first level
does. This replays greedy answers (as ``eval.replay``) with two tree choices at each step, both with the
rows of the fixed tree set's tree for that step's key:

- ``fixed``: the tree set as the decoder runs it today (``ppd.replay.replay``);
- ``confident``: the same number of candidate nodes, taken as the rank paths (depth up to the key) with the
  largest product of the prompt tokens' probabilities for their ranks at this step, and the fixed tree's
  attached prompt-token counts handed out largest first in that order (so every step has the fixed tree's
  rows exactly).

Usage (CPU, float32, the shipped prompt tokens; from the project's root):
    PYTHONPATH=. python results/dynamic_trees/study.py --answers results/eval/h200_captured/answers/mt_bench-baseline-float32-0000.jsonl \\
        --trees results/train/v7/runs/maps16-lr3e-3-e3/trees/tree_{8,16,32,64}.json --output results/dynamic_trees/mt_bench.json
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from eval.records import environment, write_json
from eval.replay import answers_of_records, read_records
from ppd.cli import add_adapter_args, add_model_args, load_decoder_or_exit
from ppd.replay import guess_top, match_paths, replay
from ppd.training import PromptTokenModel
from ppd.tree import TreeSet


def rank_paths(depth: int, top_k: int) -> list[np.ndarray]:
    """Every path of ranks of each length 1..depth: one array [count, length] per length."""
    return [np.array(list(itertools.product(range(top_k), repeat=length)), dtype=np.int64)
            for length in range(1, depth + 1)]


def confident_tree(probs: np.ndarray, key: int, nodes: int, paths_by_length: list[np.ndarray]) -> list[tuple]:
    """The ``nodes`` rank paths of depth <= ``key`` with the largest products of ``probs`` [N, K] along them,
    most likely first; a path never comes before its parent (ties: the shorter first)."""
    scored = []
    for length in range(1, key + 1):
        paths = paths_by_length[length - 1]
        score = np.prod(probs[np.arange(length)[None, :], paths], axis=1)
        scored.append((score, np.full(len(paths), length), paths))
    score = np.concatenate([s for s, _, _ in scored])
    lengths = np.concatenate([n for _, n, _ in scored])
    order = np.lexsort((lengths, -score))[:nodes]
    flat = [p for _, _, ps in scored for p in ps]
    return [tuple(int(r) for r in flat[i]) for i in order]


def replay_confident(trees: TreeSet, probs: np.ndarray, paths: list[tuple], answer_length: int,
                     paths_by_length: list[np.ndarray]) -> int:
    """Steps of greedy PPD over one answer when each step's tree is :func:`confident_tree`."""
    counts = {key: sorted(tree.prompt_tokens, reverse=True) for key, tree in trees.trees.items()}
    emitted, steps, key = 1, 0, trees.num_prompt_tokens
    while emitted < answer_length:
        at = emitted - 1
        chosen = confident_tree(probs[at], key, len(counts[key]), paths_by_length)
        attached = dict(zip(chosen, counts[key]))
        attached[()] = trees.trees[key].root_prompt_tokens
        match = paths[at]
        depth = 0
        while depth < len(match) and match[: depth + 1] in attached:
            depth += 1
        key = attached[match[:depth]]
        emitted += depth + 1
        steps += 1
    return steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--answers", required=True)
    parser.add_argument("--trees", nargs="+", required=True)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--output", default=None)
    add_model_args(parser)
    add_adapter_args(parser)
    args = parser.parse_args()
    records = read_records(args.answers)
    tree_sets = {name: TreeSet.load(name) for name in args.trees}
    loaded = load_decoder_or_exit(args)
    answers = [a for a in answers_of_records(records, loaded.tokenizer) if a.tokens][: args.limit]
    top_k = max(t.top_k for t in tree_sets.values())
    model = PromptTokenModel(loaded.model, loaded.decoder.prompt_tokens)
    with tqdm(total=len(answers), unit="answer", desc="guesses") as bar:
        guesses = guess_top(model, [a.prompt + a.tokens for a in answers], [len(a.prompt) for a in answers], top_k,
                            progress=bar.update)
    matches = [match_paths(ids, a.prompt + a.tokens, len(a.prompt)) for (ids, _), a in zip(guesses, answers)]
    new_tokens = sum(len(a.tokens) for a in answers)
    V = loaded.decoder.prompt_tokens.num_ensemble
    rows = []
    for name, trees in tree_sets.items():
        by_length = rank_paths(trees.num_prompt_tokens, trees.top_k)
        fixed = sum(replay(trees, m, len(a.tokens))[1] for m, a in zip(matches, answers))
        confident = sum(replay_confident(trees, probs[:, :, : trees.top_k], m, len(a.tokens), by_length)
                        for (_, probs), m, a in zip(guesses, matches, answers))
        rows.append({"tree": name, "rows": trees.max_rows(V), "new_tokens": new_tokens,
                     "fixed_steps": fixed, "confident_steps": confident,
                     "fixed_accept_length": new_tokens / fixed, "confident_accept_length": new_tokens / confident})
        print(f"| {Path(name).name} | {rows[-1]['rows']} | {new_tokens / fixed:.3f} | {new_tokens / confident:.3f} |",
              flush=True)
    if args.output:
        write_json(args.output, {"answers_file": args.answers, "answers": len(answers), "adapter": loaded.adapter,
                                 "dtype": str(loaded.decoder.dtype).removeprefix("torch."), "trees": rows,
                                 "environment": environment(loaded.decoder.device)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
