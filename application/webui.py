"""Chat with a model in the browser, with PPD on or off, and watch the speed-up live.

Usage:
    python -m application.webui [--model smollm2-135m-instruct] [--adapter DIR | --ppd-path DIR] [--tree FILE] \\
        [--load_in_4bit | --load_in_8bit] [--host 127.0.0.1] [--port 7860] [--share]

Binds to 127.0.0.1 unless ``--host`` says otherwise; a public gradio link only with ``--share``.
Importing this module loads nothing: ``main`` loads the model, ``build_demo(engine)`` returns the
gradio Blocks (tests start it themselves). Answers of concurrent users decode together in one continuous
batch (``--max_batch`` at once, each exactly as it would alone; more wait in the queue); each browser
session's Stop ends only its own answer. Besides the
chat, the app serves a named API endpoint, ``/generate`` (message, use_ppd, temperature,
max_new_tokens -> text, stats), for ``gradio_client``. It takes what the UI's controls allow (temperature
0..1.5, max_new_tokens 1..the context window) and checks each request when it arrives, before it waits
for the model: an empty message, a prompt that leaves no room in the context window or a setting out of
range is refused at once (HTTP 422 naming the parameter). A max_new_tokens beyond what the window has
left after the prompt ends the answer where the window ends (finish_reason "max_length"). A client that
goes away (or cancels) stops its answer at the next forward pass and frees its row for the next request.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from contextlib import closing

from ppd.cli import LOAD_ERRORS, add_adapter_args, add_engine_args, add_model_args, load_decoder
from ppd.decoder import PromptTooLongError

from .chat_engine import MAX_TEMPERATURE, ChatEngine, ReplyUpdate, message_text

GUESS_LABEL = "PPD guess"
# Title of the chat notices, which are not part of the conversation the model sees.
NOTICE = "⚠️ Not sent to the model: the conversation would not fit its context window"
EMPTY_HINT = "Type a message first: empty messages are not sent."
QUEUE = "model"  # every event that runs the model shares this queue, engine.max_batch at a time
API_PARAMETERS = ("message", "use_ppd", "temperature", "max_new_tokens")  # /generate's, in order


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m application.webui", description=__doc__.split("\n")[0])
    add_model_args(parser)
    add_adapter_args(parser)
    add_engine_args(parser)
    parser.add_argument("--ppd-path", "--ppd_path", dest="adapter", default=argparse.SUPPRESS,
                        help="the reference app's name for --adapter")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default: this machine only)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--share", action="store_true", help="also open a public gradio.live link")
    parser.add_argument("--max_new_tokens", type=int, default=512, help="the slider's starting value")
    parser.add_argument("--max_batch", type=int, default=8, help="answers decoded together (default: %(default)s)")
    return parser


def stats_markdown(update: ReplyUpdate | None, stopped: bool = False) -> str:
    if update is None:
        return "Send a message to see the decoding speed."
    label = "PPD" if update.method == "ppd" else "baseline (one token per forward pass)"
    state = "stopped" if stopped else "done" if update.finished else "generating"
    return (f"**{label}** · {state} · {update.new_tokens} tokens in {update.steps} forward passes · "
            f"accept length **{update.accept_length:.2f}** tokens per pass · **{update.tokens_per_s:.1f}** tokens/s")


def is_notice(message: dict) -> bool:
    return (message.get("metadata") or {}).get("title") == NOTICE


def highlighted(update: ReplyUpdate) -> list[tuple[str, str | None]]:
    return [(text, GUESS_LABEL if guess else None) for text, guess in update.pieces]


def build_demo(engine: ChatEngine, max_new_tokens: int = 512, title: str | None = None):
    """The chat app for ``engine`` (a gradio Blocks; call ``.queue().launch(...)`` on it)."""
    import gradio as gr

    info = engine.loaded
    ppd_available = engine.has_prompt_tokens
    heading = title or (f"# ppd chat\n`{info.info.model_id}` · prompt tokens: `{info.adapter}` · tree: `{info.tree}` · "
                        f"context window {engine.context_window} tokens")

    def add_message(message: str, history: list[dict], shown: str):
        if not message or not message.strip():
            gr.Warning(EMPTY_HINT, duration=4)
            return message, history, EMPTY_HINT
        return "", history + [{"role": "user", "content": message}], shown

    # When each session last pressed Stop. An answer started before that ends at its next forward pass and
    # says so itself: a Stop that only cancelled the event could be overwritten by an update in flight.
    stops: dict[str, float] = {}

    def respond(history: list[dict], use_ppd: bool, show_guesses: bool, temperature: float, limit: int,
                request=None):
        started = time.monotonic()
        session = getattr(request, "session_hash", None)
        conversation = [m for m in history if not is_notice(m)]
        if not conversation or conversation[-1]["role"] != "user":
            return  # nothing new to answer (an empty message was ignored)
        shown = history + [{"role": "assistant", "content": ""}]
        try:
            # gradio closes this generator when the browser goes away or Clear is pressed: closing the
            # engine's stream with it ends the decoding there.
            with closing(engine.stream(conversation, use_ppd=use_ppd, temperature=temperature,
                                       max_new_tokens=limit)) as updates:
                for update in updates:
                    shown[-1] = {"role": "assistant", "content": update.text}
                    stopped = stops.get(session, 0.0) > started
                    yield (shown, stats_markdown(update, stopped=stopped),
                           gr.update(value=highlighted(update), visible=show_guesses), gr.update())
                    if stopped:
                        return  # closing the engine's stream frees the answer's row
        except PromptTooLongError as error:
            # The message leaves the conversation (and goes back into the box); a notice says why.
            notice = {"role": "assistant", "metadata": {"title": NOTICE, "status": "done"},
                      "content": f"{error}. Shorten the message or clear the chat; your text is back in the box."}
            yield (history[:-1] + [notice], "Nothing generated: the conversation is longer than the context window.",
                   gr.update(), message_text(history[-1]["content"]))
        except ValueError as error:  # settings the sliders cannot send (a hand-made request)
            raise gr.Error(str(error)) from None

    def regenerate_prepare(history: list[dict]):
        while history and history[-1]["role"] == "assistant":
            history = history[:-1]
        return history, "Answering again…"

    def api_check(message, use_ppd=True, temperature=0.0, max_new_tokens=256):
        """/generate's validator: gradio runs it as the request arrives, before the request waits in the
        model queue, and refuses the request (HTTP 422, ``gradio_client``'s ``ValidationError``) with the
        message put on the parameter at fault."""
        try:
            engine.prepare([{"role": "user", "content": message}], use_ppd=use_ppd, temperature=temperature,
                           max_new_tokens=max_new_tokens)
        except ValueError as error:  # EmptyMessageError, PromptTooLongError: the message; SettingError: its name
            bad = getattr(error, "name", "message")
            if bad not in API_PARAMETERS:
                return gr.validate(False, str(error))
            return [gr.validate(name != bad, str(error) if name == bad else "") for name in API_PARAMETERS]
        return [gr.validate(True, "") for _ in API_PARAMETERS]

    def api_generate(message: str, use_ppd: bool = True, temperature: float = 0.0,
                     max_new_tokens: int = 256) -> Iterator[tuple[str, dict]]:
        """Answer one message (no history): the text so far and the decoding statistics after every forward
        pass, the last one the whole answer (what ``gradio_client``'s ``predict`` returns). A generator, so
        that gradio can close it, and the decoding with it, when the client disconnects or cancels."""
        try:
            with closing(engine.stream([{"role": "user", "content": message}], use_ppd=use_ppd,
                                       temperature=temperature, max_new_tokens=max_new_tokens)) as updates:
                for update in updates:
                    yield update.text, update.stats()
        except ValueError as error:  # api_check refused these before queueing; the engine checks again
            raise gr.Error(str(error)) from None

    with gr.Blocks(title="ppd chat") as demo:
        gr.Markdown(heading)
        chatbot = gr.Chatbot(label="Chat", height=420, elem_id="chat")
        with gr.Row():
            message = gr.Textbox(placeholder="Type a message and press Enter", show_label=False, scale=8,
                                 elem_id="message", autofocus=True)
            send = gr.Button("Send", variant="primary", scale=1, elem_id="send")
            stop = gr.Button("Stop", variant="stop", scale=1, elem_id="stop")
        with gr.Row():
            regenerate = gr.Button("Regenerate", elem_id="regenerate")
            clear = gr.Button("Clear", elem_id="clear")
        stats = gr.Markdown(stats_markdown(None), elem_id="stats")
        guesses = gr.HighlightedText(label="Last answer: text from accepted PPD guesses is marked", visible=False,
                                     combine_adjacent=True, color_map={GUESS_LABEL: "green"}, show_legend=True,
                                     show_inline_category=False, elem_id="guesses")
        with gr.Accordion("Settings", open=True):
            with gr.Row():
                use_ppd = gr.Checkbox(value=ppd_available, interactive=ppd_available, elem_id="use-ppd",
                                      label="PPD (prompt tokens + tree)" if ppd_available
                                      else "PPD (unavailable: no prompt tokens loaded)")
                show_guesses = gr.Checkbox(value=False, label="Mark tokens from accepted PPD guesses",
                                           elem_id="show-guesses")
            with gr.Row():
                temperature = gr.Slider(0.0, MAX_TEMPERATURE, value=0.0, step=0.05,
                                        label="Temperature (0 = greedy, lossless)", elem_id="temperature")
                limit = gr.Slider(1, engine.context_window, value=max_new_tokens, step=1, label="Max new tokens",
                                  elem_id="max-new-tokens")

        answer_inputs = [chatbot, use_ppd, show_guesses, temperature, limit]
        answer_outputs = [chatbot, stats, guesses, message]
        run = dict(concurrency_limit=engine.max_batch, concurrency_id=QUEUE, api_visibility="private")
        # Taking the message in waits for nobody (no model work); it is queued only so that its hint shows.
        take = dict(fn=add_message, inputs=[message, chatbot, stats], outputs=[message, chatbot, stats],
                    concurrency_limit=None, api_visibility="private")
        submitted = message.submit(**take).then(respond, answer_inputs, answer_outputs, **run)
        clicked = send.click(**take).then(respond, answer_inputs, answer_outputs, **run)
        regenerated = regenerate.click(regenerate_prepare, chatbot, [chatbot, stats], queue=False,
                                       api_visibility="private").then(respond, answer_inputs, answer_outputs, **run)
        def stop_answer(text: str, request=None) -> str:
            stops[getattr(request, "session_hash", None)] = time.monotonic()
            return text.replace("· generating ·", "· stopped ·")

        for fn in (respond, stop_answer):  # gradio passes the request to a parameter annotated so
            fn.__annotations__["request"] = gr.Request
        stop.click(stop_answer, stats, stats, queue=False, api_visibility="private")
        clear.click(lambda: ([], stats_markdown(None), gr.update(value=[], visible=False)), None,
                    [chatbot, stats, guesses], cancels=[submitted, clicked, regenerated], queue=False,
                    api_visibility="private")
        show_guesses.change(lambda show: gr.update(visible=show), show_guesses, guesses, queue=False,
                            api_visibility="private")
        generate = gr.api(api_generate, api_name="generate", concurrency_limit=engine.max_batch, concurrency_id=QUEUE)
        # gr.api has no validator argument (event listeners have); the registered function takes one as well.
        demo.fns[generate["id"]].validator = api_check
    return demo


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if not 1 <= args.port <= 65535:
        parser.error(f"--port must be within 1..65535, not {args.port}")
    if args.max_new_tokens < 1:
        parser.error("--max_new_tokens must be >= 1")
    if args.max_batch < 1:
        parser.error("--max_batch must be >= 1")
    try:
        engine = ChatEngine(load_decoder(args), capture=args.capture, max_batch=args.max_batch)
    except LOAD_ERRORS as error:  # a bad model, adapter, tree or quantisation request
        parser.error(str(error))
    if args.max_new_tokens > engine.context_window:
        parser.error(f"--max_new_tokens {args.max_new_tokens} exceeds the context window ({engine.context_window})")
    demo = build_demo(engine, max_new_tokens=args.max_new_tokens)
    if engine.startup_s:
        print(f"decoding steps compiled and captured in {engine.startup_s:.1f} s "
              f"({len(engine.decoder.captures)} graphs, reused by every message)")
    print(f"up to {engine.max_batch} answers decode together; more wait in the queue")
    print(f"serving on http://{args.host}:{args.port}" + (" and a public share link" if args.share else ""))
    demo.queue(default_concurrency_limit=engine.max_batch).launch(server_name=args.host, server_port=args.port, share=args.share)
    return 0


if __name__ == "__main__":
    sys.exit(main())
