"""Benchmarks cut off before their end keep what they measured, and the same command finishes them
(eval.records.PartialRun): eval.batch_speed on the real model, and the record's own rules."""

import json
import os

import pytest

from eval import batch_speed
from eval.records import PartialRun, SettingsMismatch
from ppd.decoder import Decoder

CPU = ["--device", "cpu", "--dtype", "float32", "--capture", "eager", "--max_seq_len", "512"]


class CutOff(Exception):
    """Stands for the process being killed (a device call's time limit) right after a group was written."""


def cut_off_after(monkeypatch, groups: int) -> None:
    """Make runs die right after writing their ``groups``-th group (``PartialRun.add`` as it is, then a kill)."""
    add, added = PartialRun.add, []

    def add_then_die(self, rows, record=None):
        add(self, rows, record)
        added.append(rows)
        if len(added) == groups:
            raise CutOff

    monkeypatch.setattr(PartialRun, "add", add_then_die)


def test_a_cut_off_batch_speed_run_is_finished_by_the_same_command(tmp_path, monkeypatch, capsys):
    output = tmp_path / "speed.json"
    # Batch 1 decodes three prompts one after another, batch 2 four (three, rounded up to whole batches).
    argv = ["--batch_sizes", "1", "2", "--prompts", "3", "--max_new_tokens", "6", "--bench", "gsm8k", *CPU,
            "--output", str(output)]
    cut_off_after(monkeypatch, 1)
    with pytest.raises(CutOff):
        batch_speed.main(argv)
    cut = json.loads(output.read_text())
    assert cut["complete"] is False and {r["batch_size"] for r in cut["rows"]} == {1}
    assert {r["variant"] for r in cut["rows"]} == {"baseline", "ppd"}

    # Finishing it with other settings is refused, naming the difference, and leaves the file as it was.
    other = [("7" if a == "6" else a) for a in argv]
    assert batch_speed.main(other) == 2
    error = capsys.readouterr().err
    assert "cut off with max_new_tokens 6, but this run asks for 7" in error and "--output" in error
    assert json.loads(output.read_text()) == cut

    monkeypatch.undo()
    warmed = []
    warmup = Decoder.warmup

    def counted_warmup(self, batch_sizes=(1,), **kwargs):
        warmed.extend(batch_sizes)
        return warmup(self, batch_sizes=batch_sizes, **kwargs)

    monkeypatch.setattr(Decoder, "warmup", counted_warmup)
    assert batch_speed.main(argv) == 0
    assert warmed == [2, 2]  # batch 2, baseline and ppd; batch 1 was measured before the cut
    assert "batch    1 | measured already" in capsys.readouterr().err
    done = json.loads(output.read_text())
    assert done["complete"] is True and done["command"].startswith("python -m eval.batch_speed")
    assert [(r["batch_size"], r["variant"]) for r in done["rows"]] == [(1, "baseline"), (1, "ppd"),
                                                                      (2, "baseline"), (2, "ppd")]
    assert done["rows"][:2] == cut["rows"]  # kept as measured
    for row in done["rows"]:
        assert row["prompts"] == {1: 3, 2: 4}[row["batch_size"]]
        assert row["identical_to_baseline"] == 1.0 and row["new_tokens"] == 6 * row["prompts"]
        assert 0 < row["prefill_s"] < row["wall_time_s"] and row["ms_per_pass"] > 0
        batches = row["prompts"] // row["batch_size"]
        assert row["max_steps"] <= row["passes"] and row["mean_row_steps"] * batches <= row["passes"]
        assert row["speedup"] == pytest.approx(row["tokens_per_s"] / next(
            r["tokens_per_s"] for r in done["rows"] if r["batch_size"] == row["batch_size"]
            and r["variant"] == "baseline"))

    # Finished, the same command measures again from the start (the usual overwrite). Every variant warms up
    # before any is timed, and the timed batches take turns: each batch of prompts by every variant.
    warmed.clear()
    timed = []
    generate = Decoder.generate

    def recorded_generate(self, input_ids, config=None, **overrides):
        if config is not None and config.max_new_tokens == 6:
            timed.append((config.method.value, len(input_ids)))
        return generate(self, input_ids, config, **overrides)

    monkeypatch.setattr(Decoder, "generate", recorded_generate)
    assert batch_speed.main(argv) == 0
    assert warmed == [1, 1, 2, 2]
    assert timed == [("baseline", 1), ("ppd", 1)] * 3 + [("baseline", 2), ("ppd", 2)] * 2


def test_partial_run_rules(tmp_path):
    path = tmp_path / "run.json"
    settings = {"dtype": "bfloat16", "sizes": (1, 2)}
    first = PartialRun(path, settings)
    first.add([{"batch_size": 1, "x": 1.0}], {"model": "m"})
    assert json.loads(path.read_text()) == {"model": "m", "settings": {"dtype": "bfloat16", "sizes": [1, 2]},
                                            "rows": [{"batch_size": 1, "x": 1.0}], "complete": False}
    again = PartialRun(path, settings)  # tuples and lists compare as the file holds them
    assert again.measured(batch_size=1) == [{"batch_size": 1, "x": 1.0}] and again.measured(batch_size=2) == []
    with pytest.raises(SettingsMismatch, match="dtype 'bfloat16', but this run asks for 'float32'"):
        PartialRun(path, {**settings, "dtype": "float32"})
    with pytest.raises(SettingsMismatch, match="'unknown'"):  # a setting the cut-off run did not record
        PartialRun(path, {**settings, "new": 1})
    again.finish({"rows": again.rows})
    assert PartialRun(path, {"anything": 0}).rows == []  # a complete run is not resumed
    path.write_text("{not json")
    with pytest.raises(SettingsMismatch, match="is not a JSON record"):
        PartialRun(path, settings)
    assert PartialRun(None, settings).measured() == []  # no output file: nothing kept, nothing written


def test_records_name_the_ppd_switches_a_run_measured_under(tmp_path, monkeypatch):
    import torch

    from eval.records import environment, run_settings

    for key in [k for k in os.environ if k.startswith("PPD_")]:
        monkeypatch.delenv(key)
    cpu = torch.device("cpu")
    assert "ppd_switches" not in environment(cpu)  # nothing set: the record of earlier versions
    assert environment(cpu)["tree_attention"] == "gqa"  # the split kernel is the default on a CUDA GPU only
    args = batch_speed.make_parser().parse_args(["--batch_sizes", "1"])
    before = run_settings(args, cpu, ("batch_sizes",))
    path = tmp_path / "run.json"
    PartialRun(path, before).add([{"batch_size": 1}])
    monkeypatch.setenv("PPD_PREFILL_GRAPHS", "0")
    assert environment(cpu)["ppd_switches"] == {"PPD_PREFILL_GRAPHS": "0"}
    with pytest.raises(SettingsMismatch, match="ppd_switches"):  # a cut-off run is not finished the other way
        PartialRun(path, run_settings(args, cpu, ("batch_sizes",)))
    monkeypatch.delenv("PPD_PREFILL_GRAPHS")
    monkeypatch.setenv("PPD_GROUPED_SDPA", "split")
    assert environment(cpu)["tree_attention"] == "split"
    with pytest.raises(SettingsMismatch, match="tree_attention"):
        PartialRun(path, run_settings(args, cpu, ("batch_sizes",)))


def test_a_cut_off_batch_policy_pick_is_finished_and_installs_the_best_tree_per_bucket(tmp_path, monkeypatch):
    import shutil

    from eval import pick_tree
    from ppd.policy import BatchPolicy
    from ppd.prompt_tokens import packaged_adapter

    adapter = tmp_path / "adapter"
    shutil.copytree(packaged_adapter("HuggingFaceTB/SmolLM2-135M-Instruct"), adapter)
    trees = [str(adapter / "tree_cpu_bfloat16.json"), "results/train/v4/runs/deep-e2/trees/tree_8.json"]
    output = tmp_path / "pick.json"
    argv = ["--trees", *trees, "--batch_sizes", "1", "2", "--steps", "2", "--context", "40", *CPU,
            "--adapter", str(adapter), "--output", str(output), "--install"]
    cut_off_after(monkeypatch, 3)
    with pytest.raises(CutOff):
        pick_tree.main(argv)
    assert not (adapter / "policy_cpu_float32.json").exists()  # nothing installed from a cut-off run
    cut = json.loads(output.read_text())
    assert cut["complete"] is False and [(r["tree"], r["batch_size"]) for r in cut["rows"]] == [
        ("baseline (1 row)", 1), ("baseline (1 row)", 2), (trees[0], 1)]

    monkeypatch.undo()
    assert pick_tree.main(argv) == 0
    done = json.loads(output.read_text())
    assert done["complete"] is True and done["rows"][:3] == cut["rows"]
    assert [(r["tree"], r["batch_size"]) for r in done["rows"]] == [
        (name, batch) for name in ["baseline (1 row)", *trees] for batch in (1, 2)]
    policy = BatchPolicy.load(adapter / "policy_cpu_float32.json")
    for pick, bucket, chosen in zip(done["picks"], policy.buckets, policy.trees):
        here = [r for r in done["rows"] if r["batch_size"] == bucket]
        best = max(here, key=lambda r: r["tokens_per_s"])
        assert pick["batch_size"] == bucket and pick["tokens_per_s"] == best["tokens_per_s"]
        assert (chosen is None) == (best["tree"] == "baseline (1 row)") == (pick["tree"] is None)


def test_a_cut_off_long_context_run_is_finished_by_the_same_command(tmp_path, monkeypatch):
    from eval import long_context

    output = tmp_path / "long.json"
    argv = ["--contexts", "256", "--batch_sizes", "1", "2", "--max_new_tokens", "4", "--methods", "ppd", "baseline",
            "--device", "cpu", "--dtype", "float32", "--capture", "eager", "--output", str(output)]
    cut_off_after(monkeypatch, 1)
    with pytest.raises(CutOff):
        long_context.main(argv)
    cut = json.loads(output.read_text())
    assert cut["complete"] is False and [(r["batch_size"], r["method"]) for r in cut["rows"]] == [(1, "ppd"),
                                                                                              (1, "baseline")]
    assert all("token_ids" not in r for r in cut["rows"])

    monkeypatch.undo()
    measured = []
    measure = long_context.measure

    def counted(loaded, method, batches, args, **kwargs):
        measured.append((len(batches[0]), method))
        return measure(loaded, method, batches, args, **kwargs)

    monkeypatch.setattr(long_context, "measure", counted)
    assert long_context.main(argv) == 0
    assert measured == [(2, "ppd"), (2, "baseline")]
    done = json.loads(output.read_text())
    assert done["complete"] is True and done["rows"][:2] == cut["rows"]
    assert [(r["batch_size"], r["method"]) for r in done["rows"]] == [(1, "ppd"), (1, "baseline"), (2, "ppd"),
                                                                      (2, "baseline")]
    assert all(r["identical_to_reference"] == 1.0 for r in done["rows"] if r["method"] == "ppd")


def test_a_pick_rates_trees_by_replayed_accept_lengths_with_their_choice(tmp_path, capsys):
    """``--accept_lengths`` takes each tree's expected tokens from an ``eval.replay`` record, matched by the trees
    and their choice (``--tree_choice`` applies to the ``--trees`` files); a tree the record lacks, or a record of
    other prompt tokens, is refused with a line naming it."""
    from eval import pick_tree

    tree = "results/train/v7/runs/maps16-lr3e-3-e3/trees/tree_8.json"
    record = {"adapter": "shipped:smollm2-135m-instruct", "trees": [
        {"tree": tree, "choice": "fixed", "accept_length": 1.25},
        {"tree": tree, "choice": "confident", "accept_length": 9.0}]}
    replay = tmp_path / "replay.json"
    replay.write_text(json.dumps(record))
    argv = ["--trees", tree, "--batch_sizes", "1", "--steps", "2", "--context", "40", *CPU,
            "--accept_lengths", str(replay)]
    assert pick_tree.main(argv + ["--output", str(tmp_path / "fixed.json")]) == 0
    fixed = json.loads((tmp_path / "fixed.json").read_text())
    assert [(r["tree"], r["expected_tokens"]) for r in fixed["rows"]] == [("baseline (1 row)", 1.0), (tree, 1.25)]
    assert fixed["expected_from"] == str(replay)
    assert pick_tree.main(argv + ["--tree_choice", "confident", "--output", str(tmp_path / "confident.json")]) == 0
    confident = json.loads((tmp_path / "confident.json").read_text())
    assert confident["rows"][1]["tree"] == f"{tree} (confident)" and confident["rows"][1]["expected_tokens"] == 9.0
    assert confident["policy"]["buckets"][0]["trees"]["choice"] == "confident"  # nine tokens a step: picked
    capsys.readouterr()
    replay.write_text(json.dumps({**record, "trees": record["trees"][:1]}))
    assert pick_tree.main(argv + ["--tree_choice", "confident"]) == 2
    assert f"holds no accept length for {tree} (confident)" in capsys.readouterr().err
    replay.write_text(json.dumps({**record, "adapter": "some/other-tokens"}))
    assert pick_tree.main(argv) == 2
    assert "measured the prompt tokens of 'some/other-tokens'" in capsys.readouterr().err


def test_a_pick_rates_trees_with_a_lookup_chain_only_by_replayed_accept_lengths(tmp_path, capsys):
    """``--lookup`` applies to the ``--trees`` files; a chained set is rated by the replay record's row of its chain
    (``eval.replay --lookup``), and refused without a record: no accuracy table rates a chain."""
    from eval import pick_tree

    tree = "results/train/v7/runs/maps16-lr3e-3-e3/trees/tree_8.json"
    record = {"adapter": "shipped:smollm2-135m-instruct", "trees": [
        {"tree": tree, "choice": "fixed", "lookup": 0, "accept_length": 1.25},
        {"tree": tree, "choice": "fixed", "lookup": 8, "accept_length": 9.0}]}
    replay = tmp_path / "replay.json"
    replay.write_text(json.dumps(record))
    argv = ["--trees", tree, "--batch_sizes", "1", "--steps", "2", "--context", "40", *CPU, "--lookup", "8"]
    assert pick_tree.main(argv + ["--accept_lengths", str(replay), "--output", str(tmp_path / "pick.json")]) == 0
    picked = json.loads((tmp_path / "pick.json").read_text())
    assert picked["rows"][1]["tree"] == f"{tree} (lookup 8)" and picked["rows"][1]["expected_tokens"] == 9.0
    assert picked["policy"]["buckets"][0]["trees"]["lookup"] == 8
    capsys.readouterr()
    assert pick_tree.main(argv) == 2
    assert "verify a lookup chain, which no accuracy table rates" in capsys.readouterr().err


def test_continuous_batch_speed_keeps_the_batcher_full_and_decodes_what_static_batches_do(tmp_path, monkeypatch,
                                                                                          capsys):
    """``--batching continuous``: each variant's batcher of B rows is handed 4B prompts; every answer equals the
    baseline's (greedy), the steps ran B rows but for the drain, and the record says how it was measured."""
    output = tmp_path / "continuous.json"
    argv = ["--batch_sizes", "2", "--prompts", "3", "--max_new_tokens", "6", "--bench", "gsm8k", *CPU,
            "--output", str(output)]
    assert batch_speed.main([*argv, "--batching", "continuous", "--plot", str(tmp_path / "speed.png")]) == 0
    assert (tmp_path / "speed.png").stat().st_size > 0
    done = json.loads(output.read_text())
    assert done["batching"] == "continuous" and done["settings"]["batching"] == "continuous"
    assert [r["variant"] for r in done["rows"]] == ["baseline", "ppd"]
    for row in done["rows"]:
        assert row["prompts"] == 8 and row["new_tokens"] == 6 * 8 and row["identical_to_baseline"] == 1.0
        assert 1.5 < row["mean_rows"] <= 2 and row["ms_per_pass"] > 0 and row["batching"] == "continuous"
    ppd = done["rows"][1]
    assert ppd["accept_length"] > 1 and ppd["tree_rows"] > 1
    # A static run cut off is not finished as a continuous one.
    cut_off_after(monkeypatch, 1)
    with pytest.raises(CutOff):
        batch_speed.main([*argv[:1], "1", *argv[1:]])
    monkeypatch.undo()
    capsys.readouterr()
    assert batch_speed.main([*argv[:1], "1", *argv[1:], "--batching", "continuous"]) == 2
    assert "cut off with batching 'static', but this run asks for 'continuous'" in capsys.readouterr().err


def test_continuous_batch_speed_compares_batcher_settings_in_rounds(tmp_path, capsys):
    """``--batchers``: every variant runs under each named setting (``<variant>@NAME``), its speed-up over the
    baseline under the same settings; ``--rounds`` sums each variant's rounds, every answer still the baseline's."""
    output = tmp_path / "settings.json"
    argv = ["--batch_sizes", "1", "--prompts", "1", "--max_new_tokens", "4", "--bench", "gsm8k", *CPU,
            "--batching", "continuous", "--rounds", "2", "--output", str(output),
            "--batchers", "default", "levers=admissions:before_step,backlog:waited,freeze_heap:false,staging_rows:2"]
    assert batch_speed.main(argv) == 0
    done = json.loads(output.read_text())
    rows = {r["variant"]: r for r in done["rows"]}
    assert list(rows) == ["baseline@default", "ppd@default", "baseline@levers", "ppd@levers"]
    assert rows["ppd@levers"]["batcher"] == {"admissions": "before_step", "backlog": "waited", "freeze_heap": False,
                                             "staging_rows": 2}
    assert rows["ppd@default"]["batcher"] == {}
    for name, row in rows.items():
        baseline = rows[name.replace("ppd@", "baseline@")]
        assert row["speedup"] == pytest.approx(row["tokens_per_s"] / baseline["tokens_per_s"])
        assert row["rounds"] == 2 and len(row["round_tokens_per_s"]) == 2 and row["prompts"] == 4
        assert row["new_tokens"] == 2 * 4 * 4 and row["identical_to_baseline"] == 1.0
    table = capsys.readouterr().out
    assert "ppd@levers speed-up" in table and "baseline@levers speed-up" not in table

    for bad, message in ((["--batchers", "x=admissions:soon"], "admissions must be one of after_step, before_step"),
                         (["--batchers", "x=max_batch:4"], "is not FIELD:VALUE with FIELD one of prefill_beside"),
                         (["--batchers", "x=freeze_heap:maybe"], "freeze_heap takes true or false"),
                         (["--batchers", "x=staging_rows:two"], "staging_rows takes a whole number"),
                         (["--batchers", "x=staging_rows:0"], "staging_rows must be >= 1"),
                         (["--batchers", "x"], "expected NAME=FIELD:VALUE"),
                         (["--rounds", "0"], "--rounds must be at least 1")):
        with pytest.raises(SystemExit):
            batch_speed.main([*argv[:argv.index("--rounds")], *bad])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        batch_speed.main(["--batch_sizes", "1", *CPU, "--batchers", "default"])
    assert "apply to --batching continuous" in capsys.readouterr().err
