"""Base models without a chat template: conversations fall back to a plain transcript (or are refused with
``--chat_template none``), plain-text corpora become training data, and decoding and the app work.

The base model here is the real default model's folder with its chat template taken out, as a user's
local base model would be: no template, no ppd metadata, no shipped adapter."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import datasets
import pytest

import data_gen.generate as generate
from ppd import load_tokenizer
from ppd.chat import PLAIN_TEMPLATE, chat_input_ids, choose_chat_template, plain_input_ids
from ppd.dataset_info import PPDDatasetInfo
from ppd.models import DEFAULT_MODEL, resolve_model
from ppd.truncation import tokenize_conversation

ROOT = Path(__file__).resolve().parents[1]
CONVERSATION = [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four."},
                {"role": "user", "content": "And three plus three?"}, {"role": "assistant", "content": "Six."}]


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory) -> Path:
    source = Path(resolve_model(DEFAULT_MODEL)[0])
    folder = tmp_path_factory.mktemp("base") / "smollm2-base"
    folder.mkdir()
    for item in source.iterdir():
        if item.name in ("chat_template.jinja", "ppd_source.json"):
            continue
        if item.name == "tokenizer_config.json":
            config = json.loads(item.read_text())
            config.pop("chat_template", None)
            (folder / item.name).write_text(json.dumps(config))
        else:
            (folder / item.name).symlink_to(item)
    return folder


def test_a_template_less_tokenizer_gets_the_plain_transcript(base_folder, caplog):
    with caplog.at_level(logging.WARNING, logger="ppd.chat"):
        tokenizer = load_tokenizer(str(base_folder))
    assert tokenizer.chat_template == PLAIN_TEMPLATE and "no chat template" in caplog.text
    text = tokenizer.apply_chat_template(CONVERSATION[:3], add_generation_prompt=True, tokenize=False)
    eos = tokenizer.eos_token
    assert text == (f"User: What is two plus two?\n\nAssistant: Four.{eos}\n\nUser: And three plus three?\n\n"
                    "Assistant:")
    # It renders turn by turn, so truncation finds each reply (its end-of-turn EOS included).
    conversation = tokenize_conversation(tokenizer, CONVERSATION)
    replies = [tokenizer.decode(conversation.input_ids[a:b]) for a, b in conversation.blocks]
    assert replies == [f" Four.{eos}\n\n", f" Six.{eos}\n\n"]


def test_template_choices(base_folder, tmp_path):
    bare = load_tokenizer(str(base_folder), chat_template="none")
    assert not bare.chat_template
    with pytest.raises(ValueError, match="no chat template .* --chat_template auto"):
        chat_input_ids(bare, CONVERSATION[:1])
    assert plain_input_ids(bare, "Once upon a time")  # raw text needs no template
    with pytest.raises(ValueError, match="truncating conversations needs one"):
        tokenize_conversation(bare, CONVERSATION)
    own = load_tokenizer(DEFAULT_MODEL)
    assert choose_chat_template(own, "auto") == "own" and "<|im_start|>" in own.chat_template
    assert choose_chat_template(own, "plain") == "plain" and own.chat_template == PLAIN_TEMPLATE
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert choose_chat_template(bare, str(jinja)) == str(jinja)
    assert bare.apply_chat_template(CONVERSATION[:1], tokenize=False) == "[What is two plus two?]"
    with pytest.raises(FileNotFoundError, match="no such Jinja file"):
        choose_chat_template(bare, str(tmp_path / "missing.jinja"))


def test_plain_text_corpus_and_conversations_become_training_data(base_folder, tmp_path):
    story = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as his "
             "father had taught him, and lit the great lamp that warned ships away from the rocks below.")
    records = [{"id": "doc", "text": story}, {"id": "chat", "messages": CONVERSATION}, {"id": "blank", "text": " "}]
    source = tmp_path / "corpus.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "truncated"
    assert generate.main(["--dataset_type", "finetune", "--model", str(base_folder), "--data_path", str(source),
                          "--output_path", str(out), "--num_prompt_tokens", "3", "--cuts_per_conversation", "4"]) == 0
    dataset = datasets.load_from_disk(str(out))
    tokenizer = load_tokenizer(str(base_folder))
    doc = tokenizer(story)["input_ids"]
    rows = {}
    for row in dataset:
        rows.setdefault(row["id"], []).append(row)
    assert len(rows["doc"]) == 4 and "blank" not in rows
    for row in rows["doc"]:  # a cut anywhere in the document: its prefix, then the next N + 1 tokens
        cut = len(row["input_ids"])
        assert row["input_ids"] + row["labels"] == doc[: cut + 4] and cut >= 1
    chat = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert all(tokenizer.decode(r["input_ids"] + r["labels"]) in chat for r in rows["chat"])
    info = PPDDatasetInfo.of(dataset)
    assert info.summary["skipped"] == {"empty message": 1}
    # A template choice that is neither a keyword nor a file: one line naming it, exit status 1.
    assert generate.main(["--dataset_type", "finetune", "--model", str(base_folder), "--data_path", str(source),
                          "--output_path", str(tmp_path / "x"), "--chat_template", str(tmp_path / "nope.jinja")]) == 1


def test_the_app_decodes_a_base_model_through_the_plain_transcript(base_folder):
    def run(*args):
        proc = subprocess.run([sys.executable, "-m", "application.generate", "--model", str(base_folder),
                               "--max_new_tokens", "16", "--json", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr
        return proc, json.loads(proc.stdout.strip().splitlines()[-1])

    proc, chat = run("--prompt", "Name a colour.", "--compare")
    assert "plain 'User: ... / Assistant: ...' transcript" in proc.stderr and "untrained prompt tokens" in proc.stderr
    assert chat["identical"] is True
    _, raw = run("--prompt", "Once upon a time", "--raw", "--chat_template", "none")
    assert raw["new_tokens"] == 16
