"""An OpenAI-compatible HTTP server: every client's request decoded together in one continuous batch.

Usage:
    python -m application.serve [--model smollm2-135m-instruct] [--adapter DIR] [--tree FILE] \\
        [--host 127.0.0.1] [--port 8000] [--api_key KEY] [--max_batch 64 (GPU) | 4 (CPU)] [--max_queue 256] \\
        [--method ppd|baseline] [--served_model_name NAME]

Endpoints: ``POST /v1/chat/completions`` (messages in the model's chat template), ``POST /v1/completions``
(a plain-text prompt), ``GET /v1/models`` and ``GET /health``. Both completion endpoints stream as
server-sent events with ``"stream": true`` (``stream_options.include_usage`` adds OpenAI's last chunk with
the usage). Sampling follows OpenAI's defaults (temperature 1); ``"temperature": 0`` decodes greedily,
and a greedy answer is the same, token for token, whether it runs alone or among others. Sampled answers
are exact samples from the model (lossless verification), and with a ``seed`` the same text whether ppd
or the baseline decodes it, alone or among others. Besides OpenAI's fields, a request may give ``top_k``
(as vLLM's; 0 keeps every token) and ppd's ``method`` (``"ppd"`` or ``"baseline"``, default ``--method``)
and ``acceptance`` (``"lossless"``, or ``"typical"``: Medusa's typical acceptance, which does not keep the
model's distribution). Every response (the last streamed chunk for a stream) carries
``"ppd": {"method", "accept_length", "steps"}``.

Binds to 127.0.0.1 unless ``--host`` says otherwise. With ``--api_key`` (or ``$PPD_API_KEY``) every ``/v1``
request needs ``Authorization: Bearer <key>``. Refusals use OpenAI's error body: 400 for a body that is
not JSON or not a valid request (unknown fields included), an empty message, or an answer that cannot fit
the context window (``context_length_exceeded``); 401 for a missing or wrong key; 404 for another model;
429 when ``--max_queue`` requests already wait; 503 once the engine has stopped. A client that goes away
cancels its request: its row is freed at the next step and the others go on. The model loads in ``main``;
``create_app(batcher, tokenizer, model_id)`` returns the FastAPI app (tests serve it themselves).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import importlib.util
import logging
import os
import secrets
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from ppd.chat import chat_input_ids, plain_input_ids, text_decoder
from ppd.cli import add_adapter_args, add_engine_args, add_model_args, load_decoder_or_exit
from ppd.config import CaptureMode, DecodeConfig
from ppd.decoder import PromptTooLongError
from ppd.decoding import graphs
from ppd.serving import BatcherConfig, ContinuousBatcher, EngineClosedError, QueueFullError, heap

from .openai_api import (APIError, ChatCompletionRequest, CompletionRequest, chunk_object, completion_object,
                         error_body, model_list, new_id, now, ppd_stats, sse, text_events, usage, usage_chunk,
                         validation_error)

logger = logging.getLogger(__name__)

API_KEY_ENV = "PPD_API_KEY"
# The engine's finish reasons in OpenAI's words (a stop string found in the text is "stop" too).
FINISH_REASONS = {"eos": "stop", "length": "length", "max_length": "length"}
DONE = "data: [DONE]\n\n"


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m application.serve", description=__doc__.split("\n")[0])
    add_model_args(parser)
    add_adapter_args(parser)
    add_engine_args(parser)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="interface to bind (default: this machine only)")
    group.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one "
                                                              "(default: %(default)s)")
    group.add_argument("--api_key", default=os.environ.get(API_KEY_ENV) or None,
                       help=f"require 'Authorization: Bearer KEY' on /v1 requests (default: ${API_KEY_ENV}; "
                            "unset: no key needed)")
    group.add_argument("--max_batch", type=int, default=None,
                       help="requests decoded at once (default: 64 on a GPU, 4 on a CPU); each decoding method "
                            "keeps a cache of this many rows of --max_seq_len tokens")
    group.add_argument("--max_queue", type=int, default=256,
                       help="requests that may wait for a row; more are answered 429 (default: %(default)s)")
    group.add_argument("--method", choices=["ppd", "baseline"], default="ppd",
                       help="how a request that does not name a method decodes (default: %(default)s)")
    group.add_argument("--served_model_name", default=None,
                       help="the model's name in the API (default: the loaded model's id)")
    group.add_argument("--prefill_in_line", action="store_true",
                       help="queue a joining request's prefill on the running rows' stream, between two of their "
                            "steps, instead of on a side stream beside them (GPU; for comparison)")
    group.add_argument("--http", choices=["auto", "httptools", "h11"], default="auto",
                       help="uvicorn's HTTP/1.1 implementation: httptools (C) or h11 (pure Python); auto: httptools "
                            "where it is installed (default: %(default)s)")
    group.add_argument("--loop", choices=["auto", "uvloop", "asyncio"], default="auto",
                       help="the event loop: uvloop (C) or asyncio's own; auto: uvloop where it is installed "
                            "(default: %(default)s)")
    group.add_argument("--switch_interval_ms", type=float, default=None,
                       help="the interpreter's thread switch interval (sys.setswitchinterval): the batcher's thread "
                            "shares the interpreter lock with the HTTP event loop, and after each wait for the device "
                            "it may wait this long for the lock (default: Python's, 5 ms)")
    return parser


# ---------------------------------------------------------------------------------------------- text
class TextDeltas:
    """A request's tokens as the text to send: after each chunk, the new text that can no longer change.

    Tokens do not decode one by one (a character may be split between tokens; some tokenizers drop a word's
    leading space at the start of a sequence), so each chunk's tokens are decoded after the previous
    chunk's, as context, and the text they add is kept once it ends on a whole character (not in the
    replacement character "\ufffd"). Sent text also stays back while it could be the beginning of a stop
    string; it ends before the first stop string found, and ``stopped`` says one was. Each chunk decodes
    only its own tokens and the previous chunk's: a long answer costs no more per token than a short one."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self._decode = text_decoder(tokenizer)
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.decoded = ""  # the text of ids[:_read]
        self.text = ""  # what was sent: a prefix of ``decoded``
        self.stopped = False
        self._prefix = self._read = 0  # ids[_prefix:_read] are decoded again as the context of the next ones

    def push(self, tokens: Sequence[int], final: bool = False) -> str:
        """Take a chunk's tokens; the text that follows what was sent (everything left when ``final``)."""
        if self.stopped:
            return ""
        self.ids.extend(tokens)
        self._advance(final)
        start = len(self.text)
        # A stop string starts after what was sent: the text held back is as long as a stop string but one.
        found = [i for i in (self.decoded.find(s, start) for s in self.stop) if i >= 0]
        if found:
            self.stopped, end = True, min(found)
        else:
            end = len(self.decoded) if final else len(self.decoded) - self.hold
        delta = self.decoded[start:end] if end > start else ""
        self.text += delta
        return delta

    def _advance(self, final: bool) -> None:
        decode = self._decode
        context, text = decode(self.ids[self._prefix:self._read]), decode(self.ids[self._prefix:])
        if not text.startswith(context):  # the new tokens changed how the context decodes: decode it all
            context, text = self.decoded, decode(self.ids)
        if text.endswith("\ufffd") and not final:
            return  # a character is not whole yet: wait for the tokens that complete it
        self.decoded += text[len(context):]
        self._prefix, self._read = self._read, len(self.ids)


# ---------------------------------------------------------------------------------------------- requests
@dataclass
class Job:
    """A checked request, ready to submit."""

    kind: Literal["chat", "text"]
    ids: list[int]
    config: DecodeConfig
    stop: list[str]
    streamed: bool  # answer as server-sent events
    include_usage: bool
    continuous_usage: bool = False  # the running usage in every chunk


class Service:
    """What the endpoints share: the batcher, the tokenizer, the served name, and the checks of a request."""

    def __init__(self, batcher, tokenizer, model_id: str, default_method: str, context_window: int):
        self.batcher = batcher
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.default_method = default_method
        self.context_window = context_window
        self.created = now()

    # ------------------------------------------------------------------ checks
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_id:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{self.model_id}'",
                           param="model", code="model_not_found")

    def chat_ids(self, body: ChatCompletionRequest) -> list[int]:
        last = len(body.messages) - 1
        if not body.messages[last].text().strip():
            raise APIError(400, "the last message is empty", param=f"messages[{last}].content")
        try:
            return chat_input_ids(self.tokenizer, [m.for_template() for m in body.messages])
        except (ValueError, TemplateError) as error:  # no chat template; a conversation the template refuses
            raise APIError(400, f"the messages cannot be put in the model's chat template: {error}",
                           param="messages") from None

    def text_ids(self, body: CompletionRequest) -> list[int]:
        if not body.prompt.strip():
            raise APIError(400, "the prompt is empty", param="prompt")
        return plain_input_ids(self.tokenizer, body.prompt)

    def job(self, kind: Literal["chat", "text"], body: ChatCompletionRequest | CompletionRequest,
            ids: list[int]) -> Job:
        """How to decode ``ids`` as ``body`` asks; refuses what the context window cannot hold."""
        window, prompt = self.context_window, len(ids)
        source = "messages" if kind == "chat" else "prompt"
        if prompt >= window:
            raise APIError(400, f"This model's maximum context length is {window} tokens, but the {source} "
                                f"take {prompt}: no room for an answer", param=source,
                           code="context_length_exceeded")
        asked, name = body.new_tokens()
        if asked is not None and prompt + asked > window:
            raise APIError(400, f"This model's maximum context length is {window} tokens, but {prompt + asked} "
                                f"were requested ({prompt} in the {source}, {asked} in {name}): ask for at most "
                                f"{window - prompt}", param=name, code="context_length_exceeded")
        method = body.method or self.default_method
        if method == "ppd" and self.batcher.decoder.prompt_tokens is None:
            raise APIError(400, "method 'ppd' needs prompt tokens and this server has none: use 'baseline'",
                           param="method")
        # Without a seed, each sampled answer draws its own (the engine would otherwise reuse seed 0).
        seed = body.seed if body.seed is not None else secrets.randbits(31)
        try:
            config = DecodeConfig(method=method, max_new_tokens=asked or window - prompt,
                                  temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                  acceptance=body.acceptance, seed=seed)
        except ValueError as error:
            raise APIError(400, str(error)) from None
        return Job(kind, ids, config, body.stop_strings(), body.stream, body.include_usage, body.continuous_usage)

    def submit(self, job: Job):
        try:
            return self.batcher.submit(job.ids, job.config)
        except QueueFullError as error:
            raise APIError(429, str(error), type="rate_limit_error", code="rate_limit_exceeded") from None
        except EngineClosedError as error:
            raise APIError(503, f"the engine is not running: {error}", type="server_error") from None
        except PromptTooLongError as error:
            raise APIError(400, str(error), code="context_length_exceeded") from None
        except ValueError as error:
            raise APIError(400, str(error)) from None

    # ------------------------------------------------------------------ answers
    async def pieces(self, stream, text: TextDeltas) -> AsyncIterator[tuple[str, str | None]]:
        """``(new text, OpenAI finish reason or None)`` per read of ``stream`` (every chunk that has arrived: one
        when the server keeps up, several steps' when it falls behind), to its end. A stop string cancels the
        request; the chunks that still come until the batcher drops it are read and ignored, so that the
        stream's completion (and its statistics) is there when this ends."""
        async for batch in stream.batches():
            if text.stopped:
                continue
            finish = batch[-1].finish_reason  # only a stream's last chunk has one
            delta = text.push([t for chunk in batch for t in chunk.tokens], final=finish is not None)
            if text.stopped:
                stream.cancel()
                yield delta, "stop"
            elif finish is not None:
                yield delta, FINISH_REASONS.get(finish, finish)
            elif delta:
                yield delta, None

    def ppd(self, job: Job, stream) -> dict:
        done = stream.completion
        if done is None:
            return ppd_stats(job.config.method.value, 0.0, 0)
        return ppd_stats(done.method, done.accept_length, done.steps)

    async def answer(self, job: Job, stream, request) -> dict:
        """The whole answer; the request is cancelled if the client goes away first."""
        text, reason = TextDeltas(self.tokenizer, job.stop), None
        watcher = asyncio.create_task(_cancel_when_gone(request, stream))
        try:
            async for _, finish in self.pieces(stream, text):
                reason = finish or reason
        except EngineClosedError as error:
            raise APIError(503, f"the engine stopped before the answer was done: {error}",
                           type="server_error") from None
        finally:
            watcher.cancel()
            stream.cancel()
        return completion_object(job.kind, new_id(job.kind), now(), self.model_id, text.text, reason or "stop",
                                 usage(len(job.ids), len(text.ids)), self.ppd(job, stream))

    async def events(self, job: Job, stream) -> AsyncIterator[str]:
        """The answer as server-sent events. Ending early (the client went away) cancels the request."""
        id, created, text, reason = new_id(job.kind), now(), TextDeltas(self.tokenizer, job.stop), None

        def running() -> dict | None:  # the usage so far, where every chunk carries it
            return usage(len(job.ids), len(text.ids)) if job.continuous_usage else None

        def chunk(**fields) -> str:
            return sse(chunk_object(job.kind, id, created, self.model_id, with_usage=job.include_usage,
                                    running_usage=running(), **fields))

        # The pieces of text, the most of the events, each from a template made once.
        piece = text_events(job.kind, id, created, self.model_id, job.include_usage, job.continuous_usage)
        try:
            if job.kind == "chat":
                yield chunk(text="", role=True)
            async for delta, finish in self.pieces(stream, text):
                if delta:
                    yield piece(delta, running())
                reason = finish or reason
            yield chunk(finish_reason=reason or "stop", ppd=self.ppd(job, stream))
            if job.include_usage:
                yield sse(usage_chunk(job.kind, id, created, self.model_id, usage(len(job.ids), len(text.ids))))
        except EngineClosedError as error:
            yield sse(error_body(f"the engine stopped before the answer was done: {error}", "server_error"))
        except Exception as error:  # noqa: BLE001 - the status line is sent: the client can only read it here
            logger.exception("streaming an answer failed")
            yield sse(error_body(f"the answer failed: {error}", "server_error"))
        finally:
            stream.cancel()  # a no-op once the request is done
        yield DONE


async def _cancel_when_gone(request, stream, every_s: float = 0.2) -> None:
    """Cancel ``stream`` when the client of ``request`` disconnects (for answers sent in one piece, where
    nothing is written to the connection that would notice)."""
    while not stream.done:
        if await request.is_disconnected():
            stream.cancel()
            return
        await asyncio.sleep(every_s)


# ---------------------------------------------------------------------------------------------- the app
class _RequireApiKey:
    """ASGI middleware: a ``/v1`` request without ``Authorization: Bearer <key>`` is answered 401 before its
    body is read (a client without the key learns nothing else about the server)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and (scope["path"] == "/v1" or scope["path"].startswith("/v1/")):
            given = dict(scope["headers"]).get(b"authorization")
            if not given or not hmac.compare_digest(given, self.expected):
                message = "Incorrect API key provided" if given else \
                    "You didn't provide an API key: send 'Authorization: Bearer <key>'"
                response = JSONResponse(error_body(message, code="invalid_api_key"), status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(batcher, tokenizer, model_id: str, *, api_key: str | None = None, default_method: str = "ppd",
               context_window: int | None = None):
    """The FastAPI app serving ``batcher`` (a started :class:`~ppd.serving.ContinuousBatcher`) under the name
    ``model_id``. ``context_window`` (prompt and answer, in tokens) defaults to the decoder's capacity and
    cannot exceed it. The app does not own the batcher: whoever started it closes it."""
    if default_method not in ("ppd", "baseline"):
        raise ValueError(f"default_method must be 'ppd' or 'baseline', not {default_method!r}")
    capacity = batcher.decoder.capacity
    context_window = capacity if context_window is None else context_window
    if not 2 <= context_window <= capacity:
        raise ValueError(f"context_window must be within 2..{capacity} (the decoder's capacity), "
                         f"not {context_window}")
    service = Service(batcher, tokenizer, model_id, default_method, context_window)
    app = FastAPI(title="ppd", description=__doc__.split("\n")[0])
    if api_key:
        app.add_middleware(_RequireApiKey, api_key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError):
        headers = {"Retry-After": "1"} if error.status == 429 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError):
        refused = validation_error(error.errors())
        return JSONResponse(refused.body(), status_code=refused.status)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, error: HTTPException):
        return JSONResponse(error_body(str(error.detail)), status_code=error.status_code,
                            headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def _failed(request: Request, error: Exception):  # Starlette logs the traceback
        return JSONResponse(error_body(f"internal error: {error}", "server_error"), status_code=500)

    async def respond(kind: Literal["chat", "text"], body, request: Request):
        service.check_model(body.model)
        ids = service.chat_ids(body) if kind == "chat" else service.text_ids(body)
        job = service.job(kind, body, ids)
        stream = service.submit(job)  # here, in the event loop: the stream delivers to this loop
        if not job.streamed:
            return await service.answer(job, stream, request)
        # The generator's own clean-up cancels the request when the client goes away; the background task
        # covers a generator left suspended, never resumed, when the response is torn down.
        return StreamingResponse(service.events(job, stream), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                 background=BackgroundTask(stream.cancel))

    @app.get("/health")
    async def health():
        if getattr(batcher, "error", None) is not None:  # the engine's thread died: nothing will be answered
            return JSONResponse(error_body(f"the engine stopped: {batcher.error}", "server_error"), status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return model_list(service.model_id, service.created)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await respond("chat", body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await respond("text", body, request)

    return app


# ---------------------------------------------------------------------------------------------- main
class ReadyServer(uvicorn.Server):
    """uvicorn's server, printing one line once it listens (scripts wait for it); with port 0, the port
    the system picked."""

    def __init__(self, config: uvicorn.Config, model_id: str):
        super().__init__(config)
        self.model_id = model_id

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            host = f"[{host}]" if ":" in host else host
            print(f"ppd serving {self.model_id} on http://{host}:{port}", flush=True)


def log_to_stderr(name: str, level: int) -> None:
    """Show the records of logger ``name`` from ``level`` up on stderr (uvicorn configures only its own loggers)."""
    log = logging.getLogger(name)
    log.setLevel(level)
    if not log.handlers:
        log.addHandler(logging.StreamHandler(sys.stderr))


def server_stack(http: str, loop: str) -> tuple[str, str]:
    """The HTTP implementation and event loop uvicorn runs (``auto``: the C ones where installed; ValueError
    for a C one asked for and missing). Each streamed chunk costs the server's one thread the HTTP framing, the
    socket write and the loop's wake-up, so at many clients these set how fast tokens leave
    (``results/server_host/``)."""
    chosen = []
    for flag, asked, fast, plain in (("--http", http, "httptools", "h11"), ("--loop", loop, "uvloop", "asyncio")):
        found = importlib.util.find_spec(fast) is not None
        if asked == fast and not found:
            raise ValueError(f"{flag} {fast} needs the {fast} package (pip install {fast})")
        chosen.append(asked if asked != "auto" else fast if found else plain)
    return chosen[0], chosen[1]


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be within 0..65535, not {args.port}")
    if args.max_batch is not None and args.max_batch < 1:
        parser.error(f"--max_batch must be >= 1, not {args.max_batch}")
    if args.max_queue < 0:
        parser.error(f"--max_queue must be >= 0, not {args.max_queue}")
    if args.switch_interval_ms is not None and not args.switch_interval_ms > 0:
        parser.error(f"--switch_interval_ms must be > 0, not {args.switch_interval_ms}")
    try:
        http, loop = server_stack(args.http, args.loop)  # before the model loads
    except ValueError as error:
        parser.error(str(error))

    loaded = load_decoder_or_exit(args)
    if args.max_batch is None:
        args.max_batch = 64 if loaded.decoder.device.type == "cuda" else 4
    model_id = args.served_model_name or loaded.info.model_id
    batcher = ContinuousBatcher(loaded.decoder, BatcherConfig(max_batch=args.max_batch, max_queue=args.max_queue,
                                                              capture=args.capture,
                                                              prefill_beside=not args.prefill_in_line))
    try:
        if batcher.mode is not CaptureMode.EAGER:
            # Minutes on a GPU (each step kind compiled, every bucket captured): say each graph as it is made.
            print(f"compiling and capturing the decoding steps for every batch size up to {args.max_batch}",
                  flush=True)
            log_to_stderr(graphs.__name__, logging.INFO)
        log_to_stderr(heap.__name__, logging.WARNING)  # each garbage collection that holds the batcher up
        seconds = batcher.warmup()  # before the thread starts, while nothing runs (nothing to do on a CPU)
        if seconds:
            print(f"decoding steps compiled and captured in {seconds:.1f} s, for every batch size up to "
                  f"{args.max_batch}; KV caches {batcher.cache_bytes / 2**30:.1f} GiB", flush=True)
        if args.switch_interval_ms is not None:
            sys.setswitchinterval(args.switch_interval_ms / 1e3)
            print(f"thread switch interval {sys.getswitchinterval() * 1e3:g} ms", flush=True)
        if not batcher.config.prefill_beside:
            print("joining requests prefill on the running rows' stream (--prefill_in_line)", flush=True)
        batcher.start()
        app = create_app(batcher, loaded.tokenizer, model_id, api_key=args.api_key, default_method=args.method)
        if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
            print(f"warning: serving on {args.host} without an API key: anyone who can reach it can use it "
                  f"(--api_key or ${API_KEY_ENV})", file=sys.stderr)
        print(f"HTTP: {http}, event loop: {loop}", flush=True)
        config = uvicorn.Config(app, host=args.host, port=args.port, timeout_graceful_shutdown=5, http=http,
                                loop=loop)
        ReadyServer(config, model_id).run()
    except KeyboardInterrupt:  # uvicorn shuts down on Ctrl-C, then raises it again once it is done
        pass
    finally:
        batcher.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
