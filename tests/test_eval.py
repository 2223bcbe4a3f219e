"""Evaluation: benchmark loaders on their real files, grading, the report's arithmetic, and an end-to-end run."""

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from eval import report
from eval.benchmarks import load_benchmark
from eval.grading import gsm8k_correct, gsm8k_prediction, humaneval_completion, humaneval_passes
from ppd.prompt_tokens import packaged_adapter

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("bench, count, turns", [("mt_bench", 80, 2), ("alpaca_eval", 805, 1), ("humaneval", 164, 1),
                                                 ("gsm8k", 1319, 1)])
def test_loaders_read_the_real_files(bench, count, turns):
    questions = load_benchmark(bench)
    assert len(questions) == count and len({q.question_id for q in questions}) == count
    assert all(len(q.turns) == turns and all(t.strip() for t in q.turns) for q in questions)


def test_humaneval_execution_marks_right_wrong_and_hanging_programs():
    task = load_benchmark("humaneval")[0]
    ref = task.reference
    assert humaneval_passes(ref["prompt"], ref["canonical_solution"], ref["test"], ref["entry_point"])
    assert not humaneval_passes(ref["prompt"], "    return False\n", ref["test"], ref["entry_point"])
    assert not humaneval_passes(ref["prompt"], "    while True:\n        pass\n", ref["test"], ref["entry_point"],
                                timeout_s=2.0)
    assert humaneval_completion("    return 1\n\ndef other():\n    pass") == "    return 1\n"


def test_every_humaneval_canonical_solution_passes_the_grader():
    tasks = load_benchmark("humaneval")

    def passes(task):
        ref = task.reference
        return humaneval_passes(ref["prompt"], ref["canonical_solution"], ref["test"], ref["entry_point"])

    with ThreadPoolExecutor(max_workers=4) as pool:
        failed = [t.question_id for t, ok in zip(tasks, pool.map(passes, tasks)) if not ok]
    assert failed == []


def test_gsm8k_answer_extraction():
    assert gsm8k_prediction("So she makes 9 * 2 = $18 every day.\n#### 18") == "18"
    assert gsm8k_prediction("The answer is 1,200.") == "1200"
    assert gsm8k_prediction("It costs 3.50 dollars") == "3.5"
    assert gsm8k_prediction("no numbers here") is None
    assert gsm8k_correct("... so the total is 72", "Natalia sold 48/2 = 24 clips.\n#### 72")


def _record(bench, method, qid, tokens, steps, wall, ids, turn=0, text=""):
    return {"bench": bench, "method": method, "question_id": qid, "turn": turn, "run": 0, "new_tokens": tokens,
            "steps": steps, "wall_time_s": wall, "token_ids": ids, "text": text}


def test_report_arithmetic_on_hand_made_records(tmp_path):
    rows = [
        _record("mt_bench", "baseline", "1", 10, 10, 1.0, [1] * 10),
        _record("mt_bench", "baseline", "1", 20, 20, 2.0, [2] * 20, turn=1),
        _record("mt_bench", "hf", "1", 10, 10, 2.0, [1] * 10),
        _record("mt_bench", "hf", "1", 20, 20, 4.0, [2] * 20, turn=1),
        _record("mt_bench", "ppd", "1", 10, 4, 0.5, [1] * 10),
        _record("mt_bench", "ppd", "1", 20, 8, 1.0, [3] * 20, turn=1),
        _record("gsm8k", "ppd", "0", 5, 5, 1.0, [7], text="Janet makes #### 18"),
        _record("gsm8k", "ppd", "1", 5, 5, 1.0, [7], text="#### 4"),
    ]
    path = tmp_path / "answers.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert report.main([str(path), "--output_dir", str(tmp_path / "out")]) == 0
    got = {(r["bench"], r["method"]): r for r in json.loads((tmp_path / "out" / "report.json").read_text())["rows"]}
    assert {r["dtype"] for r in got.values()} == {"-"}  # records that name no dtype form one group
    ppd = got[("mt_bench", "ppd")]
    assert ppd["tokens_per_s"] == pytest.approx(30 / 1.5) and ppd["accept_length"] == pytest.approx(30 / 12)
    assert ppd["speedup_vs_baseline"] == pytest.approx(20 / 10) and ppd["speedup_vs_hf"] == pytest.approx(20 / 5)
    assert ppd["identical_to_baseline"] == pytest.approx(0.5) and ppd["compared_with_baseline"] == 2
    assert got[("mt_bench", "hf")]["speedup_vs_baseline"] == pytest.approx(0.5)
    # GSM8K question 0's answer is 18, question 1's is 3: one of two right.
    assert got[("gsm8k", "ppd")]["quality"] == pytest.approx(0.5)
    assert (tmp_path / "out" / "report.png").stat().st_size > 1000
    assert ("| mt_bench | - | ppd | 2 | 20.0 | 2.50 | - | 2.00x | 4.00x | - | 50.0% | - |"
            in (tmp_path / "out" / "report.md").read_text())


def test_report_compares_methods_within_each_dtype(tmp_path):
    rows = [dict(_record("mt_bench", method, "1", 10, 10 if method != "ppd" else 5, wall, [1] * 10), dtype=dtype)
            for dtype, walls in (("float32", (2.0, 1.0, 0.5)), ("bfloat16", (1.0, 1.0, 0.25)))
            for method, wall in zip(("hf_static", "baseline", "ppd"), walls)]
    path = tmp_path / "answers.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = {(r["dtype"], r["method"]): r for r in report.summarise(report.read_records([str(path)]))}
    assert got[("float32", "ppd")]["speedup_vs_hf_static"] == pytest.approx(4.0)
    assert got[("bfloat16", "ppd")]["speedup_vs_hf_static"] == pytest.approx(4.0)
    assert got[("bfloat16", "ppd")]["speedup_vs_baseline"] == pytest.approx(4.0)
    assert got[("float32", "baseline")]["speedup_vs_hf_static"] == pytest.approx(2.0)


def _answer(**settings):
    """A record with every setting gen_answers writes (baseline, greedy fp32 smollm2 on the CPU, 12 new tokens)."""
    record = dict(_record("mt_bench", "baseline", "81", 4, 2, 1.0, [1, 2, 3, 4]), model="smollm2-135m-instruct",
                  adapter="none", tree="none", dtype="float32", capture="auto", temperature=0.0, max_new_tokens=12,
                  environment={"device": "cpu"})
    record.update(settings)
    return record


def _write(path, *records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize("field, a, b", [
    ("model", "smollm2-135m-instruct", "other-model"), ("adapter", "adapters/a", "adapters/b"),
    ("tree", "tree_6.json", "tree_12.json"), ("temperature", 0.0, 0.7), ("max_new_tokens", 12, 256),
    ("environment", {"device": "cpu"}, {"device": "NVIDIA H200"}), ("model", "smollm2-135m-instruct", None)])
def test_report_refuses_to_average_answers_of_different_settings(field, a, b, tmp_path, capsys):
    first = _write(tmp_path / "ppd-first.jsonl", _answer(method="ppd", **{field: a}), _answer())
    second = _write(tmp_path / "ppd-second.jsonl", _answer(method="ppd", turn=1, **{field: b}))
    assert report.main([first, second]) == 2
    error = capsys.readouterr().err
    shown = {"environment": "device"}.get(field, field)
    value = lambda v: repr("unknown" if v is None else v["device"] if field == "environment" else v)  # noqa: E731
    assert f"ppd on mt_bench in float32 mixes answers made with different {shown}: " in error
    assert f"{value(a)} in {first}; {value(b)} in {second}." in error


@pytest.mark.parametrize("field, value", [("model", "other-model"), ("temperature", 0.7), ("max_new_tokens", 256),
                                          ("environment", {"device": "NVIDIA H200"})])
def test_report_compares_methods_only_with_the_same_model_temperature_length_and_device(field, value, tmp_path,
                                                                                       capsys):
    ppd = _write(tmp_path / "ppd.jsonl", _answer(method="ppd", adapter="shipped:a", tree="shipped:a:tree_cpu.json"))
    baseline = _write(tmp_path / "baseline.jsonl", _answer(**{field: value}))
    assert report.main([ppd, baseline]) == 2
    assert "mt_bench in float32 mixes answers made with different " in capsys.readouterr().err
    # PPD's own adapter and tree against the baseline's none is what the report is for.
    _write(tmp_path / "baseline.jsonl", _answer())
    assert report.main([ppd, baseline]) == 0
    # Another dtype is another comparison, not a mix.
    _write(tmp_path / "baseline.jsonl", _answer(dtype="bfloat16", **{field: value}))
    assert report.main([ppd, baseline]) == 0


def test_report_refuses_an_input_without_answers(tmp_path, capsys):
    empty, blank = tmp_path / "empty.jsonl", tmp_path / "blank.jsonl"
    empty.write_text("")
    blank.write_text("\n  \n")
    assert report.main([str(empty), str(blank), "--output_dir", str(tmp_path / "out")]) == 2
    assert f"report: error: no answers in {empty}, {blank}: nothing to report" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    pattern = str(tmp_path / "none" / "*.jsonl")  # what the shell passes on when a pattern matches nothing
    assert report.main([pattern]) == 2
    assert f"report: error: {pattern}: no such file (a pattern that matched no file?)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        report.main([])
    assert exit_.value.code == 2


def _gen_answers_args(output, *extra):
    return ["--bench", "mt_bench", "--method", "baseline", "--model", "smollm2-135m-instruct", "--limit", "1",
            "--max_new_tokens", "12", "--output", str(output), *extra]


class _Resumed(Exception):
    """Raised where gen_answers, its checks passed, would start decoding."""


class _FakeAnswerer:
    """What gen_answers learns from loading the model: fp32 on the CPU, no adapter, no tree."""

    def __init__(self, args, loaded=None):
        self.adapter, self.tree, self.dtype, self.environment = "none", "none", "float32", {"device": "cpu"}

    def start(self):
        raise _Resumed


@pytest.mark.parametrize("field, found, asked", [
    ("method", "ppd", "baseline"), ("model", "other-model", "smollm2-135m-instruct"), ("temperature", 0.7, 0.0),
    ("max_new_tokens", 256, 12), ("bench", "gsm8k", "mt_bench")])
def test_gen_answers_refuses_before_loading_to_resume_a_file_of_other_settings(field, found, asked, tmp_path,
                                                                               monkeypatch, capsys):
    from eval import gen_answers

    def load(args):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(gen_answers, "Answerer", load)
    output = tmp_path / "answers.jsonl"
    _write(output, _answer(**{field: found}))
    before = output.read_text()
    assert gen_answers.main(_gen_answers_args(output)) == 2
    assert capsys.readouterr().err == (f"gen_answers: error: {output} holds answers made with {field} {found!r}, but "
                                       f"this run asks for {asked!r}: choose another --output or remove the file\n")
    assert output.read_text() == before


@pytest.mark.parametrize("field, found, extra, asked", [
    ("adapter", "shipped:smollm2-135m-instruct", [], "none"), ("tree", "tree_6.json", [], "none"),
    ("dtype", "bfloat16", ["--dtype", "float32"], "float32"), ("environment", {"device": "NVIDIA H200"}, [], "cpu"),
    ("environment", None, [], "cpu")])
def test_gen_answers_refuses_once_loaded_to_resume_a_file_of_other_settings(field, found, extra, asked, tmp_path,
                                                                            monkeypatch, capsys):
    from eval import gen_answers

    monkeypatch.setattr(gen_answers, "Answerer", _FakeAnswerer)
    output = tmp_path / "answers.jsonl"
    _write(output, _answer(**{field: found}))
    assert gen_answers.main(_gen_answers_args(output, *extra)) == 2
    shown = ("device", "unknown" if found is None else found["device"]) if field == "environment" else (field, found)
    assert (f"{output} holds answers made with {shown[0]} {shown[1]!r}, but this run asks for {asked!r}: "
            "choose another --output or remove the file") in capsys.readouterr().err


def test_gen_answers_resumes_a_file_of_the_same_settings_cut_short(tmp_path, monkeypatch):
    from eval import gen_answers

    monkeypatch.setattr(gen_answers, "Answerer", _FakeAnswerer)
    output = tmp_path / "answers.jsonl"
    first = json.dumps(_answer(capture="eager")) + "\n"  # another capture mode decodes the same
    output.write_text(first + '{"bench": "mt_bench", "question_id": "81", "tu')
    with pytest.raises(_Resumed):
        gen_answers.main(_gen_answers_args(output))
    assert output.read_text() == first  # the line cut short is dropped, the answer kept


@pytest.mark.parametrize("method", ["ppd", "baseline", "hf", "pld"])
def test_two_question_run_per_method(method, tmp_path):
    out = tmp_path / f"{method}.jsonl"
    cmd = [sys.executable, "-m", "eval.gen_answers", "--bench", "mt_bench", "--method", method, "--limit", "2",
           "--max_new_tokens", "12", "--warmup", "1", "--output", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["question_id"], r["turn"]) for r in records] == [("81", 0), ("81", 1), ("82", 0), ("82", 1)]
    for r in records:
        assert {"question_id", "turn", "method", "new_tokens", "steps", "wall_time_s", "token_ids", "text"} <= set(r)
        assert r["method"] == method and 0 < r["new_tokens"] <= 12 and 1 <= r["steps"] <= r["new_tokens"]
    # Started again, the run keeps what is there and adds nothing.
    assert subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600).returncode == 0
    assert len(out.read_text().splitlines()) == 4


def test_expected_tokens_per_step_multiplies_rank_accuracies():
    from ppd.tree import Tree
    from ppd.tree_builder import expected_tokens_per_step

    accuracy = [[0.5, 0.2], [0.4, 0.1]]
    tree = Tree(((0,), (1,), (0, 0), (0, 1)), (1, 1, 1, 1), 1)
    assert expected_tokens_per_step(tree, accuracy) == pytest.approx(1 + 0.5 + 0.2 + 0.5 * 0.4 + 0.5 * 0.1)


def test_accuracy_trees_and_hardware_aware_pick(tmp_path):
    from data_gen import generate

    data = tmp_path / "ft"
    assert generate.main(["--dataset_type", "finetune", "--output_path", str(data), "--max_samples", "60",
                          "--model_max_length", "96"]) == 0
    run = lambda *a: subprocess.run([sys.executable, "-m", *a], cwd=ROOT, capture_output=True, text=True,  # noqa: E731
                                    timeout=600)
    proc = run("eval.accuracy", "--dataset", str(data), "--eval_size", "8", "--output", str(tmp_path / "acc.json"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = json.loads((tmp_path / "acc.json").read_text())["rank_accuracy"]
    assert len(table) == 3 and len(table[0]) == 10 and all(0 <= sum(row) <= 1 for row in table)
    proc = run("eval.build_trees", "--accuracy", str(tmp_path / "acc.json"), "--budgets", "6", "12",
               "--output_dir", str(tmp_path / "trees"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    adapter = tmp_path / "adapter"
    shutil.copytree(packaged_adapter("HuggingFaceTB/SmolLM2-135M-Instruct"), adapter)
    (adapter / "tree_cpu.json").unlink()
    proc = run("eval.pick_tree", "--trees", str(tmp_path / "trees" / "tree_6.json"),
               str(tmp_path / "trees" / "tree_12.json"), "--steps", "4", "--output", str(tmp_path / "pick.json"),
               "--adapter", str(adapter), "--install")
    assert proc.returncode == 0, proc.stderr[-2000:]
    pick = json.loads((tmp_path / "pick.json").read_text())
    assert [r["rows"] for r in pick["rows"]][0] == 1 and len(pick["rows"]) == 3
    best = max(pick["rows"], key=lambda r: r["tokens_per_s"])
    assert pick["picked"] == best["tree"]
    best_tree = max(pick["rows"][1:], key=lambda r: r["tokens_per_s"])["tree"]
    assert pick["best_tree"] == best_tree
    assert (adapter / "tree_cpu_float32.json").read_bytes() == Path(best_tree).read_bytes()


def test_suite_stops_at_its_deadline_and_resumes_to_the_complete_grid(tmp_path):
    from eval import run_suite

    out = tmp_path / "suite"
    own = ["--benches", "gsm8k", "--methods", "baseline", "ppd", "--limit", "gsm8k=2", "--shard_size", "1",
           "--max_new_tokens", "4", "--devices", "cpu", "--output_dir", str(out)]
    tail = ["--", "--warmup", "0"]
    assert run_suite.main(own + ["--deadline_s", "0.5"] + tail) == 3  # stopped before any shard finished
    # A shard killed while writing leaves a last line cut short: the resumed shard drops and redoes it.
    (out / "gsm8k-ppd-0001.jsonl").write_text('{"bench": "gsm8k", "question_id": "1", "tu')
    assert run_suite.main(own + tail) == 0
    records = report.read_records(sorted(str(p) for p in out.glob("*.jsonl")))
    assert sorted((r["method"], r["question_id"]) for r in records) == [
        ("baseline", "0"), ("baseline", "1"), ("ppd", "0"), ("ppd", "1")]
    assert {r["environment"]["device"] for r in records} and all(r["new_tokens"] == 4 for r in records)
    assert run_suite.main(own + tail) == 0  # nothing left to do
    assert len(report.read_records([str(p) for p in out.glob("*.jsonl")])) == 4


def test_gen_answers_refuses_impossible_decoding_settings_before_loading(tmp_path, capsys):
    from eval import gen_answers

    for temperature in ("nan", "inf", "-1"):
        with pytest.raises(SystemExit) as stop:
            gen_answers.main(["--bench", "mt_bench", "--method", "ppd", "--temperature", temperature,
                              "--output", str(tmp_path / "out.jsonl")])
        assert stop.value.code == 2
        assert "temperature must be a finite number" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_cpu_speed_summary_on_hand_made_answers(tmp_path):
    """eval.cpu_speed's arithmetic: tokens/s over the wall time, speed-ups against the same dtype's baseline and
    the reference, and the share of answers identical to each (by question and turn)."""
    from eval import cpu_speed

    args = cpu_speed.make_parser().parse_args(["--output_dir", str(tmp_path), "--dtypes", "float32", "--limit", "2"])

    def answers(variant, tokens, wall, steps, dtype="float32"):
        path = cpu_speed.answers_path(args, variant)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as sink:
            for (question, turn), ids in tokens.items():
                sink.write(json.dumps({"question_id": question, "turn": turn, "token_ids": ids, "new_tokens": len(ids),
                                       "steps": steps, "wall_time_s": wall, "dtype": dtype, "capture": "eager",
                                       "packed_weights": False}) + "\n")

    same = {(1, 0): [1, 2, 3, 4], (1, 1): [5, 6, 7, 8]}
    answers("reference", same, 1.0, 4)
    answers("float32_baseline", same, 0.5, 4)
    answers("float32_ppd", {(1, 0): [1, 2, 3, 4], (1, 1): [5, 6, 7, 9]}, 0.25, 2)
    rows = {r["variant"]: r for r in cpu_speed.summarise(args)}
    assert rows["reference"]["tokens_per_s"] == 4.0 and rows["float32_baseline"]["tokens_per_s"] == 8.0
    ppd = rows["float32_ppd"]
    assert ppd["tokens_per_s"] == 16.0 and ppd["accept_length"] == 2.0
    assert ppd["speedup_vs_dtype_baseline"] == 2.0 and ppd["speedup_vs_reference"] == 4.0
    assert ppd["identical_to_dtype_baseline"] == 0.5 and ppd["identical_to_reference"] == 0.5
    assert rows["reference"]["speedup_vs_dtype_baseline"] is None
    text = cpu_speed.table(list(rows.values()))
    assert "| float32_ppd | eager | False | 2 | 16.0 | 2.00 | 2.00x | 4.00x | 50% | 50% |" in text
    assert "| reference | eager | False | 2 | 4.0 | 1.00 | - | 1.00x | - | 100% |" in text


def test_the_step_sequence_is_one_steps_kernels_in_the_order_they_started():
    """``eval.step_profile --sequence``: the middle profiled step's device kernels, ordered by their start, cut by
    the mean count a step; host events are left out."""
    from types import SimpleNamespace

    from eval.step_profile import one_step_sequence

    device, host = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    step = ["norm", "mm", "attention", "mm"]
    events = [SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=10 * s + i))
              for s in range(5) for i, name in enumerate([f"{n}{s}" for n in step])]
    events += [SimpleNamespace(name="aten::mm", device_type=host, time_range=SimpleNamespace(start=i)) for i in range(7)]
    shuffled = events[::-1]
    assert one_step_sequence(shuffled, 4.0, 5) == ["norm2", "mm2", "attention2", "mm2"]
    assert one_step_sequence(shuffled, 4.0, 1) == ["norm0", "mm0", "attention0", "mm0"]


def test_step_latency_and_step_profile_on_the_real_model(tmp_path):
    """Both time the steps alone (from the prefill's read-back) and write their JSON: the one-row step and
    the adapter's tree, with the profile's operators per step (a CPU's operators stand for kernels)."""
    from eval import step_latency, step_profile

    common = ["--context", "24", "--steps", "6", "--capture", "eager", "--dtype", "float32"]
    assert step_latency.main([*common, "--baseline", "--output", str(tmp_path / "latency.json")]) == 0
    latency = json.loads((tmp_path / "latency.json").read_text())["results"]
    assert [r["rows"] for r in latency][0] == 1 and latency[1]["rows"] > 1
    assert all(r["step_ms"] > 0 for r in latency)
    assert step_profile.main([*common, "--top", "4", "--output", str(tmp_path / "profile.json")]) == 0
    profile = json.loads((tmp_path / "profile.json").read_text())
    base, tree = profile["results"]
    assert base["rows"] == 1 and tree["rows"] > 1 and profile["command"].startswith("python -m eval.step_profile")
    for result in (base, tree):
        assert result["kernels_per_step"] > 0 and result["device_us_per_step"] > 0
        assert len(result["top"]) == 4 and result["top"][0]["us_per_step"] >= result["top"][-1]["us_per_step"]
    # The decoder as loaded beside a tree file's decoder of its own (here the same tree file as loaded).
    own = "ppd/adapters/smollm2-135m-instruct/tree_cpu_float32.json"
    assert step_profile.main([*common, "--top", "2", "--trees", own, "--with_loaded",
                              "--output", str(tmp_path / "both.json")]) == 0
    both = json.loads((tmp_path / "both.json").read_text())["results"]
    assert [r["tree"] for r in both] == ["baseline (1 row)", f"{tree['tree']} (as loaded)", own]
    assert both[1]["rows"] == both[2]["rows"] == tree["rows"]
    # --tree_choice applies to the files named too, and the rows say so
    assert step_latency.main([*common, "--trees", own, "--tree_choice", "confident",
                              "--output", str(tmp_path / "confident.json")]) == 0
    confident = json.loads((tmp_path / "confident.json").read_text())["results"]
    assert [r["tree"] for r in confident] == [f"{own} (confident)"] and confident[0]["rows"] == tree["rows"]
