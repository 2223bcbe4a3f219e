"""Any question file: MT-Bench-format JSONL read and checked, answered turn by turn by eval.gen_answers, and the
report broken down by category (question files' and the built-in benchmarks')."""

import hashlib
import json

import pytest

from eval import gen_answers, report
from eval.benchmarks import QuestionFileError, data_file, load_benchmark, load_question_file

QUESTIONS = [
    {"question_id": "w1", "category": "writing", "turns": ["Write one sentence about the sea.",
                                                          "Now make it rhyme."]},
    {"question_id": 7, "category": "math", "turns": ["What is 2 + 3?"], "reference": ["5"]},
    {"question_id": "w2", "category": "writing", "turns": ["Name a colour."]},
]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_mt_bench_own_file_reads_as_a_question_file():
    source = load_question_file(data_file("mt_bench"))
    assert source.questions == load_benchmark("mt_bench")  # ids, turns, categories and references
    assert source.name == "question.jsonl"
    assert source.sha256 == hashlib.sha256(data_file("mt_bench").read_bytes()).hexdigest()


def test_a_question_file_keeps_ids_categories_and_references(tmp_path):
    source = load_question_file(_jsonl(tmp_path / "mine.jsonl", QUESTIONS))
    assert [(q.question_id, q.category, len(q.turns)) for q in source.questions] == [
        ("w1", "writing", 2), ("7", "math", 1), ("w2", "writing", 1)]
    assert source.questions[1].reference == {"reference": ["5"]}
    assert load_question_file(_jsonl(tmp_path / "bare.jsonl", [{"question_id": 1, "turns": ["Hi"]}])).questions[
        0].category == ""  # a category may be left out


GOOD = json.dumps({"question_id": 1, "category": "c", "turns": ["Hi"]})


@pytest.mark.parametrize("text, problem", [
    ("", ": no questions (the file is empty)"),
    ("\n  \n", ": no questions (the file is only blank lines)"),
    (GOOD + '\n{"question_id": 2, "turns": ["a"]\n', ":2: not JSON (Expecting ',' delimiter, column 34)"),
    ('["Hi"]\n', ":1: a question is a JSON object, not list"),
    ('{"turns": ["Hi"]}\n', ":1: no question_id"),
    ('{"question_id": 1.5, "turns": ["Hi"]}\n', ":1: question_id must be a non-empty string or an integer, not 1.5"),
    ('{"question_id": 1, "category": "c"}\n', ":1: no turns (the list of the user's messages)"),
    ('{"question_id": 1, "turns": []}\n', ":1: turns must be a non-empty list of strings, not []"),
    ('{"question_id": 1, "turns": "Hi"}\n', ":1: turns must be a non-empty list of strings, not 'Hi'"),
    ('{"question_id": 1, "turns": ["Hi", 3]}\n', ":1: turn 2 is int, not a string"),
    ('{"question_id": 1, "turns": ["Hi", null]}\n', ":1: turn 2 is NoneType, not a string"),
    ('{"question_id": 1, "turns": ["Hi", "  "]}\n', ":1: turn 2 is empty"),
    ('{"question_id": 1, "category": 3, "turns": ["Hi"]}\n', ":1: category must be a string, not 3"),
    (GOOD + '\n\n{"question_id": "1", "turns": ["Hello"]}\n', ":3: question_id '1' again (first on line 1)"),
])
def test_gen_answers_names_the_file_and_line_of_a_malformed_question_file(text, problem, tmp_path, monkeypatch,
                                                                          capsys):
    path = tmp_path / "questions.jsonl"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(QuestionFileError) as error:
        load_question_file(path)
    assert str(error.value) == f"{path}{problem}"

    def load(args, loaded=None):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(gen_answers, "Answerer", load)
    output = tmp_path / "answers.jsonl"
    assert gen_answers.main(["--question_file", str(path), "--method", "baseline", "--output", str(output)]) == 2
    assert capsys.readouterr().err == f"gen_answers: error: {path}{problem}\n"
    assert not output.exists()


def test_gen_answers_refuses_a_missing_question_file_and_wants_exactly_one_question_source(tmp_path, capsys):
    missing = tmp_path / "none.jsonl"
    output = str(tmp_path / "answers.jsonl")
    assert gen_answers.main(["--question_file", str(missing), "--method", "ppd", "--output", output]) == 2
    assert capsys.readouterr().err.startswith(f"gen_answers: error: {missing}: cannot be read (")
    for flags, message in (([], "one of the arguments --bench --question_file is required"),
                           (["--bench", "mt_bench", "--question_file", str(missing)],
                            "argument --question_file: not allowed with argument --bench")):
        with pytest.raises(SystemExit) as stop:
            gen_answers.main([*flags, "--method", "ppd", "--output", output])
        assert stop.value.code == 2 and message in capsys.readouterr().err


def test_a_question_file_answered_turn_by_turn_then_reported_per_category(tmp_path, monkeypatch, capsys):
    """Baseline and PPD (greedy, fp32, the real model) on a file with two categories and a two-turn question; the
    records name the file and its content, the second turn follows the model's own first answer, the report breaks
    the speeds down by category, and resuming after the file changed is refused before the model loads."""
    from ppd.chat import chat_input_ids
    from ppd.cli import load_decoder_or_exit

    questions = _jsonl(tmp_path / "questions.jsonl", QUESTIONS[:2])
    sha256 = hashlib.sha256(questions.read_bytes()).hexdigest()

    def argv(method):
        return ["--question_file", str(questions), "--method", method, "--model", "smollm2-135m-instruct",
                "--dtype", "float32", "--device", "cpu", "--max_new_tokens", "4", "--warmup", "0",
                "--output", str(tmp_path / f"{method}.jsonl")]

    loaded = load_decoder_or_exit(gen_answers.make_parser().parse_args(argv("ppd")), with_prompt_tokens=True)
    for method in ("baseline", "ppd"):
        assert gen_answers.main(argv(method), loaded) == 0
    records = {method: [json.loads(line) for line in (tmp_path / f"{method}.jsonl").read_text().splitlines()]
               for method in ("baseline", "ppd")}
    for method, rows in records.items():
        assert [(r["question_id"], r["turn"], r["category"]) for r in rows] == [
            ("w1", 0, "writing"), ("w1", 1, "writing"), ("7", 0, "math")]
        assert {(r["bench"], r["question_file"], r["question_file_sha256"], r["method"]) for r in rows} == {
            ("questions.jsonl", "questions.jsonl", sha256, method)}
        assert all(0 < r["new_tokens"] <= 4 for r in rows)
        # The second turn is asked after the model's own first answer, through the chat template.
        second = gen_answers.turn_messages(QUESTIONS[0]["turns"], [rows[0]["text"]])
        assert rows[1]["prompt_tokens"] == len(chat_input_ids(loaded.tokenizer, second))
    assert [r["token_ids"] for r in records["ppd"]] == [r["token_ids"] for r in records["baseline"]]

    files = [str(tmp_path / "baseline.jsonl"), str(tmp_path / "ppd.jsonl")]
    assert report.main([*files, "--output_dir", str(tmp_path / "report")]) == 0
    result = json.loads((tmp_path / "report" / "report.json").read_text())
    (ppd,) = [r for r in result["rows"] if r["method"] == "ppd"]
    assert (ppd["bench"], ppd["question_file"], ppd["question_file_sha256"], ppd["quality"]) == (
        "questions.jsonl", "questions.jsonl", sha256, None)
    got = {(r["category"], r["method"]): r for r in result["categories"]}
    assert sorted(got) == [("math", "baseline"), ("math", "ppd"), ("writing", "baseline"), ("writing", "ppd")]
    for category, answers in (("writing", 2), ("math", 1)):
        row, base = got[(category, "ppd")], got[(category, "baseline")]
        mine = [r for r in records["ppd"] if r["category"] == category]
        tokens = sum(r["new_tokens"] for r in mine)
        assert row["answers"] == answers and row["identical_to_baseline"] == 1.0
        assert row["tokens_per_s"] == pytest.approx(tokens / sum(r["wall_time_s"] for r in mine))
        assert row["accept_length"] == pytest.approx(tokens / sum(r["steps"] for r in mine))
        assert row["speedup_vs_baseline"] == pytest.approx(row["tokens_per_s"] / base["tokens_per_s"])
    table = (tmp_path / "report" / "report.md").read_text()
    assert "| benchmark | dtype | category | method | answers | tokens/s | accept length |" in table
    assert "| questions.jsonl | float32 | math | ppd | 1 | " in table
    assert "| questions.jsonl | float32 | writing | baseline | 2 | " in table
    capsys.readouterr()

    # Started again: nothing to do. With the file changed: refused, naming the content, before anything loads.
    assert gen_answers.main(argv("ppd")) == 0
    assert "every answer is there already" in capsys.readouterr().err

    def load(args, loaded=None):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(gen_answers, "Answerer", load)
    _jsonl(questions, QUESTIONS)
    assert gen_answers.main(argv("ppd")) == 2
    changed = hashlib.sha256(questions.read_bytes()).hexdigest()
    assert capsys.readouterr().err == (
        f"gen_answers: error: {tmp_path / 'ppd.jsonl'} holds answers made with question_file_sha256 {sha256!r}, but "
        f"this run asks for {changed!r}: choose another --output or remove the file\n")


def _answer(bench, method, qid, tokens, steps, wall, ids, **fields):
    return {"bench": bench, "method": method, "question_id": qid, "turn": 0, "run": 0, "new_tokens": tokens,
            "steps": steps, "wall_time_s": wall, "token_ids": ids, "text": "", "dtype": "float32", **fields}


def test_report_per_category_of_a_built_in_benchmark_and_of_a_question_file(tmp_path):
    """MT-Bench answers of runs that did not record categories get MT-Bench's (81: writing, 111: math); a question
    file's answers carry theirs; a benchmark without categories gets no category rows."""
    source = {"question_file": "mine.jsonl", "question_file_sha256": "ab" * 32}
    rows = [
        _answer("mt_bench", "baseline", "81", 10, 10, 1.0, [1] * 10),
        _answer("mt_bench", "baseline", "111", 10, 10, 2.0, [2] * 10),
        _answer("mt_bench", "ppd", "81", 10, 4, 0.25, [1] * 10),
        _answer("mt_bench", "ppd", "111", 10, 5, 1.0, [3] * 10),
        _answer("mine.jsonl", "ppd", "a", 6, 3, 1.0, [1] * 6, category="x", **source),
        _answer("mine.jsonl", "ppd", "b", 6, 2, 2.0, [1] * 6, category="", **source),
        _answer("gsm8k", "ppd", "0", 5, 5, 1.0, [7], text="#### 18"),
    ]
    path = _jsonl(tmp_path / "answers.jsonl", rows)
    records, sources = report.read_answers([str(path)])
    files = {(r["bench"], r["method"]): (r["question_file"], r["question_file_sha256"], r["quality"])
             for r in report.summarise(records, sources=sources)}
    assert files[("mine.jsonl", "ppd")] == ("mine.jsonl", "ab" * 32, None)
    assert files[("mt_bench", "ppd")] == files[("gsm8k", "ppd")][:2] + (None,) == (None, None, None)
    assert files[("gsm8k", "ppd")][2] == 1.0  # question 0's answer is 18
    got = {(r["bench"], r["category"], r["method"]): r for r in report.summarise_categories(records)}
    assert sorted(got) == [("mine.jsonl", "", "ppd"), ("mine.jsonl", "x", "ppd"), ("mt_bench", "math", "baseline"),
                           ("mt_bench", "math", "ppd"), ("mt_bench", "writing", "baseline"),
                           ("mt_bench", "writing", "ppd")]
    writing, math = got[("mt_bench", "writing", "ppd")], got[("mt_bench", "math", "ppd")]
    assert writing["tokens_per_s"] == pytest.approx(40.0) and writing["accept_length"] == pytest.approx(2.5)
    assert writing["speedup_vs_baseline"] == pytest.approx(4.0) and writing["identical_to_baseline"] == 1.0
    assert math["speedup_vs_baseline"] == pytest.approx(2.0) and math["identical_to_baseline"] == 0.0
    assert got[("mine.jsonl", "x", "ppd")]["speedup_vs_baseline"] is None
    table = report.markdown(list(got.values()), by_category=True)
    assert "| mt_bench | float32 | writing | ppd | 1 | 40.0 | 2.50 | - | 4.00x | - | - | 100.0% |" in table
    assert "| mine.jsonl | float32 | - | ppd | 1 | 3.0 | 3.00 | - | - | - | - | - |" in table


def test_report_refuses_answers_of_two_question_files_of_one_name(tmp_path, capsys):
    first = _jsonl(tmp_path / "a.jsonl", [_answer("question.jsonl", "ppd", "1", 4, 2, 1.0, [1] * 4, category="c",
                                                  question_file="question.jsonl", question_file_sha256="aa")])
    second = _jsonl(tmp_path / "b.jsonl", [_answer("question.jsonl", "baseline", "1", 4, 4, 1.0, [1] * 4,
                                                   category="c", question_file="question.jsonl",
                                                   question_file_sha256="bb")])
    assert report.main([str(first), str(second)]) == 2
    assert ("question.jsonl in float32 mixes answers made with different question_file_sha256: "
            f"'aa' in {first}; 'bb' in {second}.") in capsys.readouterr().err
