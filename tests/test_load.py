"""The load benchmark: its metrics on hand-made timings, its reading of a server-sent-event stream (a mock
transport), and a whole run against the real server on the real default model (CPU)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket

import httpx
import numpy as np
import pytest

from eval import load
from eval.load import (TokenCounter, busy_tokens_per_s, chunk_gaps, compare_with_baseline, finish_record, percentile,
                       split_tokens, summarize, token_latencies)


# ---------------------------------------------------------------------------------------------- metrics
def test_percentile_interpolates_like_numpy():
    rng = random.Random(0)
    for n in (1, 2, 3, 10, 101):
        values = [rng.random() for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)


def test_chunk_gaps_are_the_times_between_arrivals():
    assert chunk_gaps([0.1, 0.3, 0.35]) == pytest.approx([0.2, 0.05])
    assert chunk_gaps([0.1]) == [] and chunk_gaps([]) == []


def test_token_latencies_spread_each_gap_over_its_tokens():
    # First chunk at 0.1 s with 1 token, then 3 tokens 0.3 s later, then 1 token 0.1 s later.
    assert token_latencies([0.1, 0.4, 0.5], [1, 3, 1]) == pytest.approx([0.1, 0.1, 0.1, 0.1])
    # Tokens of the first chunk beyond its first arrived with it: 0 each.
    assert token_latencies([0.2, 0.6], [3, 2]) == pytest.approx([0.0, 0.0, 0.2, 0.2])
    # A chunk that carried no token hands its gap on to the next one that did.
    assert token_latencies([0.1, 0.2, 0.5], [1, 0, 2]) == pytest.approx([0.2, 0.2])
    assert token_latencies([0.1], [1]) == [] and token_latencies([], []) == []


def test_mean_token_latency_is_the_time_per_token_after_the_first():
    rng = random.Random(1)
    times, tokens, now = [], [], 0.0
    for _ in range(20):
        now += rng.uniform(0.001, 0.05)
        times.append(now)
        tokens.append(rng.randint(1, 4))
    latencies = token_latencies(times, tokens)
    assert len(latencies) == sum(tokens) - 1
    assert sum(latencies) / len(latencies) == pytest.approx((times[-1] - times[0]) / (sum(tokens) - 1))


def test_split_tokens_adds_up_to_the_servers_count():
    assert split_tokens([1, 3, 2], 6) == [1, 3, 2]  # the text says it all
    assert split_tokens([1, 3, 2], 7) == [1, 3, 3]  # an end-of-sequence token without text: the last chunk
    assert split_tokens([1, 3, 3], 6) == [1, 3, 2]  # a surplus comes off the largest chunk, the later on a tie
    assert split_tokens([1, 4, 1], 4) == [1, 2, 1]
    assert split_tokens([2, 2], 1) == [1, 0]  # fewer tokens than chunks: down to nothing, from the end
    assert split_tokens([], 0) == []
    rng = random.Random(2)
    for _ in range(200):
        estimates = [rng.randint(0, 5) for _ in range(rng.randint(1, 8))]
        total = rng.randint(0, 30)
        counts = split_tokens(estimates, total)
        assert sum(counts) == total and min(counts) >= 0
        if total >= len(estimates):
            assert min(counts) >= 1 or min(estimates) == 0


def test_characters_spread_the_total_in_proportion_when_there_is_no_tokenizer():
    counter = TokenCounter()
    counts, without_text = counter.split(["ab", "abcdef", "ab"], 5)
    assert counts == [1, 3, 1] and sum(counts) == 5 and without_text == 0
    assert counter.split(["a", "b", "c"], 2)[0] == [1, 1, 0]
    assert counter.split(["x" * 7, "y" * 3], 10)[0] == [7, 3]


def record(method, clients, prompt, times, tokens, e2e, steps=None, text="x", error=None):
    return {"method": method, "clients": clients, "prompt_index": prompt, "warmup": False, "error": error,
            "chunk_times_s": times, "chunk_tokens": tokens, "ttft_s": times[0] if times else None, "e2e_s": e2e,
            "completion_tokens": sum(tokens), "steps": steps, "text_sha1": text}


def test_summary_of_hand_made_requests():
    records = [record("ppd", 2, 0, [0.1, 0.2, 0.3], [1, 2, 1], 0.31, steps=3),
               record("ppd", 2, 1, [0.2, 0.6], [1, 3], 0.62, steps=1),
               record("ppd", 2, 2, [], [], 0.0, error="HTTP 500: boom")]
    s = summarize(records, wall_s=1.0)
    assert (s["requests"], s["completed"], s["errors"]) == (3, 2, 1)
    assert s["completion_tokens"] == 8 and s["output_tokens_per_s"] == 8.0 and s["requests_per_s"] == 2.0
    assert s["ttft_p50_s"] == pytest.approx(0.15)
    itl = [0.05, 0.05, 0.1, 0.4 / 3, 0.4 / 3, 0.4 / 3]
    assert s["itl_mean_s"] == pytest.approx(sum(itl) / 6)
    assert s["itl_p50_s"] == pytest.approx(percentile(itl, 50))
    assert s["itl_p99_s"] == pytest.approx(max(itl), rel=1e-2)
    assert s["chunk_gap_p50_s"] == pytest.approx(0.1) and s["chunk_gap_p99_s"] == pytest.approx(0.394)  # gaps 0.1, 0.1, 0.4
    assert s["tpot_mean_s"] == pytest.approx(((0.31 - 0.1) / 3 + (0.62 - 0.2) / 3) / 2)
    assert s["accept_length"] == pytest.approx(8 / 4) and s["tokens_per_chunk"] == pytest.approx(8 / 5)
    empty = summarize([records[2]], wall_s=1.0)
    assert empty["completed"] == 0 and empty["ttft_p50_s"] is None and empty["output_tokens_per_s"] == 0.0


def test_busy_throughput_counts_only_what_arrived_before_the_last_request_was_sent():
    # Two clients, three requests: the third is sent at 0.5 s, when the first ends; the level then drains.
    first = {**record("ppd", 2, 0, [0.1, 0.3, 0.5], [2, 2, 2], 0.5), "sent_s": 0.0}
    second = {**record("ppd", 2, 1, [0.2, 0.9], [1, 3], 0.9), "sent_s": 0.0}  # its 3 tokens arrive at 0.9 s
    third = {**record("ppd", 2, 2, [0.1, 0.4], [4, 4], 0.4), "sent_s": 0.5}  # all of it after 0.5 s
    ok = [first, second, third]
    assert busy_tokens_per_s(ok, [0.0, 0.0, 0.5]) == pytest.approx((2 + 2 + 1) / 0.5)  # the chunk at 0.5 s is out
    s = summarize(ok, wall_s=0.9)
    assert s["busy_tokens_per_s"] == pytest.approx(10.0) and s["output_tokens_per_s"] == pytest.approx(18 / 0.9)
    assert busy_tokens_per_s(ok[:2], [0.0, 0.0]) is None  # every request sent at once: no busy window
    assert summarize([record("ppd", 1, 0, [0.1], [1], 0.1)], wall_s=0.1)["busy_tokens_per_s"] is None  # no send times


def test_ratios_to_the_baseline_of_the_same_level():
    records = [record("baseline", 1, 0, [0.1, 0.2], [1, 1], 0.2, text="a"),
               record("baseline", 1, 1, [0.1, 0.2], [1, 1], 0.2, text="b"),
               record("ppd", 1, 0, [0.1, 0.2], [1, 1], 0.2, text="a"),
               record("ppd", 1, 1, [0.1, 0.2], [1, 1], 0.2, text="c")]
    rows = [{"clients": 1, "method": "baseline", "output_tokens_per_s": 100.0, "busy_tokens_per_s": 80.0,
             "itl_p99_s": 0.02},
            {"clients": 1, "method": "ppd", "output_tokens_per_s": 250.0, "busy_tokens_per_s": 160.0,
             "itl_p99_s": 0.01},
            {"clients": 4, "method": "ppd", "output_tokens_per_s": 250.0, "itl_p99_s": 0.01}]
    compare_with_baseline(rows, records)
    assert rows[1]["throughput_vs_baseline"] == 2.5 and rows[1]["p99_itl_vs_baseline"] == 0.5
    assert rows[1]["busy_throughput_vs_baseline"] == 2.0
    assert rows[1]["same_text_as_baseline"] == 0.5
    assert "throughput_vs_baseline" not in rows[0] and "throughput_vs_baseline" not in rows[2]  # no baseline at 4


# ---------------------------------------------------------------------------------------------- the stream
def sse(*events) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


def chunk(content=None, finish=None, **extra):
    delta = {} if content is None else {"content": content}
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            **extra}


def fetch(body: bytes, status: int = 200):
    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))

    async def go():
        async with httpx.AsyncClient(transport=transport) as client:
            return await load.stream_request(client, "http://test", {"stream": True}, {})

    return asyncio.run(go())


def test_a_stream_becomes_chunks_with_exact_token_totals():
    body = sse({"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]},
               chunk("Hello"), chunk(" there, friend"), chunk("!", "stop", ppd={"method": "ppd", "accept_length": 2.0,
                                                                                "steps": 2}),
               {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 6, "total_tokens": 15}}, b"[DONE]")
    raw = fetch(body)
    assert raw["error"] is None and raw["texts"] == ["Hello", " there, friend", "!"]
    result = finish_record(raw, TokenCounter())
    assert result["completion_tokens"] == 6 and sum(result["chunk_tokens"]) == 6
    assert result["finish_reason"] == "stop" and result["accept_length"] == 2.0 and result["steps"] == 2
    assert result["ttft_s"] == result["chunk_times_s"][0] > 0 and result["e2e_s"] >= result["chunk_times_s"][-1]
    assert "texts" not in result and result["characters"] == len("Hello there, friend!")


def test_per_chunk_usage_is_taken_as_is():
    body = sse(chunk("a", usage={"completion_tokens": 1}), chunk("bcd", usage={"completion_tokens": 4}),
               chunk("e", "length", usage={"completion_tokens": 5}), b"[DONE]")
    result = finish_record(fetch(body), TokenCounter())
    assert result["chunk_tokens"] == [1, 3, 1] and result["completion_tokens"] == 5


@pytest.mark.parametrize("body, status, message", [
    (b'{"error": {"message": "max_tokens: too big"}}', 400, "HTTP 400"),
    (sse(chunk("a"), {"choices": [], "usage": {"completion_tokens": 1}}), 200, "without data: [DONE]"),
    (sse(chunk("a"), b"[DONE]"), 200, "no usage"),
    (sse(chunk("a"), {"error": {"message": "engine closed"}}), 200, "error event"),
    (b"data: {not json\n\n", 200, "JSONDecodeError"),
])
def test_a_failed_request_is_recorded_with_its_error(body, status, message):
    result = finish_record(fetch(body, status), TokenCounter())
    assert message in result["error"]


def test_clients_share_the_requests_and_a_slow_one_times_out_alone():
    good = sse(chunk("Hi", "stop"), {"choices": [], "usage": {"completion_tokens": 1}}, b"[DONE]")

    async def handler(request):
        prompt = json.loads(request.content)["messages"][0]["content"]

        async def body():
            if prompt == "slow":
                await asyncio.sleep(30)
            yield good

        return httpx.Response(200, content=body())

    args = argparse.Namespace(api_key=None, max_tokens=4, timeout=0.5)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await load.run_phase(client, "http://test", "m", ["slow", "fast"], "ppd", 2, [0, 1, 2, 3], args,
                                        TokenCounter(), warmup=False)

    records, wall = asyncio.run(go())
    assert [r["prompt_index"] for r in records] == [0, 1, 0, 1]  # prompts cycle in a fixed order
    assert ["--timeout" in (r["error"] or "") for r in records] == [True, False, True, False]
    assert {r["client"] for r in records} == {0, 1} and 0.5 <= wall < 5


# ---------------------------------------------------------------------------------------------- a whole run
# Two rows of 512 tokens: the server's defaults (64 rows of the 8192-token context, per method) would hold
# tens of GB of KV cache on a CPU.
SERVER_ARGS = "--device cpu --dtype float32 --max_batch 2 --max_seq_len 512"


def test_api_keys_are_redacted():
    args = ["--api_key", "k", "--x", "--api_key=k2", "--y"]
    assert load.redacted(args) == ["--api_key", "REDACTED", "--x", "--api_key=REDACTED", "--y"]


def test_an_unreachable_url_exits_2(capsys):
    with socket.socket() as sock:  # bound, never listening: connections to it are refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        assert load.main(["--url", f"http://127.0.0.1:{port}", "--clients", "1"]) == 2
    assert "does not answer 200" in capsys.readouterr().err


def test_a_server_that_never_becomes_healthy_exits_2_with_its_log(tmp_path, capsys):
    code = load.main(["--launch", "--server_args", "--no_such_flag 1", "--clients", "1",
                      "--output", str(tmp_path / "load.json")])
    assert code == 2
    err = capsys.readouterr().err
    assert "exited with status" in err and "no_such_flag" in err  # the tail of the server's log
    assert (tmp_path / "load.server.log").exists() and not (tmp_path / "load.json").exists()


def test_a_load_run_against_the_real_server(tmp_path, capsys):
    output, picture = tmp_path / "load.json", tmp_path / "load.png"
    code = load.main(["--launch", "--model", "smollm2-135m-instruct", "--server_args", SERVER_ARGS,
                      "--clients", "1", "2", "--requests", "2", "--warmup", "0", "--max_tokens", "16",
                      "--methods", "ppd", "baseline", "--bench", "mt_bench", "--api_key", "sesame",
                      "--output", str(output), "--plot", str(picture)])
    assert code == 0
    result = json.loads(output.read_text())
    assert picture.stat().st_size > 0 and (tmp_path / "load.server.log").exists()
    assert result["token_counting"].startswith("tokenizer:") and result["environment"]["torch"]
    assert result["server_args"] == SERVER_ARGS.split()
    assert result["server_slow_collections"]["count"] >= 0 and result["client_slow_collections"]["count"] >= 0
    # The key went to the server, which then refused nothing (errors are checked below), and is never recorded.
    assert "--api_key REDACTED" in result["server_command"] and "sesame" not in output.read_text()
    rows = {(r["clients"], r["method"]): r for r in result["summary"]}
    assert set(rows) == {(c, m) for c in (1, 2) for m in ("ppd", "baseline")}
    for (clients, method), row in rows.items():
        counted = [r for r in result["records"] if r["clients"] == clients and r["method"] == method
                   and not r["warmup"]]
        assert row["requests"] == row["completed"] == len(counted) == 2 and row["errors"] == 0
        assert row["completion_tokens"] == sum(r["usage"]["completion_tokens"] for r in counted)
        for r in counted:
            assert r["error"] is None and r["server_method"] == method
            assert sum(r["chunk_tokens"]) == r["completion_tokens"] == r["usage"]["completion_tokens"] > 0
            assert 0 < r["ttft_s"] <= r["chunk_times_s"][-1] <= r["e2e_s"]
            assert r["chunk_times_s"] == sorted(r["chunk_times_s"])
            assert abs(r["tokens_without_text"]) <= 1  # at most an end-of-sequence token has no text
        assert row["output_tokens_per_s"] > 0 and row["requests_per_s"] > 0
        for name in ("ttft", "itl", "chunk_gap", "e2e"):
            assert 0 <= row[f"{name}_p50_s"] <= row[f"{name}_p99_s"], name
        assert row["ttft_p50_s"] > 0 and row["tpot_mean_s"] > 0 and row["accept_length"] >= 1
    for clients in (1, 2):
        ppd = rows[clients, "ppd"]
        assert ppd["throughput_vs_baseline"] > 0 and ppd["p99_itl_vs_baseline"] > 0
        assert ppd["same_text_as_baseline"] == 1.0  # greedy, float32: PPD answers what the baseline answers
        # Both methods were asked the same prompts.
        asked = {m: sorted(r["prompt_index"] for r in result["records"]
                           if r["clients"] == clients and r["method"] == m and not r["warmup"])
                 for m in ("ppd", "baseline")}
        assert asked["ppd"] == asked["baseline"] == [0, 1]
    out = capsys.readouterr().out
    assert "| clients | method |" in out and out.count("| ppd |") == 2
