"""One loaded model behind a chat: a conversation in, a streamed reply out, with live decoding statistics.

The web UI and its API call this; it knows nothing of gradio. Replies come as a stream of
``ReplyUpdate`` snapshots, one per forward pass and a last one with ``finished`` set: the whole text so
far, the text split into pieces that did or did not come from accepted PPD guesses, and the running
statistics. The snapshots are one object, updated in place.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

from ppd.chat import chat_input_ids
from ppd.cli import Loaded
from ppd.config import CaptureMode, DecodeConfig
from ppd.decoder import GenerationOutput


class EmptyMessageError(ValueError):
    """The user message has no text."""


@dataclass
class ReplyUpdate(GenerationOutput):
    """The reply so far (a snapshot after one forward pass); ``wall_time_s`` counts from the request."""

    method: str = "ppd"  # "ppd" | "baseline"
    text: str = ""
    pieces: list[tuple[str, bool]] = field(default_factory=list)  # (text, came from an accepted PPD guess)
    finished: bool = False

    def stats(self) -> dict:
        return {"method": self.method, **super().stats()}


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
    """Streams replies of one decoder. Forward passes of different callers never overlap: each step runs
    under a lock, which is never held between steps, so a caller that stops reading cannot block others.

    The decoder's steps are compiled and captured once, here (``startup_s`` says how long it took; nothing
    on a CPU, where the step runs eager), and every later message reuses them and the same cache."""

    def __init__(self, loaded: Loaded, capture: CaptureMode | str = CaptureMode.AUTO):
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.decoder = loaded.decoder
        self.capture = CaptureMode(capture)
        self._lock = threading.Lock()
        methods = ("ppd", "baseline") if self.has_prompt_tokens else ("baseline",)
        self.startup_s = self.decoder.warmup(methods=methods, capture=self.capture)

    @property
    def has_prompt_tokens(self) -> bool:
        return self.decoder.prompt_tokens is not None

    @property
    def context_window(self) -> int:
        return self.decoder.max_positions

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of the conversation (``[{role, content}]``, last one the user's) in the chat template."""
        clean = [{"role": m["role"], "content": message_text(m["content"])} for m in messages]
        if not clean or clean[-1]["role"] != "user":
            raise ValueError("the conversation must end with a user message")
        if not clean[-1]["content"].strip():
            raise EmptyMessageError("the message is empty")
        return chat_input_ids(self.tokenizer, clean)

    def stream(self, messages: list[dict], use_ppd: bool = True, temperature: float = 0.0,
               max_new_tokens: int = 512, seed: int | None = None) -> Iterator[ReplyUpdate]:
        """Reply to ``messages``; raises ``PromptTooLongError`` before the first update if the prompt does
        not fit the context window and ``EmptyMessageError`` for an empty last message."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, not {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, not {temperature}")
        method = "ppd" if use_ppd and self.has_prompt_tokens else "baseline"
        ids = self.prompt_ids(messages)
        config = DecodeConfig(method=method, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                              capture=self.capture)
        steps = self.decoder.stream(ids, config)
        update = ReplyUpdate(token_ids=[], steps=0, finish_reason=None, wall_time_s=0.0, method=method)
        start = time.perf_counter()
        while True:
            with self._lock:
                step = next(steps, None)
            if step is None:
                break
            tokens, guessed = step.tokens[0], step.guessed[0]
            if step.step > 0 and tokens:
                update.steps = step.step
            self._extend(update, tokens, guessed)
            update.finish_reason = step.finish_reason[0]
            update.wall_time_s = time.perf_counter() - start
            yield update
        update.finished = True
        yield update

    def reply(self, messages: list[dict], **kwargs) -> ReplyUpdate:
        """The finished reply (``stream`` run to its end)."""
        update = None
        for update in self.stream(messages, **kwargs):
            pass
        return update

    def _extend(self, update: ReplyUpdate, tokens: list[int], guessed: int) -> None:
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
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
