"""Long chat prompts of real conversation text, for long-context benchmarks and long-context training data.

A long prompt is one user message in the model's chat template: a transcript of real conversation turns
("User: ...", "Assistant: ..." of consecutive conversations, cut at a token so that the whole prompt has the asked
number of tokens, within ``slack``), a blank line, then a real question: the first user turn of the conversation
that follows the transcript, of at most ``QUESTION_TOKENS`` tokens. ``eval.long_context`` times decoding on them;
``data_gen.long_prompts`` writes them as conversations that the model then answers (``data_gen.generate
--dataset_type conversations``), so that prompt tokens can train where they will decode. Which conversations a
prompt uses is recorded (:class:`LongPrompt`), so that training and benchmark prompts can be kept apart.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .chat import chat_input_ids
from .conversations import MalformedRecord, load_conversations, to_messages

SLACK = 16  # a prompt of P tokens is built with between P - SLACK and P tokens
QUESTION_TOKENS = 64  # the longest question (first user turn) a prompt ends with, in tokens


class ContextError(ValueError):
    """A prompt length, or a number of prompts, that the conversation source cannot give."""


@dataclass(frozen=True)
class LongPrompt:
    """One long prompt: the user message, its chat-template token ids, and the source conversations it uses
    (``first`` to ``question`` - 1 for the transcript, ``question`` for the question), counted among the source's
    usable conversations."""

    text: str
    ids: list[int]
    first: int
    question: int


@functools.lru_cache(maxsize=2)
def conversation_source(data_path: str | None = None) -> tuple[str, tuple[list[dict], ...]]:
    """What the source is, and every usable conversation of it in source order, as ``to_messages`` normalises
    it (read once per process)."""
    source = load_conversations(data_path)
    conversations = []
    for record in source.records:
        try:
            conversations.append(to_messages(record))
        except MalformedRecord:
            continue
    return source.description, tuple(conversations)


def transcript(messages: list[dict]) -> str:
    return "\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in messages)


def _tokens(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def _from_a_word(cut: str, longest: int = 16) -> str:
    """``cut`` from its first whole word where that is near (a cut may start in half a word, or half a
    character); from its first whole character where the first word is long (a URL, a language without
    spaces), so that the prompt stays within a few tokens of the cut."""
    cut = cut.lstrip("\ufffd")
    space = next((i for i, c in enumerate(cut[:longest]) if c.isspace()), None)
    return cut if space is None else cut[space:].lstrip()


def _fit(tokenizer, text_ids: list[int], question: str, num_tokens: int,
         slack: int) -> tuple[str, list[int]] | None:
    """The user message "<the last k tokens of the transcript>\\n\\n<question>" whose chat prompt has between
    ``num_tokens - slack`` and ``num_tokens`` tokens, and those tokens, k found by a few corrections (decoding a
    cut and tokenizing it again shifts a few tokens); ``None`` where the transcript is too short, or where the
    corrections do not settle (a cut that keeps tokenizing differently; rare: the caller takes another question)."""

    def message(transcript_text: str) -> str:
        return f"{transcript_text}\n\n{question}"

    def render(text: str) -> list[int]:
        return chat_input_ids(tokenizer, [{"role": "user", "content": text}])

    target = num_tokens - slack // 2
    keep = target - len(render(message("")))
    for _ in range(16):
        if keep > len(text_ids):
            return None
        text = message(_from_a_word(tokenizer.decode(text_ids[-keep:])))
        ids = render(text)
        if num_tokens - slack <= len(ids) <= num_tokens:
            return text, ids
        keep += target - len(ids)
    return None


def check_room(tokenizer, num_tokens: int, slack: int = SLACK) -> None:
    """Raise :class:`ContextError` where a prompt of ``num_tokens`` tokens leaves no room for a transcript."""
    overhead = len(chat_input_ids(tokenizer, [{"role": "user", "content": ""}]))
    if num_tokens - slack < overhead + QUESTION_TOKENS + slack:
        raise ContextError(f"a long prompt of {num_tokens} tokens leaves no room for a transcript: the chat "
                           f"template takes {overhead} tokens and a question up to {QUESTION_TOKENS}")


def iter_long_prompts(tokenizer, lengths: Sequence[int], data_path: str | None = None, start: int = 0,
                      stride: int = 1, slack: int = SLACK) -> Iterator[LongPrompt]:
    """One long prompt for each of ``lengths`` (tokens, in order), while the source lasts. Prompt i asks the
    question of the first conversation, from ``start`` on (and at least ``stride`` after the previous prompt's),
    whose first user turn is a question of at most ``QUESTION_TOKENS`` tokens and that has enough text before it,
    taken from the conversations just before it (never before ``start``). Deterministic: the same source,
    tokenizer and arguments give the same prompts."""
    for num_tokens in set(lengths):
        check_room(tokenizer, num_tokens, slack)
    if stride < 1:
        raise ValueError(f"stride must be at least 1, got {stride}")
    _, conversations = conversation_source(data_path)
    sizes: dict[int, int] = {}  # tokens of each conversation's transcript, counted once

    def size(index: int) -> int:
        if index not in sizes:
            sizes[index] = len(_tokens(tokenizer, transcript(conversations[index])))
        return sizes[index]

    wanted = iter(lengths)
    num_tokens = next(wanted, None)
    end = start + 1
    while num_tokens is not None and end < len(conversations):
        question = next((m["content"] for m in conversations[end] if m["role"] == "user"), "")
        if not question.strip() or len(_tokens(tokenizer, question)) > QUESTION_TOKENS:
            end += 1
            continue
        first, total = end, 0
        while first > start and total < num_tokens:
            first -= 1
            total += size(first)
        fitted = None
        if total >= num_tokens:  # else not enough text before this question yet
            text = "\n\n".join(transcript(conversations[i]) for i in range(first, end))
            fitted = _fit(tokenizer, _tokens(tokenizer, text), question, num_tokens, slack)
        if fitted is None:
            end += 1
            continue
        yield LongPrompt(*fitted, first=first, question=end)
        num_tokens = next(wanted, None)
        end += stride


def long_prompts(tokenizer, num_tokens: int, count: int, data_path: str | None = None,
                 slack: int = SLACK) -> list[list[int]]:
    """``count`` chat prompts of between ``num_tokens - slack`` and ``num_tokens`` tokens (token ids), from the
    source's first conversations on: row i asks the i-th usable question, so rows differ. Raises
    :class:`ContextError` where the source holds too little text."""
    prompts = [p.ids for p in iter_long_prompts(tokenizer, [num_tokens] * count, data_path, slack=slack)]
    if len(prompts) < count:
        raise ContextError(f"the conversation source holds text for {len(prompts)} prompts of {num_tokens} "
                           f"tokens, not {count}")
    return prompts
