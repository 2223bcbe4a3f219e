"""Turning messages into token ids with the model's own chat template."""

from __future__ import annotations


def chat_input_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` ([{role, content}]) rendered by the tokenizer's chat template.

    The template adds its default system prompt where it has one. A tokenizer without a template is an
    error: the caller should pass raw text instead (``plain_input_ids``).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this tokenizer has no chat template; pass the prompt as raw text instead")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    # The template already wrote any BOS/system markers: do not add special tokens a second time.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def plain_input_ids(tokenizer, text: str) -> list[int]:
    """Token ids of raw text, with the tokenizer's usual special tokens (for completion prompts)."""
    return tokenizer(text)["input_ids"]
