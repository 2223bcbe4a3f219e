"""Turning messages into token ids with the model's chat template, or a plain transcript for base models, and
token ids back into text (:func:`text_decoder`).

A base model has no chat template. Conversations (training data, benchmark questions, chat requests) are
then rendered as a plain transcript, ``PLAIN_TEMPLATE``: each turn as ``Role: text`` separated by blank
lines, assistant turns ending with the EOS token, and a generation prompt of ``Assistant:``. That is what
``--chat_template auto`` (the default) does when the tokenizer has no template; ``plain`` uses it for any
model, ``none`` leaves a template-less tokenizer without one (raw text only: whatever needs a chat template
says so), and a path to a Jinja file installs that template.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

TEMPLATE_CHOICES = ("auto", "plain", "none")

# Renders turn by turn (each conversation's text starts with the text of its first turns), which is what
# truncation needs to find the replies. The space after "Role:" belongs to the turn's text, so that the
# generation prompt ends on "Assistant:" and the reply's first token carries its own leading space. (The
# blank line is an expression: transformers renders with trim_blocks, which eats a newline after a tag.)
PLAIN_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def choose_chat_template(tokenizer, choice: str = "auto") -> str:
    """Set the template conversations are rendered with (see the module docstring); returns which:
    ``own``, ``plain``, ``none`` or the Jinja file's path."""
    own = getattr(tokenizer, "chat_template", None)
    if choice not in TEMPLATE_CHOICES:
        path = Path(choice).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--chat_template {choice}: not one of {', '.join(TEMPLATE_CHOICES)} and no such "
                                    "Jinja file")
        tokenizer.chat_template = path.read_text()
        return str(path)
    if choice == "plain" or (choice == "auto" and not own):
        if not own:
            logger.warning("the tokenizer has no chat template (a base model?): conversations are rendered as a "
                           "plain 'User: ... / Assistant: ...' transcript (--chat_template none turns this off)")
        tokenizer.chat_template = PLAIN_TEMPLATE
        return "plain"
    return "own" if own else "none"


def chat_input_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` ([{role, content}]) rendered by the tokenizer's chat template.

    The template adds its default system prompt where it has one. A tokenizer without a template is an
    error: the caller should pass raw text instead (``plain_input_ids``).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this tokenizer has no chat template (loaded with --chat_template none): pass the prompt "
                         "as raw text, or use --chat_template auto|plain|FILE.jinja")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    # The template already wrote any BOS/system markers: do not add special tokens a second time.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def plain_input_ids(tokenizer, text: str) -> list[int]:
    """Token ids of raw text, with the tokenizer's usual special tokens (for completion prompts)."""
    return tokenizer(text)["input_ids"]


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """Token ids to text without special tokens, as ``tokenizer.decode`` gives it. A fast tokenizer that cleans
    no spaces up afterwards decodes through its Rust tokenizer directly: the same text without the Python
    wrapper's few microseconds, which a server pays twice for every chunk it streams."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
