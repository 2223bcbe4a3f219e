"""`python -m data_gen.generate` on the real default model and real ShareGPT records (small counts, CPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch

import data_gen.generate as generate
from data_gen.shards import lock_path
from ppd import load_tokenizer
from ppd.conversations import load_conversations
from ppd.dataset_info import PPDDatasetInfo

ROOT = Path(__file__).resolve().parents[1]
N, TOP_K, MAX_LEN = 3, 8, 160


@pytest.fixture(scope="module")
def sharegpt_file(tmp_path_factory):
    """Real ShareGPT records with short first exchanges (so the CPU teacher stays quick), as JSONL."""
    records = [r for r in load_conversations().records[:400]
               if len(r["conversations"]) == 2 and sum(len(t["value"]) for t in r["conversations"]) < 1500][:12]
    path = tmp_path_factory.mktemp("src") / "sharegpt.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def make(tmp_path, name, *extra):
    argv = ["--output_path", str(tmp_path / name), "--num_prompt_tokens", str(N),
            "--model_max_length", str(MAX_LEN), "--top_k", str(TOP_K), *extra]
    assert generate.main(argv) == 0
    return datasets.load_from_disk(str(tmp_path / name))


@pytest.fixture(scope="module")
def distilled(sharegpt_file, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("distill")
    return make(tmp, "out", "--dataset_type", "distillation", "--data_path", str(sharegpt_file),
                "--shard_size", "4", "--batch_tokens", "512")


def test_truncated_dataset_columns_and_metadata(sharegpt_file, tmp_path):
    dataset = make(tmp_path, "ft", "--dataset_type", "finetune", "--data_path", str(sharegpt_file), "--seed", "3")
    assert set(dataset.column_names) == {"id", "input_ids", "labels"}
    assert all(len(labels) == N + 1 for labels in dataset["labels"])
    assert all(len(a) + len(b) <= MAX_LEN for a, b in zip(dataset["input_ids"], dataset["labels"]))
    info = PPDDatasetInfo.of(dataset)
    assert (info.model, info.num_prompt_tokens, info.model_max_length, info.seed, info.top_k) == \
        ("HuggingFaceTB/SmolLM2-135M-Instruct", N, MAX_LEN, 3, None)
    assert info.source == str(sharegpt_file.resolve()) and info.summary["rows"] == len(dataset)
    assert not (tmp_path / "ft.shards").exists()  # merged and cleaned up


def test_stored_teacher_topk_equals_a_fresh_forward(distilled, real_model):
    model, _, _ = real_model
    info = PPDDatasetInfo.of(distilled)
    assert info.top_k == TOP_K and info.teacher_dtype == "float32" and len(distilled) >= 6
    for row in distilled:
        ids = list(row["input_ids"])
        stored_ids = torch.tensor(row["teacher_topk_ids"])
        stored = torch.tensor(row["teacher_topk_logprobs"])
        assert stored_ids.shape == stored.shape == (N, TOP_K)
        for step in range(N + 1):
            with torch.no_grad():
                fresh = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            assert fresh.argmax().item() == row["teacher_token_ids"][step]
            if step > 0:
                # The stored entries are the fresh log-probabilities of those ids, and they are the top k:
                # the k-th largest fresh value matches (robust to near-ties swapping order).
                torch.testing.assert_close(fresh[stored_ids[step - 1].long()], stored[step - 1], atol=1e-4, rtol=0)
                torch.testing.assert_close(fresh.topk(TOP_K).values, stored[step - 1], atol=1e-4, rtol=0)
            ids.append(row["teacher_token_ids"][step])


def test_resume_after_an_interruption_gives_the_identical_dataset(sharegpt_file, distilled, tmp_path, monkeypatch):
    real_teacher = generate.teacher_topk
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # one teacher batch per shard here
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C while the second shard was running
        return real_teacher(*args, **kwargs)

    argv = ["--dataset_type", "distillation", "--data_path", str(sharegpt_file), "--shard_size", "4",
            "--batch_tokens", "512"]
    monkeypatch.setattr(generate, "teacher_topk", interrupted)
    with pytest.raises(KeyboardInterrupt):
        make(tmp_path, "out", *argv)
    shards = tmp_path / "out.shards"
    assert not (tmp_path / "out").exists()
    done = sorted(p.name for p in shards.iterdir() if p.name.startswith("shard-"))
    assert done == ["shard-00000-of-00003"]
    first_shard = (shards / done[0] / "ppd_shard_summary.json").stat().st_mtime_ns

    calls.clear()
    monkeypatch.setattr(generate, "teacher_topk", lambda *a, **k: calls.append(1) or real_teacher(*a, **k))
    resumed = make(tmp_path, "out", *argv, "--keep_shards")
    assert (shards / done[0] / "ppd_shard_summary.json").stat().st_mtime_ns == first_shard  # not redone
    assert len(calls) == 2  # only the two unfinished shards ran the teacher
    assert resumed.to_list() == distilled.to_list()
    assert PPDDatasetInfo.of(resumed).summary["rows"] == len(distilled)


def test_changed_settings_do_not_mix_with_old_shards(sharegpt_file, tmp_path):
    argv = ["--dataset_type", "finetune", "--data_path", str(sharegpt_file), "--keep_shards"]
    make(tmp_path, "ft", *argv)
    (tmp_path / "ft").rename(tmp_path / "ft-old")
    with pytest.raises(generate.SettingsMismatch, match=r"seed: 42 -> 7"):
        generate.run(generate.make_parser().parse_args_into_dataclasses(
            ["--output_path", str(tmp_path / "ft"), "--num_prompt_tokens", str(N), "--model_max_length",
             str(MAX_LEN), *argv, "--seed", "7"])[0])
    # An existing output is never replaced silently.
    (tmp_path / "ft-old").rename(tmp_path / "ft")
    assert generate.main(["--output_path", str(tmp_path / "ft"), *argv]) == 1


def test_bad_records_are_counted_not_fatal(sharegpt_file, tmp_path, capsys):
    good = sharegpt_file.read_text().splitlines()[:3]
    bad = ['{"id": "cut off', json.dumps({"id": "no-turns"}),
           json.dumps({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": ""}]}),
           json.dumps({"conversations": [{"from": "human", "value": "only a question"}]})]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(good + bad) + "\n")
    dataset = make(tmp_path, "ft", "--dataset_type", "finetune", "--data_path", str(path))
    summary = PPDDatasetInfo.of(dataset).summary
    assert len(dataset) == 3 and summary["items"] == 7
    assert summary["skipped"] == {"invalid JSON line": 1, "no 'conversations', 'messages' or 'text'": 1,
                                  "empty message": 1, "no assistant reply": 1}
    assert "skipped:" in capsys.readouterr().out

    only_bad = tmp_path / "bad.jsonl"
    only_bad.write_text("\n".join(bad) + "\n")
    code = generate.main(["--dataset_type", "finetune", "--data_path", str(only_bad),
                          "--output_path", str(tmp_path / "empty")])
    err = capsys.readouterr().err
    assert code == 1 and "no examples: 4 records read, none usable" in err and "1 empty message" in err
    assert not (tmp_path / "empty").exists()


def test_wrong_model_for_a_truncated_dataset_is_refused(sharegpt_file, tmp_path):
    from tests.conftest import tiny_model

    make(tmp_path, "ft", "--dataset_type", "finetune", "--data_path", str(sharegpt_file))
    folder = tmp_path / "tiny"
    tiny_model().save_pretrained(folder)
    load_tokenizer("smollm2-135m-instruct").save_pretrained(folder)  # another model, same tokenizer family
    args = generate.make_parser().parse_args_into_dataclasses(
        ["--dataset_type", "distillation", "--data_path", str(tmp_path / "ft"), "--model", str(folder),
         "--output_path", str(tmp_path / "d")])[0]
    with pytest.raises(ValueError, match="tokenised for HuggingFaceTB/SmolLM2-135M-Instruct"):
        generate.run(args)


def test_impossible_flags_are_rejected():
    with pytest.raises(SystemExit) as exit_info:
        generate.main(["--dataset_type", "finetune", "--output_path", "x", "--num_special_tokens", "0"])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        generate.main(["--dataset_type", "finetune", "--output_path", "x", "--load_in_4bit"])


def test_two_processes_with_accelerate_match_one(sharegpt_file, distilled, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "-m", "data_gen.generate", "--dataset_type", "distillation", "--data_path", str(sharegpt_file),
           "--output_path", str(tmp_path / "out"), "--num_prompt_tokens", str(N), "--model_max_length",
           str(MAX_LEN), "--top_k", str(TOP_K), "--shard_size", "4", "--batch_tokens", "512"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = datasets.load_from_disk(str(tmp_path / "out"))
    assert merged["id"] == distilled["id"] and merged["input_ids"] == distilled["input_ids"]
    assert merged["teacher_token_ids"] == distilled["teacher_token_ids"]
    assert merged["teacher_topk_ids"] == distilled["teacher_topk_ids"]
    # One thread per process here, two in the reference run: float sums round differently, ids do not move.
    torch.testing.assert_close(torch.tensor(merged["teacher_topk_logprobs"]),
                               torch.tensor(distilled["teacher_topk_logprobs"]), atol=1e-4, rtol=0)


def _must_not_run(*args, **kwargs):
    raise AssertionError("started work before checking the output path")


def test_overwrite_refuses_what_data_gen_did_not_make(sharegpt_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(generate, "resolve_model", _must_not_run)
    argv = ["--dataset_type", "finetune", "--data_path", str(sharegpt_file), "--overwrite"]
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("keep me")
    assert generate.main(["--output_path", str(mine), *argv]) == 1
    assert capsys.readouterr().err == (
        f"data_gen: error: --overwrite replaces only a dataset made by data_gen, and {mine} is not one (it holds "
        "notes.txt, sub/): remove it yourself or choose another --output_path\n")
    assert (mine / "notes.txt").read_text() == "keep me" and (mine / "sub").is_dir()

    plain = tmp_path / "plain"  # a datasets folder, but not one data_gen made
    datasets.Dataset.from_dict({"x": [1, 2]}).save_to_disk(str(plain))
    assert generate.main(["--output_path", str(plain), *argv]) == 1
    assert "(a dataset without ppd metadata (not made by data_gen))" in capsys.readouterr().err
    assert datasets.load_from_disk(str(plain))["x"] == [1, 2]

    (tmp_path / "fresh.shards").mkdir()  # the shard folder's name, holding the user's file
    (tmp_path / "fresh.shards" / "results.csv").write_text("1,2")
    assert generate.main(["--output_path", str(tmp_path / "fresh"), *argv]) == 1
    assert f"{tmp_path / 'fresh.shards'}, where data_gen keeps the work for {tmp_path / 'fresh'}, holds what " \
           "data_gen did not make (it holds results.csv)" in capsys.readouterr().err
    assert (tmp_path / "fresh.shards" / "results.csv").exists()


def test_overwrite_replaces_a_dataset_data_gen_made(sharegpt_file, tmp_path):
    argv = ["--dataset_type", "finetune", "--data_path", str(sharegpt_file), "--keep_shards"]
    make(tmp_path, "ft", *argv)
    (tmp_path / "ft" / "cache-0123456789abcdef.arrow").write_bytes(b"")  # what training's map leaves beside it
    replaced = make(tmp_path, "ft", *argv, "--seed", "7", "--overwrite")
    assert PPDDatasetInfo.of(replaced).seed == 7
    assert not (tmp_path / "ft" / "cache-0123456789abcdef.arrow").exists()


def test_an_output_path_that_is_a_file_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(generate, "resolve_model", _must_not_run)
    monkeypatch.setattr(generate, "load_conversations", _must_not_run)
    path = tmp_path / "out"
    path.write_text("not a dataset")
    for extra in ([], ["--overwrite"]):
        assert generate.main(["--dataset_type", "finetune", "--output_path", str(path), *extra]) == 1
        assert capsys.readouterr().err == \
            f"data_gen: error: {path} is a file, not a folder data_gen made: choose another --output_path\n"
    assert path.read_text() == "not a dataset"


# What a running data_gen holds on its output: an exclusive flock on the lock file, which names its pid.
HOLD_LOCK = """import fcntl, os, sys, time
with open(sys.argv[1], "a+") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    lock.write(f"{os.getpid()}\\n")
    lock.flush()
    print("locked", flush=True)
    time.sleep(300)
"""


def test_a_second_run_on_the_same_output_is_refused_at_once(sharegpt_file, tmp_path, capsys, monkeypatch):
    output = tmp_path / "out"
    argv = ["--dataset_type", "finetune", "--data_path", str(sharegpt_file)]
    first = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(lock_path(output))], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert first.stdout.readline().strip() == "locked"
        with monkeypatch.context() as patch:
            patch.setattr(generate, "resolve_model", _must_not_run)
            assert generate.main(["--output_path", str(output), *argv]) == 1
            assert generate.main(["--output_path", str(output), *argv, "--overwrite"]) == 1
        err = capsys.readouterr().err
        assert err.count(f"data_gen: error: {output} is being written by another data_gen run (process {first.pid}, "
                         f"lock {lock_path(output)}): wait for it to finish, or choose another --output_path") == 2
        assert not output.exists() and not (tmp_path / "out.shards").exists()
    finally:
        first.kill()  # SIGKILL: no clean-up runs, the lock file stays
        first.wait()
    assert lock_path(output).exists()  # stale: the kernel dropped the lock with the process
    assert len(make(tmp_path, "out", *argv)) > 0
