"""`python -m application.generate` end to end on the real default model."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "application.generate", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_json_output_for_both_methods():
    records = {}
    for method in ("ppd", "baseline"):
        proc = run("--model", "smollm2-135m-instruct", "--prompt", "What is the capital of France?",
                   "--max_new_tokens", "24", "--method", method, "--json")
        assert proc.returncode == 0, proc.stderr
        records[method] = json.loads(proc.stdout.strip().splitlines()[-1])
    ppd, base = records["ppd"], records["baseline"]
    for key in ("text", "token_ids", "new_tokens", "steps", "accept_length", "tokens_per_s"):
        assert key in ppd
    assert "Paris" in ppd["text"]
    assert ppd["token_ids"] == base["token_ids"]
    assert ppd["accept_length"] == ppd["new_tokens"] / ppd["steps"]


def test_model_name_or_path_alias_and_bad_flags():
    proc = run("--model_name_or_path", "smollm2-135m-instruct", "--prompt", "Hi", "--max_new_tokens", "0")
    assert proc.returncode == 2 and "max_new_tokens must be >= 1" in proc.stderr
    proc = run("--model", "smollm2-135m-instruct", "--adapter", str(ROOT / "no-such-adapter"), "--prompt", "Hi")
    assert proc.returncode != 0 and "not a ppd adapter" in proc.stderr
