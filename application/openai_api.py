"""The OpenAI wire format that ``application.serve`` speaks: request bodies, response objects, error bodies.

Requests are pydantic models that refuse what they do not know: an unknown field (``extra="forbid"``), a
value of the wrong JSON type (``strict``: ``"1"`` is not a number, ``1`` is not ``true``), a number out of
range. ``ppd`` adds one request field, ``method`` (``"ppd"`` or ``"baseline"``), and one response field,
``ppd`` (``{"method", "accept_length", "steps"}``). Every refusal is an :class:`APIError`, whose
:meth:`~APIError.body` is OpenAI's ``{"error": {"message", "type", "param", "code"}}``; responses are plain
dicts built by the functions at the end, in the shapes OpenAI's clients parse.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_STRINGS = 4  # as OpenAI


# ---------------------------------------------------------------------------------------------- errors
class APIError(Exception):
    """A request the server refuses: the HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---------------------------------------------------------------------------------------------- requests
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    """One part of a message's content in the list form (only text: the model reads nothing else)."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)

    def for_template(self) -> dict:
        """``{role, content}`` for the chat template; ``developer`` is OpenAI's newer name for ``system``."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text()}


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the running usage in every chunk (exact tokens per step)


class _SamplingRequest(_Strict):
    """The fields chat and text completions share."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(default=None, ge=1)  # None: what the context window leaves after the prompt
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)  # OpenAI's default
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=0)  # as vLLM's: 0 (or -1 there) keeps every token
    seed: int | None = None  # None: a fresh seed per request, as OpenAI samples
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    n: int = 1
    user: str | None = None  # accepted and ignored
    method: Literal["ppd", "baseline"] | None = None  # ppd's extension; None: the server's --method
    acceptance: Literal["lossless", "typical"] = "lossless"  # ppd's extension: how sampled guesses are verified

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n=1 is supported, got {n}")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        return stop

    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stop if s]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def new_tokens(self) -> tuple[int | None, str]:
        """The requested answer length and the name of the field that asked for it."""
        return self.max_tokens, "max_tokens"


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's newer name for max_tokens

    def new_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class CompletionRequest(_SamplingRequest):
    prompt: str


# Names a validation error's location may hold; anything else in it is pydantic's tag of a union member
# ("str", "list[str]", ...), left out of the ``param`` named to the client.
_FIELDS = {name for model in (ChatCompletionRequest, CompletionRequest, ChatMessage, TextPart, StreamOptions)
           for name in model.model_fields}


def validation_error(errors: Sequence[dict]) -> APIError:
    """The 400 for a body that is not JSON or does not fit the request model (pydantic's ``errors()``,
    locations starting with ``"body"`` as FastAPI reports them); ``param`` names the first field at fault."""
    if not errors:
        return APIError(400, "the request body is not valid")
    # A value that fits no member of a union fails once per member: the deepest failure says most.
    error = max((e for e in errors if e.get("loc", ())[:2] == errors[0].get("loc", ())[:2]),
                key=lambda e: len(e.get("loc", ())))
    kind, loc = error.get("type", ""), [part for part in error.get("loc", ()) if part != "body"]
    if kind == "json_invalid":
        detail = (error.get("ctx") or {}).get("error", "")
        where = f" at character {loc[0]}" if loc and isinstance(loc[0], int) else ""
        return APIError(400, f"the request body is not valid JSON ({detail}{where})".replace(" ()", ""))
    if not loc:
        return APIError(400, "the request body must be a JSON object")
    param = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in _FIELDS or (kind == "extra_forbidden" and i == len(loc) - 1):
            param += f".{part}" if param else part
    if kind == "extra_forbidden":
        return APIError(400, f"unknown field {param!r}", param=param)
    if kind == "value_error":  # our validators: their message as written
        message = str((error.get("ctx") or {}).get("error", error.get("msg", "")))
    else:
        message = error.get("msg", "invalid value")
    return APIError(400, f"{param}: {message}", param=param)


# ---------------------------------------------------------------------------------------------- responses
def new_id(kind: Literal["chat", "text"]) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def ppd_stats(method: str, accept_length: float, steps: int) -> dict:
    return {"method": method, "accept_length": accept_length, "steps": steps}


def completion_object(kind: Literal["chat", "text"], id: str, created: int, model: str, text: str,
                      finish_reason: str, usage: dict, ppd: dict) -> dict:
    """The whole answer: a ``chat.completion`` or a ``text_completion``."""
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {"id": id, "object": "chat.completion" if kind == "chat" else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": usage, "ppd": ppd}


def chunk_object(kind: Literal["chat", "text"], id: str, created: int, model: str, *, text: str | None = None,
                 role: bool = False, finish_reason: str | None = None, with_usage: bool = False,
                 ppd: dict | None = None, running_usage: dict | None = None) -> dict:
    """One streamed piece: a ``chat.completion.chunk`` (``delta``) or a ``text_completion`` (``text``).
    ``role`` puts the assistant's role in the delta (a chat's first chunk); ``with_usage`` adds
    ``"usage": null``, as OpenAI does in every chunk but the last when usage is asked for;
    ``running_usage`` the usage so far instead (``stream_options.continuous_usage_stats``)."""
    if kind == "chat":
        delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    chunk = {"id": id, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
             "created": created, "model": model, "choices": [choice]}
    if with_usage or running_usage is not None:
        chunk["usage"] = running_usage
    if ppd is not None:
        chunk["ppd"] = ppd
    return chunk


def sse(obj: dict) -> str:
    """``obj`` as one server-sent event."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


_TEXT, _USAGE = "\x00", "\x01"  # stand for a piece's text and usage in a chunk's template (json.dumps escapes them)


def text_events(kind: Literal["chat", "text"], id: str, created: int, model: str, with_usage: bool = False,
                running_usage: bool = False) -> Callable[..., str]:
    """``event(piece, usage=None)``: the event of each streamed piece of text of one answer, ``sse(chunk_object(kind,
    id, created, model, text=piece, with_usage=with_usage, running_usage=usage))`` to the byte, from a template
    made once (``running_usage``: each chunk carries the usage so far, which ``usage`` then gives). Only the piece
    and the usage are encoded per chunk: a streaming server sends one such event per running request and step,
    and building and encoding the whole object took ~6 % of its event loop's time (a profile on this project's
    CPU, 64 clients)."""
    def whole(piece: str, usage: dict | None = None) -> str:
        return sse(chunk_object(kind, id, created, model, text=piece, with_usage=with_usage, running_usage=usage))

    parts = whole(_TEXT, _USAGE if running_usage else None).split(json.dumps(_TEXT))
    usages = [part.count(json.dumps(_USAGE)) for part in parts]
    if len(parts) != 2 or usages != [0, int(running_usage)]:
        return whole  # a name that holds a stand-in (it never does): every event built whole
    head, rest = parts
    middle, tail = rest.split(json.dumps(_USAGE)) if running_usage else (rest, "")

    def event(piece: str, usage: dict | None = None) -> str:
        if running_usage:
            return head + json.dumps(piece, ensure_ascii=False) + middle + json.dumps(usage) + tail
        return head + json.dumps(piece, ensure_ascii=False) + middle
    return event


def usage_chunk(kind: Literal["chat", "text"], id: str, created: int, model: str, usage: dict) -> dict:
    """The last chunk when ``stream_options.include_usage`` is set: no choices, the usage."""
    return {"id": id, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": created, "model": model, "choices": [], "usage": usage}


def model_list(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "ppd"}]}
