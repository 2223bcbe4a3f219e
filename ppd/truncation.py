"""The truncated dataset: one random cut inside the last assistant reply of a conversation.

A conversation is rendered with the target model's own chat template and tokenised once; the assistant
replies are located by rendering the conversation up to each reply, so any template that renders a
conversation as the concatenation of its turns works (no template-specific markers are assumed). An
example is ``input_ids`` = the tokens before the cut and ``labels`` = the ``num_prompt_tokens + 1``
tokens after it: the root token and one target per prompt token.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from .conversations import MalformedRecord


@dataclass
class TokenizedConversation:
    input_ids: list[int]
    blocks: list[tuple[int, int]]  # [start, end) token spans of the assistant replies, in order

    @property
    def assistant_mask(self) -> list[bool]:
        mask = [False] * len(self.input_ids)
        for start, end in self.blocks:
            mask[start:end] = [True] * (end - start)
        return mask


@dataclass
class Cut:
    input_ids: list[int]
    labels: list[int]
    cut: int  # index of the first label token in the full tokenised conversation


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    except Exception as error:  # jinja raises its own exception types for template-rejected conversations
        raise MalformedRecord(f"chat template rejects the conversation ({type(error).__name__})") from error


def tokenize_conversation(tokenizer, messages: list[dict]) -> TokenizedConversation:
    """Token ids of the rendered conversation and the token spans of its assistant replies.

    A reply's span starts after the assistant header (what ``add_generation_prompt`` renders) and ends
    where the next turn starts, so it includes the template's end-of-turn marker.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template (loaded with --chat_template none), and truncating "
                         "conversations needs one: use --chat_template auto|plain|FILE.jinja, or plain-text records")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("the truncated dataset needs a fast tokenizer (character offsets of each token)")
    full = _render(tokenizer, messages, add_generation_prompt=False)
    char_spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head = _render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not (full.startswith(head) and full.startswith(upto) and len(upto) > len(head)):
            raise MalformedRecord("chat template does not render the conversation turn by turn")
        char_spans.append((len(head), len(upto)))
    # The rendered text already holds the template's special tokens: do not add any a second time.
    encoding = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    starts = [start for start, _ in encoding["offset_mapping"]]
    # A token belongs to the reply its first character falls in (``starts`` is non-decreasing).
    blocks = []
    for char_start, char_end in char_spans:
        first, stop = bisect.bisect_left(starts, char_start), bisect.bisect_left(starts, char_end)
        if stop > first:
            blocks.append((first, stop))
    return TokenizedConversation(list(encoding["input_ids"]), blocks)


def tokenize_text(tokenizer, text: str) -> TokenizedConversation:
    """A plain-text document as one block: every token after the first may start the labels (the
    tokenizer's own special tokens, a BOS for instance, are added as they are for a raw prompt)."""
    ids = list(tokenizer(text)["input_ids"])
    return TokenizedConversation(ids, [(1, len(ids))])


def cut_points(conversation: TokenizedConversation, num_labels: int, max_length: int,
               rng: np.random.Generator, count: int = 1) -> list[int]:
    """Up to ``count`` distinct cut points, uniform inside the last assistant reply that has room for
    ``num_labels`` tokens after the cut within ``max_length`` tokens."""
    for start, end in reversed(conversation.blocks):
        end = min(end, max_length)
        last = end - num_labels  # the latest cut that still leaves num_labels tokens inside the reply
        if start >= 1 and last >= start:
            choices = last - start + 1
            picked = rng.choice(choices, size=min(count, choices), replace=False)
            return sorted(start + int(p) for p in picked)
    raise MalformedRecord(f"no assistant reply of {num_labels}+ tokens within {max_length} tokens")


def truncate(tokenizer, messages: list[dict] | str, num_prompt_tokens: int, max_length: int,
             rng: np.random.Generator, count: int = 1) -> list[Cut]:
    """Cuts of one conversation (``count`` at most, all inside the same reply), or of a plain-text document
    (``messages`` a string: anywhere after its first token)."""
    conversation = (tokenize_text(tokenizer, messages) if isinstance(messages, str)
                    else tokenize_conversation(tokenizer, messages))
    num_labels = num_prompt_tokens + 1
    ids = conversation.input_ids
    return [Cut(ids[:cut], ids[cut: cut + num_labels], cut)
            for cut in cut_points(conversation, num_labels, max_length, rng, count)]
