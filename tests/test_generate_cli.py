"""`python -m application.generate` end to end on the real default model."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "application.generate", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def json_by_method(*args: str, ppd_args: tuple[str, ...] = ()) -> dict[str, dict]:
    """`application.generate --json` on the default model with ``args``, as PPD (with ``ppd_args`` too) and as the
    baseline: each method's record (the run must succeed)."""
    records = {}
    for method, extra in (("ppd", ppd_args), ("baseline", ())):
        proc = run("--model", "smollm2-135m-instruct", *args, "--method", method, "--json", *extra)
        assert proc.returncode == 0, proc.stderr
        records[method] = json.loads(proc.stdout.strip().splitlines()[-1])
    return records


def test_json_output_for_both_methods():
    records = json_by_method("--prompt", "What is the capital of France?", "--max_new_tokens", "24")
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
    assert proc.returncode != 0 and "no-such-adapter does not exist" in proc.stderr


def main_in_process(capsys, *args: str) -> tuple[int, str]:
    """`application.generate`'s main in this process (the model stays cached): exit status and stderr."""
    from application.generate import main

    try:
        code = main(list(args))
    except SystemExit as stop:
        code = stop.code
    return code, capsys.readouterr().err


def test_bad_inputs_get_one_line_errors(tmp_path, capsys):
    import torch
    from safetensors.torch import load_file, save_file

    from ppd.prompt_tokens import CONFIG_NAME, WEIGHTS_NAME, packaged_adapter

    shipped = packaged_adapter("HuggingFaceTB/SmolLM2-135M-Instruct")
    nan_adapter, truncated, empty = tmp_path / "nan", tmp_path / "truncated", tmp_path / "empty"
    for folder in (nan_adapter, truncated, empty):
        folder.mkdir()
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        for folder in (nan_adapter, truncated):
            (folder / name).write_bytes((shipped / name).read_bytes())
    weights = load_file(str(nan_adapter / WEIGHTS_NAME))
    weights["embeddings"][2, 5] = float("nan")
    save_file(weights, str(nan_adapter / WEIGHTS_NAME))
    (truncated / WEIGHTS_NAME).write_bytes((truncated / WEIGHTS_NAME).read_bytes()[:100])
    list_tree = tmp_path / "tree.json"
    list_tree.write_text(json.dumps([[0], [0, 1]]))
    wide_tree = tmp_path / "wide.json"
    wide_tree.write_text(json.dumps({"num_prompt_tokens": 3, "top_k": 60000, "trees": {
        str(k): {"root_prompt_tokens": 1, "nodes": [{"path": [59999], "prompt_tokens": 1}]} for k in (1, 2, 3)}}))

    base = ["--prompt", "Hi", "--max_new_tokens", "4"]
    cases = [
        (["--model", "/nonexistent"], "model folder /nonexistent does not exist"),
        (["--adapter", str(empty)], "is not a ppd adapter"),
        (["--adapter", str(nan_adapter)], "1 of 1728 prompt-token values that are not finite"),
        (["--adapter", str(truncated)], f"{WEIGHTS_NAME} cannot be read as a safetensors file"),
        (["--tree", str(list_tree)], "holds a JSON list, not an object"),
        (["--tree", str(wide_tree)], "top-60000 tokens, more than the model's vocabulary of 49152"),
        (["--temperature", "nan"], "temperature must be a finite number"),
        (["--temperature", "inf"], "temperature must be a finite number"),
        (["--posterior_threshold", "-1"], "posterior_threshold must be in (0, 1]"),
        (["--posterior_alpha", "-1"], "posterior_alpha must be a finite number > 0"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "sees no CUDA device"))
    for extra, message in cases:
        code, err = main_in_process(capsys, *base, *extra)
        assert code == 2, (extra, err)
        last = err.strip().splitlines()[-1]  # after transformers' weight-loading bar, where a model loads
        assert last.startswith("error: ") and message in last and "Traceback" not in err, (extra, err)


def test_compare_prints_both_methods_side_by_side(capsys):
    """What `make demo` runs: the baseline and PPD on one prompt, with the speed-up and whether they agree."""
    from application.generate import main

    proc = run("--prompt", "Explain in three sentences why the sky is blue.", "--max_new_tokens", "32", "--compare")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    base_line = next(line for line in out.splitlines() if line.startswith("| baseline | 32 |"))
    ppd_line = next(line for line in out.splitlines() if line.startswith("| ppd | 32 |"))
    assert int(ppd_line.split("|")[3]) < int(base_line.split("|")[3]), "the prompt tokens should save steps"
    assert "speed-up of ppd over the baseline:" in out and "identical answers: yes" in out
    assert main(["--prompt", "What is the capital of France?", "--max_new_tokens", "8", "--compare", "--json"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["ppd"]["token_ids"] == record["baseline"]["token_ids"] and record["identical"]
    assert record["speedup"] == record["ppd"]["tokens_per_s"] / record["baseline"]["tokens_per_s"]
