"""Truncation invariants on real ShareGPT conversations with the real default model's chat template."""

import copy

import numpy as np
import pytest

from ppd import load_tokenizer
from ppd.chat import chat_input_ids
from ppd.conversations import MalformedRecord, load_conversations, to_messages
from ppd.truncation import cut_points, tokenize_conversation, truncate

N = 3


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def conversations():
    usable = []
    for record in load_conversations().records[:80]:
        try:
            usable.append(to_messages(record))
        except MalformedRecord:
            pass
    return usable


def test_assistant_blocks_are_exactly_the_replies(tokenizer, conversations):
    for messages in conversations[:30]:
        conv = tokenize_conversation(tokenizer, messages)
        # The whole conversation is what the template renders, tokenised as inference tokenises prompts.
        assert conv.input_ids == chat_input_ids(tokenizer, messages, add_generation_prompt=False)
        replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        assert len(conv.blocks) == len(replies)
        for (start, end), i in zip(conv.blocks, replies):
            # Left of a reply is exactly the prompt the model sees when asked to answer it ...
            assert conv.input_ids[:start] == chat_input_ids(tokenizer, messages[:i], add_generation_prompt=True)
            # ... and the block is the reply text followed by the template's end-of-turn marker.
            text = tokenizer.decode(conv.input_ids[start:end])
            assert text.startswith(messages[i]["content"].strip()[:20])
            assert "<|im_end|>" in text and "<|im_start|>" not in text
        mask = conv.assistant_mask
        assert sum(mask) == sum(end - start for start, end in conv.blocks)


def test_cuts_lie_inside_the_last_reply_and_labels_follow(tokenizer, conversations):
    checked = 0
    for index, messages in enumerate(conversations):
        max_length = 512
        conv = tokenize_conversation(tokenizer, messages)
        try:
            cuts = truncate(tokenizer, messages, N, max_length, np.random.default_rng([0, index]), count=3)
        except MalformedRecord as error:
            assert "no assistant reply of 4+ tokens" in error.reason
            assert all(min(e, max_length) - s < N + 1 for s, e in conv.blocks)
            continue
        eligible = [(s, min(e, max_length)) for s, e in conv.blocks if min(e, max_length) - s >= N + 1]
        start, end = eligible[-1]
        assert len({c.cut for c in cuts}) == len(cuts) <= 3
        for c in cuts:
            assert start <= c.cut <= end - (N + 1)
            assert c.input_ids == conv.input_ids[: c.cut]
            assert c.labels == conv.input_ids[c.cut: c.cut + N + 1] and len(c.labels) == N + 1
            assert len(c.input_ids) + len(c.labels) <= max_length
        checked += 1
    assert checked >= 40


def test_cut_points_are_seeded_and_uniform(tokenizer, conversations):
    conv = tokenize_conversation(tokenizer, conversations[0])
    draw = lambda seed: cut_points(conv, N + 1, 4096, np.random.default_rng([seed, 0]))  # noqa: E731
    assert draw(1) == draw(1)
    start, end = conv.blocks[-1]
    seen = [draw(seed)[0] for seed in range(400)]
    assert min(seen) >= start and max(seen) <= end - (N + 1)
    # Uniform over the reply: both halves are hit about equally often.
    middle = (start + end - N - 1) / 2
    assert 0.4 < np.mean([s < middle for s in seen]) < 0.6


def test_template_that_does_not_render_turn_by_turn_is_reported(tokenizer, conversations):
    shuffled = copy.deepcopy(tokenizer)
    # A template that writes the conversation backwards: a reply's prompt is not a prefix of the whole.
    shuffled.chat_template = ("{% for m in messages | reverse %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(MalformedRecord, match="turn by turn"):
        tokenize_conversation(shuffled, conversations[0])
