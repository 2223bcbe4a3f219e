"""The evaluation prompts that training data must not contain (``--exclude_eval_prompts``, on by default).

The user turns of MT-Bench, Alpaca Eval, HumanEval and GSM8K, read from the files their packages carry
(``eval.benchmarks``), are looked for in the user turns of every source record (``ppd.contamination``:
whole message after whitespace normalisation, or substring for prompts of 40+ characters). A record that
contains one is dropped and counted. The embedded ShareGPT file holds 20 Alpaca Eval instructions (in 22
user turns), which is why this is on by default.
"""

from __future__ import annotations

import logging

from eval.benchmarks import BENCHMARKS, load_benchmark
from ppd.contamination import PromptIndex
from ppd.conversations import user_texts

logger = logging.getLogger("data_gen")

SKIP_REASON = "contains an evaluation prompt"


def evaluation_prompts() -> tuple[dict[str, str], list[str]]:
    """Every user turn of the evaluation sets that are installed, labelled ``bench:question_id:turn``, and
    the names of those sets. A set whose package is missing is left out with a warning."""
    prompts: dict[str, str] = {}
    found = []
    for bench in BENCHMARKS:
        try:
            questions = load_benchmark(bench)
        except FileNotFoundError as error:
            logger.warning("its prompts cannot be excluded from the training data: %s", error)
            continue
        found.append(bench)
        for question in questions:
            for turn, text in enumerate(question.turns):
                prompts.setdefault(text, f"{bench}:{question.question_id}:{turn}")
    return prompts, found


class EvalPromptFilter:
    """Marks the records that contain an evaluation prompt in a user turn."""

    def __init__(self):
        prompts, self.benchmarks = evaluation_prompts()
        self.index = PromptIndex(prompts)

    def contaminated(self, records: list) -> list[bool]:
        """For each record, whether one of its user turns contains an evaluation prompt."""
        texts, owners = [], []
        for number, record in enumerate(records):
            for text in user_texts(record):
                texts.append(text)
                owners.append(number)
        flags = [False] * len(records)
        for owner, labels in zip(owners, self.index.find(texts)):
            flags[owner] |= bool(labels)
        return flags
