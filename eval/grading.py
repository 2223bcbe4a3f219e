"""Answer quality: HumanEval programs run against their tests, and GSM8K final answers.

HumanEval follows the official harness's recipe: prompt + completion + the task's tests + a call of
``check(entry_point)``, run in a separate Python process with a time limit (an infinite loop or a crash
fails that one task, nothing else). Run untrusted completions only in a sandbox you are willing to lose.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def humaneval_completion(text: str) -> str:
    """The function body of a raw completion: cut at the first top-level statement after it."""
    cut = min((i for i in (text.find(s) for s in STOP_SEQUENCES) if i >= 0), default=len(text))
    return text[:cut]


def humaneval_passes(prompt: str, completion: str, test: str, entry_point: str, timeout_s: float = 10.0) -> bool:
    """Whether ``prompt + completion`` passes the task's tests within ``timeout_s`` seconds."""
    program = f"{prompt}{completion}\n\n{test}\n\ncheck({entry_point})\n"
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "task.py")
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(program)
        try:
            result = subprocess.run([sys.executable, path], cwd=folder, capture_output=True, timeout=timeout_s,
                                    env={"PATH": os.environ.get("PATH", ""), "PYTHONHASHSEED": "0"})
        except subprocess.TimeoutExpired:
            return False
    return result.returncode == 0


def gsm8k_reference(answer: str) -> str:
    """The number after ``####`` in a GSM8K reference answer, without thousands separators."""
    return answer.split("####")[-1].strip().replace(",", "")


def gsm8k_prediction(text: str) -> str | None:
    """The model's final number: after '####' or 'answer is' when present, else the last number."""
    for marker in ("####", "answer is", "Answer:"):
        if marker in text:
            found = _NUMBER.findall(text.split(marker)[-1])
            if found:
                return _normalise(found[0])
    found = _NUMBER.findall(text)
    return _normalise(found[-1]) if found else None


def _normalise(number: str) -> str:
    number = number.replace(",", "")
    if "." in number:
        number = number.rstrip("0").rstrip(".")
    return number


def gsm8k_correct(text: str, answer: str) -> bool:
    return gsm8k_prediction(text) == _normalise(gsm8k_reference(answer))
