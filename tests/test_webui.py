"""The chat app: its engine on the real model, the /generate API through gradio_client, concurrent requests
sharing forward passes, bad requests refused before they wait for the model, a client that goes away
stopping its answer, and a real browser (Playwright driving Debian's Chromium) using the page as a person
would."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import closing
from dataclasses import replace
from pathlib import Path

import pytest

from application import webui
from application.chat_engine import MAX_TEMPERATURE, ChatEngine, EmptyMessageError, SettingError
from ppd.chat import chat_input_ids
from ppd.cli import load_decoder
from ppd.decoder import Decoder, PromptTooLongError

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("PPD_CHROMIUM", "/usr/bin/chromium")
QUESTION = "Why is the sky blue?"
LONG_REQUEST = "Write the numbers from 1 to 1000, separated by commas."  # an answer of thousands of tokens
# Under CI (.ci/run installs Chromium) a missing browser is a failure, not a skip.
needs_chromium = pytest.mark.skipif(not Path(CHROMIUM).exists() and not os.environ.get("CI"),
                                    reason="needs Debian's chromium at /usr/bin/chromium (.ci/run installs it)")


class RecordingEngine(ChatEngine):
    """Notes when each reply starts and ends, so tests can see whether two replies overlapped, and the last
    snapshot of each (``finished`` is False where the reader closed the stream early)."""

    def __init__(self, loaded):
        super().__init__(loaded)
        self.spans: list[tuple[float, float]] = []
        self.replies: list = []

    def stream(self, *args, **kwargs):
        start, update = time.perf_counter(), None
        try:
            with closing(super().stream(*args, **kwargs)) as updates:  # closing this closes the engine's stream
                for update in updates:
                    yield update
        finally:
            self.spans.append((start, time.perf_counter()))
            self.replies.append(update)


@pytest.fixture(scope="module")
def engine():
    args = webui.make_parser().parse_args(["--device", "cpu"])
    recording = RecordingEngine(load_decoder(args))
    yield recording
    recording.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def app_url(engine):
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    demo = webui.build_demo(engine, max_new_tokens=24)
    port = _free_port()
    demo.queue(default_concurrency_limit=1).launch(server_name="127.0.0.1", server_port=port,
                                                   prevent_thread_lock=True, quiet=True)
    yield f"http://127.0.0.1:{port}/"
    demo.close()


def test_importing_the_app_loads_nothing_heavy():
    code = "import sys, application.webui; print('gradio' in sys.modules, 'transformers.models' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_flags_bind_locally_by_default_and_accept_the_reference_adapter_flag():
    args = webui.make_parser().parse_args([])
    assert args.host == "127.0.0.1" and not args.share and args.adapter is None
    assert webui.make_parser().parse_args(["--ppd-path", "some/dir"]).adapter == "some/dir"
    with pytest.raises(SystemExit):
        webui.make_parser().parse_args(["--load_in_4bit", "--load_in_8bit"])


def test_impossible_requests_stop_before_serving(capsys):
    with pytest.raises(SystemExit):
        webui.main(["--device", "cpu", "--load_in_4bit"])
    assert "need a CUDA device" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        webui.main(["--port", "70000"])
    assert "--port" in capsys.readouterr().err


def test_engine_streams_the_greedy_answer_with_and_without_ppd(engine):
    history = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
               {"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
    assert engine.prompt_ids(history) == chat_input_ids(engine.tokenizer, [
        {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": QUESTION}])
    updates = []
    for update in engine.stream(history, use_ppd=True, max_new_tokens=40):
        updates.append((update.text, update.new_tokens, update.finished))
    final = update
    assert len(updates) >= 3 and not updates[0][2] and updates[-1][2]
    assert [n for _, n, _ in updates] == sorted(n for _, n, _ in updates)  # the text only grows
    assert final.method == "ppd" and final.new_tokens == 40 and final.finish_reason == "length"
    assert "".join(text for text, _ in final.pieces) == final.text
    assert any(guess for _, guess in final.pieces) and final.accept_length > 1.0
    baseline = engine.reply(history, use_ppd=False, max_new_tokens=40)
    assert baseline.method == "baseline" and baseline.token_ids == final.token_ids and baseline.text == final.text
    assert not any(guess for _, guess in baseline.pieces) and baseline.steps == 39  # the prefill gives the first
    cache = engine.batcher.cache_bytes
    engine.reply(history, use_ppd=True, max_new_tokens=4)
    assert engine.batcher.cache_bytes == cache > 0  # every message reuses the caches (and their graphs)


def test_engine_rejects_empty_and_too_long_messages(engine):
    with pytest.raises(EmptyMessageError):
        next(engine.stream([{"role": "user", "content": "   "}]))
    too_long = "word " * (engine.context_window + 10)
    with pytest.raises(PromptTooLongError, match="context window"):
        next(engine.stream([{"role": "user", "content": too_long}]))


def test_generate_endpoint_through_gradio_client(engine, app_url):
    from gradio_client import Client

    client = Client(app_url, verbose=False)
    text, stats = client.predict(QUESTION, True, 0.0, 24, api_name="/generate")
    expected = engine.reply([{"role": "user", "content": QUESTION}], use_ppd=False, max_new_tokens=24)
    assert text == expected.text and text.strip()
    assert stats["method"] == "ppd" and stats["new_tokens"] == 24 and stats["steps"] >= 1
    assert stats["accept_length"] == pytest.approx(24 / stats["steps"], abs=1e-3) and stats["tokens_per_s"] > 0
    text_off, stats_off = client.predict(message=QUESTION, use_ppd=False, temperature=0.0, max_new_tokens=24,
                                         api_name="/generate")
    assert text_off == text and stats_off["method"] == "baseline"
    with pytest.raises(Exception, match="empty"):
        client.predict("  ", True, 0.0, 24, api_name="/generate")


def test_two_concurrent_requests_share_forward_passes_and_answer_as_alone(engine, app_url):
    from gradio_client import Client

    questions = ["Write a haiku about rain.", "What is 12 times 12?"]
    solo = [engine.reply([{"role": "user", "content": q}], use_ppd=True, max_new_tokens=24).text for q in questions]
    engine.spans.clear()
    clients = [Client(app_url, verbose=False) for _ in questions]
    barrier = threading.Barrier(len(questions))
    results: list = [None] * len(questions)

    def ask(i: int) -> None:
        barrier.wait()
        results[i] = clients[i].predict(questions[i], True, 0.0, 24, api_name="/generate")

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
    before = engine.steps_run
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert [r[0] for r in results] == solo
    (a_start, a_end), (b_start, b_end) = sorted(engine.spans)
    assert b_start < a_end  # both answers were decoding at once
    passes = sum(1 + r[1]["steps"] for r in results)  # each answer's prefill and steps
    assert engine.steps_run - before < passes  # some forward passes served both


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting {timeout} s for {what}"
        time.sleep(0.05)


def _assert_idle(engine, quiet_s: float = 3.0) -> None:
    """No forward pass runs for ``quiet_s``: nothing is decoding."""
    before = engine.steps_run
    time.sleep(quiet_s)
    assert engine.steps_run == before, "the engine kept decoding"


def _post_json(url: str, body: dict):
    """POST ``body`` as Python's json module writes it (nan and inf as NaN and Infinity, which httpx refuses)."""
    import httpx

    return httpx.post(url, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=60)


def _ask_short(engine, client) -> float:
    """Ask a 24-token question through /generate; returns how long it waited for the model."""
    sent = time.perf_counter()
    _, stats = client.predict(QUESTION, True, 0.0, 24, api_name="/generate")
    assert stats["new_tokens"] == 24
    return min(start for start, _ in engine.spans if start >= sent) - sent


def test_engine_checks_settings_and_prompt_before_the_model_runs(engine):
    window = engine.context_window
    user = [{"role": "user", "content": QUESTION}]
    before = engine.steps_run
    bad_settings = [
        (dict(temperature=math.nan), "temperature",
         f"temperature must be a number from 0 to {MAX_TEMPERATURE}, not nan"),
        (dict(temperature=math.inf), "temperature", "not inf"),
        (dict(temperature=-0.1), "temperature", "not -0.1"),
        (dict(temperature=MAX_TEMPERATURE + 0.5), "temperature", "not 2.0"),
        (dict(temperature="0.5"), "temperature", "not '0.5'"),
        (dict(max_new_tokens=0), "max_new_tokens",
         f"max_new_tokens must be a whole number from 1 to {window} (the context window), not 0"),
        (dict(max_new_tokens=100_000), "max_new_tokens", "not 100000"),
        (dict(max_new_tokens=12.5), "max_new_tokens", "not 12.5"),
        (dict(max_new_tokens=math.nan), "max_new_tokens", "not nan"),
        (dict(max_new_tokens=True), "max_new_tokens", "not True"),
        (dict(use_ppd="no"), "use_ppd", "use_ppd must be true or false, not 'no'"),
    ]
    for settings, name, text in bad_settings:
        with pytest.raises(SettingError, match=text.replace("(", r"\(").replace(")", r"\)")) as error:
            engine.prepare(user, **settings)
        assert error.value.name == name
        with pytest.raises(SettingError):  # the stream refuses them too, before any forward pass
            next(engine.stream(user, **settings))
    with pytest.raises(EmptyMessageError, match="the message is empty"):
        engine.prepare([{"role": "user", "content": " \n "}])
    too_long = "word " * (window + 10)
    n_prompt = len(engine.prompt_ids([{"role": "user", "content": too_long}]))
    with pytest.raises(PromptTooLongError, match=f"the prompt has {n_prompt} tokens but the model's context window "
                                                 f"is {window}: no room for a single new token"):
        engine.prepare([{"role": "user", "content": too_long}])
    assert engine.steps_run == before  # none of it reached the model
    request = engine.prepare(user, use_ppd=False, temperature=0.7, max_new_tokens=24.0)  # a slider's float
    assert request.ids == engine.prompt_ids(user)
    assert (request.config.method.value, request.config.temperature, request.config.max_new_tokens) == (
        "baseline", 0.7, 24)


def test_max_new_tokens_beyond_what_the_window_leaves_ends_the_answer_at_the_window(engine):
    user = [{"role": "user", "content": QUESTION}]
    window = len(engine.prompt_ids(user)) + 6  # a decoder whose cache holds the prompt and 6 more tokens
    small = Decoder(engine.decoder.model, engine.decoder.prompt_tokens, engine.decoder.trees,
                    engine.decoder.eos_token_ids, max_seq_len=window)
    chat = ChatEngine(replace(engine.loaded, decoder=small))
    with closing(chat):
        assert chat.context_window == window
        reply = chat.reply(user, max_new_tokens=window)  # the whole window asked for: what is left is decoded
        assert reply.finish_reason == "max_length" and reply.new_tokens == 6
        with pytest.raises(SettingError, match=f"from 1 to {window} "):
            chat.prepare(user, max_new_tokens=window + 1)
        with pytest.raises(PromptTooLongError, match=f"tokens but the decoder's max_seq_len is {window}"):
            chat.prepare([{"role": "user", "content": QUESTION + " word" * 10}], max_new_tokens=1)


def test_bad_api_requests_are_refused_at_once_while_the_model_is_busy(engine, app_url):
    """A long answer holds the model; bad requests behind it get their error at once, not after it; then
    cancelling the long one through gradio_client stops its decoding and frees the model."""
    from gradio_client import Client
    from gradio_client.exceptions import ValidationError

    window = engine.context_window
    replies, before = len(engine.replies), engine.steps_run
    long_job = Client(app_url, verbose=False).submit(LONG_REQUEST, True, 0.0, window, api_name="/generate")
    _wait_for(lambda: engine.steps_run > before + 3, 60, "the long answer to decode")
    client = Client(app_url, verbose=False)
    too_long = "word " * (window + 10)
    n_prompt = len(engine.prompt_ids([{"role": "user", "content": too_long}]))
    bad = [
        (("", True, 0.0, 24), "message", "the message is empty"),
        (("  \n ", True, 0.0, 24), "message", "the message is empty"),
        ((QUESTION, True, -1.0, 24), "temperature", "temperature must be a number from 0 to 1.5, not -1.0"),
        ((QUESTION, True, 0.0, 100_000), "max_new_tokens",
         f"max_new_tokens must be a whole number from 1 to {window} (the context window), not 100000"),
        ((QUESTION, True, 0.0, 0), "max_new_tokens",
         f"max_new_tokens must be a whole number from 1 to {window} (the context window), not 0"),
        ((too_long, True, 0.0, 24), "message", f"the prompt has {n_prompt} tokens but the model's context window "
                                               f"is {window}: no room for a single new token"),
    ]
    for args, name, text in bad:
        start = time.perf_counter()
        with pytest.raises(ValidationError) as error:
            client.predict(*args, api_name="/generate")
        assert str(error.value) == f"1 parameter(s) failed validation:\n- {name}: {text}"
        assert time.perf_counter() - start < 10  # not queued behind the long answer
    # gradio_client refuses to send nan or inf (not JSON); Python's json module and JavaScript clients do not.
    for value in (math.nan, math.inf, "hot"):
        start = time.perf_counter()
        refused = _post_json(f"{app_url}gradio_api/call/generate", {"data": [QUESTION, True, value, 24]})
        assert refused.status_code == 422 and time.perf_counter() - start < 10
        assert refused.json()["detail"][2] == {
            "__type__": "validate", "is_valid": False, "parameter_name": "temperature",
            "message": f"temperature must be a number from 0 to 1.5, not {value!r}"}
    assert not long_job.done() and len(engine.replies) == replies  # it ran all along

    long_job.cancel()
    _wait_for(lambda: len(engine.replies) > replies, 30, "the cancelled answer to stop")
    stopped = engine.replies[-1]
    assert not stopped.finished and stopped.new_tokens < window
    _assert_idle(engine)
    assert _ask_short(engine, client) < 10  # the model is free at once
    assert engine.batcher.running == 0  # the cancelled answer gave its row back


def test_a_client_that_disconnects_stops_its_answer(engine, app_url):
    """Through gradio's REST API with raw HTTP: start a long answer, read a few of its steps, hang up. The
    answer stops decoding and a short request sent right after is answered at once."""
    import httpx
    from gradio_client import Client

    window = engine.context_window
    replies, before = len(engine.replies), engine.steps_run
    api = f"{app_url}gradio_api/call/generate"
    with httpx.Client(timeout=60) as http:
        event_id = http.post(api, json={"data": [LONG_REQUEST, True, 0.0, window]}).json()["event_id"]
        steps = 0
        with http.stream("GET", f"{api}/{event_id}") as events:
            for line in events.iter_lines():
                steps += line.startswith("event: generating")
                if steps == 3:
                    break  # leaving the block closes the connection: the client is gone
    at_hangup = engine.steps_run
    waited = _ask_short(engine, Client(app_url, verbose=False))  # sent right after the hang-up
    assert waited < 20, f"the short request waited {waited:.0f} s for the model"  # a step or two of the long one
    stopped = engine.replies[replies]
    assert not stopped.finished and stopped.new_tokens < window
    assert before + 1 + stopped.steps - at_hangup <= 5  # forward passes after the hang-up: a step or two
    _assert_idle(engine)
    assert engine.batcher.running == 0


@needs_chromium
def test_chat_in_a_real_browser(engine, app_url, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    flags = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync"]
    expected_reply = engine.reply([{"role": "user", "content": QUESTION}], use_ppd=False, max_new_tokens=24).text
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=flags)
        page = browser.new_page(viewport={"width": 1100, "height": 1000})
        page.goto(app_url)
        bot = page.locator("#chat .message-row.bot-row")
        stats = page.locator("#stats")

        # An empty message is ignored, with a hint.
        page.locator("#send").click()
        expect(page.get_by_text(webui.EMPTY_HINT).first).to_be_visible(timeout=10_000)
        assert bot.count() == 0

        # A message longer than the context window: a notice in the chat, the text back in the box.
        too_long = " ".join(["word"] * (engine.context_window + 10))
        box = page.locator("#message textarea")
        for _ in range(3):  # the empty send's own outputs (an empty box) may still land just after a fill
            box.fill(too_long)
            page.wait_for_timeout(500)
            if box.input_value() == too_long:
                break
        expect(box).to_have_value(too_long)
        page.wait_for_timeout(1000)  # let the page hand a 40 KB value to gradio before the click reads it
        page.locator("#send").click()
        expect(page.locator("#chat")).to_contain_text("context window", timeout=60_000)
        expect(page.locator("#message textarea")).to_have_value(too_long, timeout=10_000)
        page.locator("#clear").click()
        expect(page.locator("#chat")).not_to_contain_text("context window")

        # A question, streamed: the stats say "generating" before "done", then the answer is there.
        page.locator("#message textarea").fill(QUESTION)
        page.locator("#send").click()
        expect(stats).to_contain_text("generating", timeout=60_000)
        expect(stats).to_contain_text("done", timeout=120_000)
        expect(stats).to_contain_text("PPD")
        expect(stats).to_contain_text("tokens/s")
        ppd_answer = bot.last.inner_text().strip()
        assert ppd_answer == expected_reply.strip()
        page.locator("#show-guesses input").check()
        expect(page.locator("#guesses")).to_be_visible()
        page.screenshot(path=os.environ.get("PPD_SCREENSHOT", str(tmp_path / "webui.png")), full_page=True)

        # PPD off, chat cleared, the same question: the same greedy answer, decoded one token per pass.
        page.locator("#use-ppd input").uncheck()
        page.locator("#clear").click()
        expect(bot).to_have_count(0)
        page.locator("#message textarea").fill(QUESTION)
        page.locator("#message textarea").press("Enter")
        expect(stats).to_contain_text("baseline", timeout=60_000)
        expect(stats).to_contain_text("done", timeout=120_000)
        assert bot.last.inner_text().strip() == ppd_answer

        # Regenerate replaces the last answer (greedy: with the same one), not adds a second.
        page.locator("#regenerate").click()
        expect(stats).not_to_contain_text("done", timeout=10_000)
        expect(stats).to_contain_text("done", timeout=120_000)
        expect(bot).to_have_count(1)
        assert bot.last.inner_text().strip() == ppd_answer
        browser.close()


@needs_chromium
def test_one_users_stop_does_not_stop_anothers_answer(engine, app_url):
    from playwright.sync_api import expect, sync_playwright

    flags = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]
    expected = engine.reply([{"role": "user", "content": QUESTION}], use_ppd=True, max_new_tokens=24).text
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=flags)
        alice, bob = browser.new_page(), browser.new_page()
        for page in (alice, bob):
            page.goto(app_url)
        alice.locator("#max-new-tokens input[type=number]").fill("400")
        alice.locator("#max-new-tokens input[type=number]").press("Enter")
        alice.locator("#message textarea").fill("Tell me a long story about a dragon.")
        alice.locator("#send").click()
        expect(alice.locator("#stats")).to_contain_text("generating", timeout=60_000)
        bob.locator("#message textarea").fill(QUESTION)
        bob.locator("#send").click()  # decodes beside Alice's answer
        alice.locator("#stop").click()
        expect(alice.locator("#stats")).to_contain_text("stopped", timeout=10_000)
        expect(bob.locator("#stats")).to_contain_text("done", timeout=120_000)
        assert bob.locator("#chat .message-row.bot-row").last.inner_text().strip() == expected.strip()
        browser.close()
