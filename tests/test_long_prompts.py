"""ppd.long_prompts and data_gen.long_prompts: long chat prompts cut from real ShareGPT text, for the long-context
benchmark and for training data that keeps out of its text."""

import json

import pytest

from data_gen import long_prompts as long_prompts_cli
from eval.long_context import make_parser as long_context_parser
from ppd.chat import chat_input_ids
from ppd.conversations import load_conversations, user_prompts
from ppd.long_prompts import SLACK, ContextError, conversation_source, iter_long_prompts, long_prompts


def _source_text(conversations: int = 400) -> str:
    _, records = conversation_source()
    return "\n".join(m["content"] for messages in records[:conversations] for m in messages)


def test_long_prompts_are_real_text_of_the_asked_length(real_model):
    _, tokenizer, _ = real_model
    prompts = long_prompts(tokenizer, 376, 4)
    assert len(prompts) == 4 and all(376 - SLACK <= len(p) <= 376 for p in prompts)
    assert len({tuple(p) for p in prompts}) == 4  # every row its own prompt
    assert len({len(p) for p in prompts}) > 1  # and the lengths of a batch differ
    assert long_prompts(tokenizer, 376, 4) == prompts  # deterministic
    head = chat_input_ids(tokenizer, [{"role": "user", "content": ""}])
    source = _source_text()
    labelled = 0
    for ids in prompts:
        assert ids[:8] == head[:8]  # one user message in the model's chat template
        text = tokenizer.decode(ids, skip_special_tokens=True)
        labelled += "User: " in text and "Assistant: " in text  # (a cut can fall inside one long reply)
        lines = [line.split(": ", 1)[-1] if line.startswith(("User: ", "Assistant: ")) else line
                 for line in text.splitlines() if len(line) >= 20]
        found = [line in source for line in lines]
        # Every line but the chat template's system prompt is ShareGPT text, the question (the last) too.
        assert found[-1] and sum(found) >= len(found) - 1 and sum(found) >= 3
    assert labelled >= 2  # transcripts of turns


def test_longer_prompts_and_what_is_refused(real_model, tmp_path):
    _, tokenizer, _ = real_model
    prompts = long_prompts(tokenizer, 2048, 2)
    assert all(2048 - SLACK <= len(p) <= 2048 for p in prompts)
    with pytest.raises(ContextError, match="no room for a transcript"):
        long_prompts(tokenizer, 64, 1)
    tiny = tmp_path / "two.json"  # the source's first two conversations: too little text
    tiny.write_text(json.dumps(load_conversations(None).records[:2]))
    with pytest.raises(ContextError, match="holds text for 0 prompts of 2048 tokens, not 1"):
        long_prompts(tokenizer, 2048, 1, data_path=str(tiny))


def test_prompts_of_their_own_lengths_from_a_start_and_a_stride(real_model):
    """Each prompt has its own length; none uses a conversation before ``start``; questions are ``stride`` apart
    at least; each prompt's text is what its ids render; what a prompt uses is recorded."""
    _, tokenizer, _ = real_model
    lengths = [300, 700, 450, 1200, 380]
    prompts = list(iter_long_prompts(tokenizer, lengths, start=40, stride=3))
    assert all(length - SLACK <= len(p.ids) <= length for p, length in zip(prompts, lengths))
    assert all(40 <= p.first < p.question for p in prompts)
    assert all(b.question - a.question >= 3 for a, b in zip(prompts, prompts[1:]))
    assert all(chat_input_ids(tokenizer, [{"role": "user", "content": p.text}]) == p.ids for p in prompts)
    _, conversations = conversation_source()
    for p in prompts:  # the text ends with the question of its conversation
        question = next(m["content"] for m in conversations[p.question] if m["role"] == "user")
        assert p.text.endswith(f"\n\n{question}")
    with pytest.raises(ValueError, match="stride must be at least 1"):
        next(iter_long_prompts(tokenizer, [300], stride=0))


def test_training_prompts_keep_out_of_the_benchmarks_text(real_model):
    """``data_gen.long_prompts`` starts, by default, past every conversation ``eval.long_context`` cuts its prompts
    from at its default contexts and largest batch (four samples of each)."""
    _, tokenizer, _ = real_model
    defaults = long_context_parser().parse_args([])
    count = max(defaults.batch_sizes) * 4
    used = max(p.question for p in iter_long_prompts(tokenizer, [max(defaults.contexts) - 128] * count))
    assert used < long_prompts_cli.DEFAULT_START


def test_the_cli_writes_conversations_that_the_data_pipeline_reads(real_model, tmp_path, capsys):
    _, tokenizer, _ = real_model
    output = tmp_path / "long.json"
    args = ["--output_path", str(output), "--count", "6", "--min_tokens", "300", "--max_tokens", "900",
            "--start", "100"]
    assert long_prompts_cli.main(args) == 0
    assert "6 prompts of" in capsys.readouterr().out
    records = json.loads(output.read_text())
    assert len(records) == 6 and len({r["id"] for r in records}) == 6
    lengths = [r["long_prompt"]["tokens"] for r in records]
    assert all(300 - SLACK <= n <= 900 for n in lengths) and len(set(lengths)) > 1  # drawn, not one length
    source = load_conversations(str(output))
    for record in source.records:
        messages = user_prompts(record)  # what self-distillation answers
        assert [m["role"] for m in messages] == ["user"]
        assert len(chat_input_ids(tokenizer, messages)) == record["long_prompt"]["tokens"]
        assert 100 <= record["long_prompt"]["first"] < record["long_prompt"]["question"]
    assert long_prompts_cli.main(args) == 0  # the same seed, the same file
    assert json.loads(output.read_text()) == records
    for bad, message in ((["--count", "0"], "--count must be at least 1"),
                         (["--min_tokens", "900", "--max_tokens", "300"], "need 16 < min_tokens <= max_tokens"),
                         (["--start", "100000"], "past the source's")):
        assert long_prompts_cli.main([*args, *bad]) == 2
        assert message in capsys.readouterr().err
