"""The OpenAI-compatible server on the real model, through a real uvicorn server on a loopback port: concurrent
greedy answers equal to each answer alone, streams that rebuild the whole answer, stop strings, a client
that disconnects freeing its row, OpenAI error bodies for bad requests, the API key, the queue limit (429)
and ``python -m application.serve`` itself."""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn

from application import openai_api, serve
from ppd import DecodeConfig, Decoder, eos_ids_of
from ppd.chat import chat_input_ids, plain_input_ids, text_decoder
from ppd.adapter import AdapterFiles
from ppd.serving import BatcherConfig, ContinuousBatcher

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 512  # the test decoder's cache: small, so that the batch state is cheap and the window easy to pass
MAX_TOKENS = 24
PROMPTS = [  # MT-Bench-like first turns
    "Compose an engaging travel blog post about a recent trip to Hawaii.",
    "Explain the difference between a list and a tuple in Python.",
    "What are the main causes of inflation? Answer briefly.",
    "Write a persuasive email to convince your introverted friend to speak at a local event.",
]
LONG_REQUEST = "Write the numbers from 1 to 1000, separated by commas."  # an answer longer than any test reads


class RecordingBatcher(ContinuousBatcher):
    """The batcher, keeping the stream of every request it accepts (to check how each one ended)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.streams = []

    def submit(self, prompt_ids, config=None):
        stream = super().submit(prompt_ids, config)
        self.streams.append(stream)
        return stream


@contextmanager
def serving(app):
    """``app`` on a real uvicorn server on a free loopback port, in a thread; yields its URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


def wait_until(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def sse_data(lines):
    """The ``data:`` payloads of a server-sent event stream, as they come: JSON objects, and ``"[DONE]"``."""
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            yield payload if payload == "[DONE]" else json.loads(payload)


def chat_body(prompt: str, **fields) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "temperature": 0, **fields}


def assert_error(response: httpx.Response, status: int, param=None, code=None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param and error["code"] == code, error
    return error


@pytest.fixture(scope="module")
def decoder(real_model):
    model, tokenizer, info = real_model
    prompt_tokens = AdapterFiles.default_for(model, tokenizer, info).prompt_tokens
    return Decoder(model, prompt_tokens, eos_token_ids=eos_ids_of(model, tokenizer), max_seq_len=WINDOW)


@pytest.fixture(scope="module")
def alone(real_model, decoder):
    """Each prompt's greedy answer as the decoder gives it outside the server: (text, tokens, finish reason in
    OpenAI's words). Decoded autoregressively, the four in one batch: greedy PPD gives the same tokens as
    autoregressive decoding, and a batch the same as each prompt alone (test_real_model checks both), and
    this is the cheapest way to get them on a CPU. The server's answers are PPD's, batched as it likes."""
    tokenizer = real_model[1]
    prompts = [chat_input_ids(tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    outs = decoder.generate(prompts, DecodeConfig(method="baseline", max_new_tokens=MAX_TOKENS))
    return {p: (tokenizer.decode(out.token_ids, skip_special_tokens=True), len(out.token_ids),
                serve.FINISH_REASONS[out.finish_reason]) for p, out in zip(PROMPTS, outs)}


@pytest.fixture(scope="module")
def batcher(decoder):
    with RecordingBatcher(decoder, BatcherConfig(max_batch=4, max_queue=16)) as batcher:
        yield batcher


@pytest.fixture(scope="module")
def model_id(real_model):
    return real_model[2].model_id


@pytest.fixture(scope="module")
def url(real_model, batcher, model_id):
    with serving(serve.create_app(batcher, real_model[1], model_id)) as url:
        yield url


@pytest.fixture()
def client(url):
    with httpx.Client(base_url=url, timeout=120) as client:
        yield client


def test_flags_bind_locally_by_default_and_read_the_key_from_the_environment(monkeypatch, capsys):
    monkeypatch.delenv(serve.API_KEY_ENV, raising=False)
    args = serve.make_parser().parse_args([])
    assert (args.host, args.port, args.api_key, args.max_batch, args.max_queue, args.method) == \
           ("127.0.0.1", 8000, None, None, 256, "ppd")
    assert args.served_model_name is None and args.model == "smollm2-135m-instruct"
    monkeypatch.setenv(serve.API_KEY_ENV, "from-env")
    assert serve.make_parser().parse_args([]).api_key == "from-env"
    for flags, named in ((["--port", "70000"], "--port"), (["--max_batch", "0"], "--max_batch"),
                         (["--max_queue", "-1"], "--max_queue"),
                         (["--switch_interval_ms", "0"], "--switch_interval_ms")):
        with pytest.raises(SystemExit):  # refused before any model loads
            serve.main(flags)
        assert named in capsys.readouterr().err


def test_text_deltas_hold_back_split_characters_and_stop_strings(real_model):
    tokenizer = real_model[1]
    text = "Café ☕ and 東京 🗼 — done. THE END, then more"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    deltas = serve.TextDeltas(tokenizer)
    pieces = [deltas.push([token]) for token in ids[:-1]] + [deltas.push(ids[-1:], final=True)]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert sum(1 for i in range(1, len(ids)) if "\ufffd" in tokenizer.decode(ids[:i])) > 0  # characters were split
    stopping = serve.TextDeltas(tokenizer, stop=["THE END", "never"])
    sent = ""
    for token in ids:
        sent += stopping.push([token])
        assert "THE" not in sent  # nothing of the stop string leaves before it is known not to be one
        if stopping.stopped:
            break
    assert stopping.stopped and sent == text[:text.index("THE END")]
    assert stopping.push(ids) == ""


def test_the_text_decoder_gives_what_the_tokenizer_decodes(real_model, monkeypatch):
    """The default model's tokenizer decodes through its Rust tokenizer directly (the server does it twice a
    streamed chunk), and gives what ``tokenizer.decode`` gives, special tokens dropped, on real chat text cut
    anywhere; a tokenizer that cleans spaces up keeps ``decode``."""
    tokenizer = real_model[1]
    ids = chat_input_ids(tokenizer, [{"role": "user", "content": "Café ☕ and 東京 🗼: what is 2 + 2?"},
                                     {"role": "assistant", "content": "It is 4 — « done », isn't it?  Yes."}])
    decode = text_decoder(tokenizer)
    with monkeypatch.context() as patched:
        patched.setattr(tokenizer, "decode", lambda *a, **k: pytest.fail("decoded through the wrapper"))
        fast = [decode(ids[i:j]) for i in range(0, len(ids), 3) for j in range(i, len(ids) + 1, 5)]
    assert fast == [tokenizer.decode(ids[i:j], skip_special_tokens=True)
                    for i in range(0, len(ids), 3) for j in range(i, len(ids) + 1, 5)]
    assert "<|im_start|>" in tokenizer.decode(ids) and "<|im_start|>" not in decode(ids)
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    calls = []
    monkeypatch.setattr(tokenizer, "decode", lambda ids, **k: calls.append(k) or "")
    text_decoder(tokenizer)(ids)
    assert calls == [{"skip_special_tokens": True}]


def test_the_server_stack_is_the_c_one_where_installed(monkeypatch):
    """``auto`` picks httptools and uvloop where they are installed (they are, with the app extra), the pure
    Python ones where not; asking for one that is missing is refused before the model loads."""
    assert serve.server_stack("auto", "auto") == ("httptools", "uvloop")
    assert serve.server_stack("h11", "asyncio") == ("h11", "asyncio")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("httptools", "uvloop")
                        else real(name, *a))
    assert serve.server_stack("auto", "auto") == ("h11", "asyncio")
    assert serve.server_stack("h11", "auto") == ("h11", "asyncio")
    for stack, flags in ((("httptools", "auto"), ["--http", "httptools"]), (("auto", "uvloop"), ["--loop", "uvloop"])):
        with pytest.raises(ValueError, match=f"needs the {flags[1]} package"):
            serve.server_stack(*stack)
        with pytest.raises(SystemExit):
            serve.main(["--device", "cpu", *flags])


def test_text_events_are_the_chunk_objects_encoded_whole():
    pieces = ["", "a", " word", "é\n", '"quoted" \\ back', "\x00\x1f\t", "\u2028", "😀", "</script>"]
    for kind in ("chat", "text"):
        for with_usage, running in ((False, False), (True, False), (True, True)):
            event = openai_api.text_events(kind, "chatcmpl-1", 1733000000, 'a "model"', with_usage, running)
            for tokens, piece in enumerate(pieces):
                usage = openai_api.usage(12, tokens) if running else None
                whole = openai_api.chunk_object(kind, "chatcmpl-1", 1733000000, 'a "model"', text=piece,
                                                with_usage=with_usage, running_usage=usage)
                assert event(piece, usage) == openai_api.sse(whole)
                assert json.loads(event(piece, usage).removeprefix("data: ")) == whole
    odd = openai_api.text_events("chat", "chatcmpl-1", 1, "a\x00model", True, True)  # built whole, still right
    assert odd("x", openai_api.usage(1, 2)) == openai_api.sse(openai_api.chunk_object(
        "chat", "chatcmpl-1", 1, "a\x00model", text="x", with_usage=True, running_usage=openai_api.usage(1, 2)))


def test_health_and_models(client, model_id):
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [model_id]


def test_concurrent_greedy_chats_get_the_answers_they_get_alone(url, batcher, alone, model_id):
    before = len(batcher.streams)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        replies = list(pool.map(lambda p: httpx.post(f"{url}/v1/chat/completions", timeout=120,
                                                     json=chat_body(p, max_tokens=MAX_TOKENS)), PROMPTS))
    for prompt, reply in zip(PROMPTS, replies):
        assert reply.status_code == 200, reply.text
        body = reply.json()
        text, tokens, finish = alone[prompt]
        assert body["object"] == "chat.completion" and body["model"] == model_id
        assert body["choices"][0]["message"] == {"role": "assistant", "content": text}
        assert body["choices"][0]["finish_reason"] == finish
        usage = body["usage"]
        assert usage["completion_tokens"] == tokens and usage["total_tokens"] == usage["prompt_tokens"] + tokens
        assert body["ppd"]["method"] == "ppd" and body["ppd"]["steps"] >= 1
        assert body["ppd"]["accept_length"] == pytest.approx(tokens / body["ppd"]["steps"])
    # They really ran together: all four were decoding at one moment.
    streams = batcher.streams[before:]
    assert len(streams) == len(PROMPTS)
    starts = [s.created + s.completion.queued_s for s in streams]
    ends = [s.created + s.completion.wall_time_s for s in streams]
    assert max(starts) < min(ends)


def test_streamed_deltas_rebuild_the_answer(client, real_model, alone, model_id):
    tokenizer = real_model[1]
    prompt = PROMPTS[1]
    text, tokens, finish = alone[prompt]
    body = chat_body(prompt, max_tokens=MAX_TOKENS, stream=True, stream_options={"include_usage": True})
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = list(sse_data(response.iter_lines()))
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == model_id for c in chunks)
    assert len({c["id"] for c in chunks + [usage]}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text
    assert len(chunks) > 3  # it came piece by piece
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == finish and last["ppd"]["method"] == "ppd"
    assert all(c["choices"][0]["finish_reason"] is None and "ppd" not in c for c in chunks[:-1])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == tokens

    # The text completion endpoint: the stream rebuilds what the same request answers in one piece.
    request = {"prompt": "The three primary colours are", "max_tokens": 8, "temperature": 0, "method": "baseline"}
    whole = client.post("/v1/completions", json=request).json()
    assert whole["object"] == "text_completion" and whole["ppd"]["method"] == "baseline"
    assert whole["usage"]["prompt_tokens"] == len(plain_input_ids(tokenizer, request["prompt"]))
    assert whole["ppd"]["steps"] == whole["usage"]["completion_tokens"] - 1  # one token a step after the prefill
    with client.stream("POST", "/v1/completions", json={**request, "stream": True}) as response:
        events = list(sse_data(response.iter_lines()))
    assert events[-1] == "[DONE]" and all(e["object"] == "text_completion" for e in events[:-1])
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == whole["choices"][0]["text"]
    assert events[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert events[-2]["ppd"] == whole["ppd"] and "usage" not in events[-2]
    # With the running usage in every chunk (vLLM's continuous_usage_stats), each carries the tokens so far.
    options = {"include_usage": True, "continuous_usage_stats": True}
    with client.stream("POST", "/v1/completions", json={**request, "stream": True, "stream_options": options}) as r:
        events = list(sse_data(r.iter_lines()))
    *pieces, last = events[:-2]
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == whole["choices"][0]["text"]
    counts = [e["usage"]["completion_tokens"] for e in pieces]
    assert counts == sorted(counts) and 0 < counts[-1] <= last["usage"]["completion_tokens"]
    assert events[-2]["usage"] == whole["usage"]


def test_stop_strings_cut_the_answer_and_end_the_request(client, batcher, alone):
    prompt = PROMPTS[0]
    text = alone[prompt][0]
    stop = text.split()[3]  # a word in the middle of the answer
    cut = text[:text.index(stop)]
    reply = client.post("/v1/chat/completions", json=chat_body(prompt, max_tokens=MAX_TOKENS, stop=["zzz", stop]))
    assert reply.json()["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": cut},
                                          "logprobs": None, "finish_reason": "stop"}
    assert reply.json()["usage"]["completion_tokens"] < alone[prompt][1]
    body = chat_body(prompt, max_tokens=MAX_TOKENS, stop=stop, stream=True)
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        chunks = list(sse_data(response.iter_lines()))[:-1]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == cut
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert batcher.streams[-1].completion.finish_reason == "cancelled"  # the engine stopped decoding it
    # Sampling with a seed draws the same answer twice.
    sampled = [client.post("/v1/chat/completions", json=chat_body(prompt, max_tokens=4, temperature=0.9, seed=7))
               .json()["choices"][0]["message"]["content"] for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_a_client_that_disconnects_frees_its_row_and_the_others_stay_exact(client, url, batcher, alone):
    others = PROMPTS[2:]
    before = len(batcher.streams)
    with ThreadPoolExecutor(len(others)) as pool:
        replies = [pool.submit(httpx.post, f"{url}/v1/chat/completions", timeout=120,
                               json=chat_body(p, max_tokens=MAX_TOKENS)) for p in others]
        with client.stream("POST", "/v1/chat/completions",
                           json=chat_body(LONG_REQUEST, max_tokens=300, stream=True)) as response:
            seen = 0
            for line in response.iter_lines():
                seen += line.startswith("data: ")
                if seen == 3:  # the role chunk and two pieces of text: then go away
                    break
        for prompt, reply in zip(others, replies):
            assert reply.result().json()["choices"][0]["message"]["content"] == alone[prompt][0]
    assert wait_until(lambda: batcher.running == 0 and batcher.waiting == 0)
    streams = batcher.streams[before:]
    assert len(streams) == 3 and all(s.done for s in streams)
    gone = [s.completion for s in streams if s.completion.finish_reason == "cancelled"]
    assert len(gone) == 1 and gone[0].new_tokens < 300  # the long answer, dropped where its client left
    # A client waiting for a whole answer that gives up is noticed too.
    with pytest.raises(httpx.ReadTimeout):
        client.post("/v1/chat/completions", json=chat_body(LONG_REQUEST, max_tokens=300), timeout=3)
    assert wait_until(lambda: batcher.running == 0 and batcher.waiting == 0)
    assert batcher.streams[-1].completion.finish_reason == "cancelled"
    assert batcher.streams[-1].completion.new_tokens < 300


def test_bad_requests_get_openai_error_bodies(client, model_id):
    post = client.post
    assert_error(post("/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"}),
                 400)
    assert_error(post("/v1/chat/completions", json=chat_body("Hi", max_token=5)), 400, param="max_token")
    assert_error(post("/v1/chat/completions", json=chat_body("Hi", temperature="0")), 400, param="temperature")
    assert_error(post("/v1/chat/completions", json=chat_body("Hi", temperature=2.5)), 400, param="temperature")
    assert_error(post("/v1/chat/completions", json=chat_body("Hi", stream=1)), 400, param="stream")
    assert_error(post("/v1/chat/completions", json=chat_body("Hi", method="fast")), 400, param="method")
    assert_error(post("/v1/chat/completions", json={"messages": []}), 400, param="messages")
    assert_error(post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}), 400, param="messages[0].content[0].type")
    assert_error(post("/v1/chat/completions", json=chat_body("  ")), 400, param="messages[0].content")
    assert_error(post("/v1/completions", json={"prompt": ""}), 400, param="prompt")
    assert_error(post("/v1/completions", json={"prompt": ["a", "b"]}), 400, param="prompt")
    assert_error(post("/v1/chat/completions", json=chat_body("Hi", max_tokens=0)), 400, param="max_tokens")
    assert_error(post("/v1/chat/completions", json=chat_body("Hi", max_tokens=WINDOW)), 400, param="max_tokens",
                 code="context_length_exceeded")
    assert_error(post("/v1/chat/completions", json=chat_body("Hi", max_completion_tokens=WINDOW)), 400,
                 param="max_completion_tokens", code="context_length_exceeded")
    assert_error(post("/v1/completions", json={"prompt": "word " * WINDOW}), 400, param="prompt",
                 code="context_length_exceeded")
    assert_error(post("/v1/chat/completions", json=chat_body("Hi", n=2)), 400, param="n")
    assert_error(post("/v1/chat/completions", json=chat_body("Hi", stop=["a", "b", "c", "d", "e"])), 400,
                 param="stop")
    assert_error(post("/v1/chat/completions", json=chat_body("Hi", model="gpt-4o")), 404, param="model",
                 code="model_not_found")
    assert_error(client.get("/v1/nothing"), 404)
    # Fields OpenAI's clients send that mean nothing here are accepted: the served model's name, user, n=1.
    ok = post("/v1/chat/completions", json=chat_body("Hi", max_tokens=2, model=model_id, user="u1", n=1))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2


def test_an_api_key_is_required_when_set(real_model, batcher, model_id):
    app = serve.create_app(batcher, real_model[1], model_id, api_key="sekret", default_method="baseline")
    with serving(app) as url, httpx.Client(base_url=url, timeout=120) as client:
        assert client.get("/health").status_code == 200  # readiness needs no key
        assert_error(client.get("/v1/models"), 401, code="invalid_api_key")
        assert_error(client.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401, code="invalid_api_key")
        # Refused before the body is read: a broken body without the key is a 401, not a 400.
        assert_error(client.post("/v1/chat/completions", content=b"{"), 401, code="invalid_api_key")
        key = {"Authorization": "Bearer sekret"}
        assert client.get("/v1/models", headers=key).status_code == 200
        reply = client.post("/v1/completions", headers=key, json={"prompt": "Hello", "max_tokens": 2,
                                                                  "temperature": 0})
        assert reply.status_code == 200 and reply.json()["ppd"]["method"] == "baseline"  # the server's default


def test_a_full_queue_answers_429(real_model, decoder, model_id):
    with RecordingBatcher(decoder, BatcherConfig(max_batch=1, max_queue=1)) as small:
        app = serve.create_app(small, real_model[1], model_id)
        with serving(app) as url, httpx.Client(base_url=url, timeout=120) as first, \
                httpx.Client(base_url=url, timeout=120) as second:
            body = chat_body(LONG_REQUEST, max_tokens=400, stream=True)
            with first.stream("POST", "/v1/chat/completions", json=body) as running:
                for event in sse_data(running.iter_lines()):
                    if event["choices"][0]["delta"].get("content"):  # its text is coming: it has the one row
                        break
                with second.stream("POST", "/v1/chat/completions", json=body) as waiting:
                    assert waiting.status_code == 200
                    assert wait_until(lambda: small.running == 1 and small.waiting == 1, 10)
                    refused = httpx.post(f"{url}/v1/chat/completions", json=chat_body("Hi", max_tokens=2))
                    assert_error(refused, 429, code="rate_limit_exceeded")
                    assert refused.headers["retry-after"] == "1"
            assert wait_until(lambda: small.running == 0 and small.waiting == 0)
        assert [s.completion.finish_reason for s in small.streams] == ["cancelled", "cancelled"]


def test_the_program_serves_until_interrupted(model_id):
    env = {k: v for k, v in os.environ.items() if k != serve.API_KEY_ENV}
    command = [sys.executable, "-m", "application.serve", "--device", "cpu", "--port", "0", "--max_batch", "2",
               "--max_seq_len", "256", "--served_model_name", "smol", "--api_key", "k", "--switch_interval_ms", "0.5",
               "--prefill_in_line", "--http", "h11", "--loop", "asyncio"]  # the tests in this process run the C ones
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    try:
        url, deadline, output = None, time.monotonic() + 180, []
        while url is None:
            try:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                pytest.fail("no ready line:\n" + "".join(output))
            output.append(line)
            if line.startswith("ppd serving smol on http://127.0.0.1:"):
                url = line.split(" on ")[1].strip()
        assert "thread switch interval 0.5 ms\n" in output and "HTTP: h11, event loop: asyncio\n" in output
        assert "joining requests prefill on the running rows' stream (--prefill_in_line)\n" in output
        key = {"Authorization": "Bearer k"}
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
        assert [m["id"] for m in httpx.get(f"{url}/v1/models", headers=key).json()["data"]] == ["smol"]
        reply = httpx.post(f"{url}/v1/chat/completions", headers=key, timeout=120,
                           json=chat_body("Hi", model="smol", max_tokens=4)).json()
        assert reply["model"] == "smol" and reply["usage"]["completion_tokens"] <= 4
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
    assert process.returncode == 0
