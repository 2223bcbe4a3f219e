"""Prompt lookup alone on known greedy answers: accept length with one chain (the latest occurrence, as
``ppd.decoding.lookup`` finds it) against several chains (the latest occurrences with distinct continuations), a
longer n-gram and a longer chain. Text only, no model: greedy verification accepts a chain's longest prefix that the
answer continues with.

    PYTHONPATH=. python results/lookup/chains_alone.py results/eval/h200_captured/answers/mt_bench-baseline-float32-0000.jsonl
"""

import sys

from eval.replay import read_records, answers_of_records
from ppd.replay import chain_matched


def chains(text, nodes, count, ngram):
    """Up to ``count`` distinct chains of ``nodes`` tokens: those after the latest occurrences of the text's last
    ``ngram`` tokens, else of shorter endings."""
    found = []
    for n in range(ngram, 0, -1):
        ending = list(text[-n:])
        for start in range(len(text) - n - 1, -1, -1):
            if list(text[start: start + n]) == ending:
                c = list(text[start + n: start + n + nodes])
                if c and c not in found:
                    found.append(c)
                    if len(found) == count:
                        return found
        if found:
            return found
    return found


def accept(answers, nodes, count, ngram):
    """New tokens per step after the prefill, every step verifying the chains alone."""
    tokens = steps = 0
    for a in answers:
        prompt, ans = a.prompt, a.tokens
        at = 0  # index of the last emitted token (the prefill emitted ans[0])
        while at < len(ans) - 1:
            text = prompt + ans[: at + 1]
            best = max((chain_matched(c, ans, at + 1) for c in chains(text, nodes, count, ngram)), default=0)
            at += 1 + best
            steps += 1
        tokens += len(ans)
    return tokens / steps


if __name__ == "__main__":
    from ppd.models import load_tokenizer
    tok = load_tokenizer("smollm2-135m-instruct")
    answers = [a for a in answers_of_records(read_records(sys.argv[1]), tok) if a.tokens]
    print(len(answers), "answers")
    for nodes, count, ngram in [(8, 1, 3), (8, 2, 3), (8, 3, 3), (8, 1, 4), (8, 2, 4), (16, 1, 3), (4, 2, 3), (4, 4, 3)]:
        print(f"chain {nodes} x {count}, ngram {ngram}: accept {accept(answers, nodes, count, ngram):.3f}")
