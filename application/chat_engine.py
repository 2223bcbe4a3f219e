"""One loaded model behind a chat: a conversation in, a streamed reply out, with live decoding statistics.

The web UI and its API call this; it knows nothing of gradio. Replies come as a stream of
``ReplyUpdate`` snapshots, one per forward pass and a last one with ``finished`` set: the whole text so
far, the text split into pieces that did or did not come from accepted PPD guesses, and the running
statistics. The snapshots are one object, updated in place.

``prepare`` checks a request without touching the model (the app runs it before a request waits for the
model): a message with text, a prompt that leaves room in the context window, settings within the UI's
ranges. ``max_new_tokens`` may ask for more than the window has left after the prompt: the answer then
stops where the window ends (``finish_reason`` ``"max_length"``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

from ppd.chat import chat_input_ids, text_decoder
from ppd.cli import Loaded
from ppd.config import CaptureMode, DecodeConfig
from ppd.decoder import GenerationOutput
from ppd.serving import BatcherConfig, ContinuousBatcher

MAX_TEMPERATURE = 1.5  # the temperature slider's top; requests above it are refused


class EmptyMessageError(ValueError):
    """The user message has no text."""


class SettingError(ValueError):
    """A decoding setting of a request is out of range; ``name`` is the setting's parameter name."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


@dataclass
class Request:
    """A checked request: the prompt's token ids and how to decode them."""

    ids: list[int]
    config: DecodeConfig


@dataclass
class ReplyUpdate(GenerationOutput):
    """The reply so far (a snapshot after one forward pass); ``wall_time_s`` counts from the request."""

    method: str = "ppd"  # "ppd" | "baseline"
    text: str = ""
    pieces: list[tuple[str, bool]] = field(default_factory=list)  # (text, came from an accepted PPD guess)
    finished: bool = False

    def stats(self) -> dict:
        return {"method": self.method, **super().stats()}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def message_text(content) -> str:
    """The text of a chat message's content: a string, or a list of parts with ``text`` (gradio's form)."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text", ""))
    if isinstance(content, (list, tuple)):
        return "".join(message_text(part) for part in content)
    return ""


class ChatEngine:
    """Streams replies of one decoder through a continuous batch: replies of concurrent users share forward
    passes (up to ``max_batch`` at once, more wait), each decoding exactly what it would alone. A caller
    that stops reading (or closes its stream) frees its row at the next step; the others go on.

    The batch's steps are compiled and captured once, here (``startup_s`` says how long it took; nothing
    on a CPU, where the step runs eager), and every later message reuses them and the same cache.
    ``steps_run`` counts the forward passes of every reply so far (prefills included; a pass shared by
    several replies counts once)."""

    def __init__(self, loaded: Loaded, capture: CaptureMode | str = CaptureMode.AUTO, max_batch: int = 8):
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self._decode = text_decoder(loaded.tokenizer)
        self.decoder = loaded.decoder
        self.capture = CaptureMode(capture)
        self.max_batch = max_batch
        self.batcher = ContinuousBatcher(self.decoder, BatcherConfig(max_batch=max_batch, capture=self.capture))
        methods = ("ppd", "baseline") if self.has_prompt_tokens else ("baseline",)
        self.startup_s = self.batcher.warmup(methods=methods)
        self.batcher.start()

    @property
    def steps_run(self) -> int:
        return self.batcher.steps_run

    def close(self) -> None:
        self.batcher.close()

    @property
    def has_prompt_tokens(self) -> bool:
        return self.decoder.prompt_tokens is not None

    @property
    def context_window(self) -> int:
        """Tokens a prompt and its answer can fill together: the model's context window, or the decoder's
        smaller cache (``--max_seq_len``)."""
        return self.decoder.capacity

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of the conversation (``[{role, content}]``, last one the user's) in the chat template."""
        clean = [{"role": m["role"], "content": message_text(m["content"])} for m in messages]
        if not clean or clean[-1]["role"] != "user":
            raise ValueError("the conversation must end with a user message")
        if not clean[-1]["content"].strip():
            raise EmptyMessageError("the message is empty")
        return chat_input_ids(self.tokenizer, clean)

    def prepare(self, messages: list[dict], use_ppd: bool = True, temperature: float = 0.0,
                max_new_tokens: int = 512, seed: int | None = None) -> Request:
        """Check a request without running the model. Raises ``EmptyMessageError`` for an empty last message,
        ``PromptTooLongError`` if the prompt leaves no room in the context window, and ``SettingError``
        naming the setting for anything outside the UI's ranges (values may come from JSON: of any type)."""
        if not isinstance(use_ppd, bool):
            raise SettingError("use_ppd", f"use_ppd must be true or false, not {use_ppd!r}")
        if not _is_number(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:  # also refuses nan and inf
            raise SettingError("temperature", f"temperature must be a number from 0 to {MAX_TEMPERATURE}, "
                                              f"not {temperature!r}")
        window = self.context_window
        if not _is_number(max_new_tokens) or not 1 <= max_new_tokens <= window or max_new_tokens % 1:
            raise SettingError("max_new_tokens", f"max_new_tokens must be a whole number from 1 to {window} "
                                                 f"(the context window), not {max_new_tokens!r}")
        ids = self.prompt_ids(messages)
        self.decoder.check_prompt_fits(len(ids))
        method = "ppd" if use_ppd and self.has_prompt_tokens else "baseline"
        try:
            config = DecodeConfig(method=method, max_new_tokens=int(max_new_tokens), temperature=float(temperature),
                                  seed=seed, capture=self.capture)
        except ValueError as error:  # DecodeConfig's own checks, which name the field first
            name = next((n for n in ("temperature", "max_new_tokens") if str(error).startswith(n)), "settings")
            raise SettingError(name, str(error)) from None
        return Request(ids, config)

    def stream(self, messages: list[dict], use_ppd: bool = True, temperature: float = 0.0,
               max_new_tokens: int = 512, seed: int | None = None) -> Iterator[ReplyUpdate]:
        """Reply to ``messages``; raises what ``prepare`` raises before the first update.

        Closing the stream (``close()``, as gradio does when a client goes away) ends the reply at the next
        step: its row of the batch is free for the next request and the other replies go on."""
        request = self.prepare(messages, use_ppd=use_ppd, temperature=temperature, max_new_tokens=max_new_tokens,
                               seed=seed)
        method = request.config.method.value
        update = ReplyUpdate(token_ids=[], steps=0, finish_reason=None, wall_time_s=0.0, method=method)
        start = time.perf_counter()
        handle = self.batcher.submit(request.ids, request.config)
        chunks = 0
        try:
            for chunk in handle:
                if chunk.finish_reason == "cancelled":
                    break
                if chunk.tokens:
                    update.steps = chunks  # the first chunk is the prefill's token
                    chunks += 1
                self._extend(update, chunk.tokens, chunk.guessed)
                update.finish_reason = chunk.finish_reason
                update.wall_time_s = time.perf_counter() - start
                yield update
        finally:
            handle.cancel()  # a no-op once the reply has finished
            handle.wait(timeout=60)  # the batch drops it at the end of the step in flight: nothing runs after this
        update.finished = True
        yield update

    def reply(self, messages: list[dict], **kwargs) -> ReplyUpdate:
        """The finished reply (``stream`` run to its end)."""
        update = None
        for update in self.stream(messages, **kwargs):
            pass
        return update

    def _extend(self, update: ReplyUpdate, tokens: list[int], guessed: int) -> None:
        decode = self._decode
        before = update.text
        update.token_ids.extend(tokens)
        n_guess_end = len(update.token_ids) - len(tokens) + guessed
        guessed_text = decode(update.token_ids[:n_guess_end]) if guessed else before
        update.text = decode(update.token_ids)
        # Byte-level tokens can end inside a character: cut pieces at what each prefix decodes to.
        if guessed and guessed_text.startswith(before) and update.text.startswith(guessed_text):
            pieces = [(guessed_text[len(before):], True), (update.text[len(guessed_text):], False)]
        else:
            pieces = [(update.text[len(before):], False)] if update.text.startswith(before) else []
        update.pieces.extend((text, flag) for text, flag in pieces if text)
        if not update.text.startswith(before):  # an earlier partial character was completed: rebuild
            update.pieces = [(update.text, False)]
