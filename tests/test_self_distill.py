"""Self-distilled conversations, the teacher-forced distillation teacher, and evaluation prompts kept out of
the training data."""

import json
import random
from pathlib import Path

import datasets
import pytest
import torch

import data_gen.generate as generate
from data_gen.eval_prompts import SKIP_REASON, EvalPromptFilter, evaluation_prompts
from ppd.contamination import PromptIndex, normalise
from ppd.conversations import MalformedRecord, load_conversations, user_prompts, user_texts
from ppd.dataset_info import PPDDatasetInfo
from ppd.self_distill import NO_ROOM, SelfDistillConfig, make_decoder, self_distill
from ppd.teacher import forced_teacher_topk, shared_sequences, teacher_topk
from tests.conftest import tiny_model

MAX_NEW = 24
SHAREGPT_IDS = ("yn2eWCt_0", "VY7cMKG_0", "i6IyJda_0")  # two with two short user turns, one with one
ONE_WORD = {"id": "one-word", "messages": [
    {"role": "system", "content": "Answer with a single word."},
    {"role": "user", "content": "What colour is a ripe banana?"}, {"role": "assistant", "content": "Yellow."}]}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """Three real ShareGPT records and one with a system message (whose one-word answer ends with EOS)."""
    records = {r["id"]: r for r in load_conversations().records[:600] if r["id"] in SHAREGPT_IDS}
    path = tmp_path_factory.mktemp("src") / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*(records[i] for i in SHAREGPT_IDS), ONE_WORD]))
    return path


def make(path: Path, *argv) -> datasets.Dataset:
    assert generate.main(["--output_path", str(path), *argv]) == 0
    return datasets.load_from_disk(str(path))


@pytest.fixture(scope="module")
def greedy(source, tmp_path_factory):
    # PPD (opt-in; the default is the baseline): its greedy text must still be the model's own
    return make(tmp_path_factory.mktemp("greedy") / "conv", "--dataset_type", "conversations", "--data_path",
                str(source), "--max_new_tokens", str(MAX_NEW), "--decode_method", "ppd")


def test_greedy_replies_are_what_transformers_generates(greedy, real_model):
    model, tokenizer, _ = real_model
    info = PPDDatasetInfo.of(greedy)
    assert info.dataset_type == "conversations" and info.generation["method"] == "ppd"  # the shipped adapter
    assert greedy["id"] == [*SHAREGPT_IDS, "one-word"]
    eos = set(tokenizer.convert_tokens_to_ids([tokenizer.eos_token])) | {model.generation_config.eos_token_id}
    finish = []
    for row in greedy:
        messages = row["messages"]
        replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        assert len(replies) == len(row["reply_token_ids"]) == len(row["finish_reasons"])
        for at, ids, reason in zip(replies, row["reply_token_ids"], row["finish_reasons"]):
            text = tokenizer.apply_chat_template(messages[:at], add_generation_prompt=True, tokenize=False)
            prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=tokenizer.eos_token_id)
            expected = out[0, len(prompt):].tolist()
            ended = bool(expected) and expected[-1] in eos
            assert ids == (expected[:-1] if ended else expected)
            assert reason == ("eos" if ended else "length")
            assert messages[at]["content"] == tokenizer.decode(ids, skip_special_tokens=True)
            finish.append(reason)
    assert sum(len(r["reply_token_ids"]) for r in greedy) == 6  # two turns answered where there were two
    assert {"eos", "length"} <= set(finish)
    assert greedy[3]["messages"][0] == ONE_WORD["messages"][0]  # the system message is kept
    summary = info.summary
    assert summary["replies"] == 6 and summary["rows"] == 4 and summary["skipped"] == {}
    assert summary["generated_tokens"] == sum(map(len, sum(greedy["reply_token_ids"], []))) + finish.count("eos")


SAMPLED = ["--dataset_type", "conversations", "--max_new_tokens", "8", "--max_samples", "2", "--shard_size", "1",
           "--temperature", "0.9", "--top_p", "0.95"]


@pytest.fixture(scope="module")
def sampled(source, tmp_path_factory):
    return make(tmp_path_factory.mktemp("sampled") / "conv", *SAMPLED, "--data_path", str(source), "--seed", "5")


def test_sampling_with_a_seed_repeats_itself(source, sampled, tmp_path):
    again = make(tmp_path / "again", *SAMPLED, "--data_path", str(source), "--seed", "5")
    assert again.to_list() == sampled.to_list()
    info = PPDDatasetInfo.of(sampled)
    assert info.generation["method"] == "baseline" and info.generation["temperature"] == 0.9 and info.seed == 5
    other = make(tmp_path / "other", *SAMPLED, "--data_path", str(source), "--seed", "6", "--max_turns", "1")
    assert [r[:1] for r in sampled["reply_token_ids"]] != other["reply_token_ids"]


def test_an_interrupted_run_resumes_to_the_same_data(source, sampled, tmp_path, monkeypatch):
    real = generate.self_distill
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second shard
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    argv = [*SAMPLED, "--data_path", str(source), "--seed", "5"]
    monkeypatch.setattr(generate, "self_distill", interrupted)
    with pytest.raises(KeyboardInterrupt):
        make(tmp_path / "conv", *argv)
    assert sorted(p.name for p in (tmp_path / "conv.shards").glob("shard-*")) == ["shard-00000-of-00002"]
    calls.clear()
    monkeypatch.setattr(generate, "self_distill", lambda *a, **k: calls.append(1) or real(*a, **k))
    resumed = make(tmp_path / "conv", *argv)
    assert len(calls) == 1 and resumed.to_list() == sampled.to_list()


def test_a_conversations_dataset_is_a_conversation_source(greedy, tmp_path):
    greedy.save_to_disk(str(tmp_path / "conv"))  # a copy, with its ppd metadata
    records = load_conversations(str(tmp_path / "conv")).records
    assert [r["messages"] for r in records] == greedy["messages"]
    truncated = make(tmp_path / "ft", "--dataset_type", "finetune", "--data_path", str(tmp_path / "conv"),
                     "--model_max_length", "160")
    info = PPDDatasetInfo.of(truncated)
    assert len(truncated) >= 2 and "self-distilled by HuggingFaceTB/SmolLM2-135M-Instruct" in info.source
    assert all(len(labels) == 4 for labels in truncated["labels"])
    # A truncated dataset is not a conversation source: said at once.
    with pytest.raises(ValueError, match="is a finetune dataset; conversations reads conversations"):
        generate.run(generate.make_parser().parse_args_into_dataclasses(
            ["--dataset_type", "conversations", "--data_path", str(tmp_path / "ft"),
             "--output_path", str(tmp_path / "x")])[0])


def test_forced_distillation_of_self_distilled_text(greedy, real_model, tmp_path):
    """On the model's own greedy text the forced targets are the text itself: wherever a cut's labels lie in a
    reply whose text tokenises back to the generated ids, up to the end-of-turn marker."""
    _, tokenizer, _ = real_model
    greedy.save_to_disk(str(tmp_path / "conv"))
    forced = make(tmp_path / "forced", "--dataset_type", "distillation", "--data_path", str(tmp_path / "conv"),
                  "--model_max_length", "160", "--top_k", "5", "--cuts_per_conversation", "2", "--teacher", "forced")
    info = PPDDatasetInfo.of(forced)
    assert info.teacher == "forced" and info.summary["teacher_sequences"] == len(greedy) < len(forced)
    faithful = {row["id"] for row in greedy
                if all(tokenizer(m["content"], add_special_tokens=False)["input_ids"] == ids
                       for m, ids in zip([m for m in row["messages"] if m["role"] == "assistant"],
                                         row["reply_token_ids"]))}
    checked = set()
    for row in forced:
        if row["id"] not in faithful:
            continue
        for label, token in zip(row["labels"], row["teacher_token_ids"]):
            if label == tokenizer.eos_token_id:
                break
            assert token == label
        checked.add(row["id"])
    assert len(checked) >= 2


def test_user_prompts_keep_the_system_message_and_the_user_turns():
    record = {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "q1"},
                                {"from": "gpt", "value": ""}, {"from": "system", "value": "later"},
                                {"from": "human", "value": "q2"}, {"from": "human", "value": "q3"}]}
    assert user_prompts(record, 2) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q1"},
                                       {"role": "user", "content": "q2"}]
    with pytest.raises(MalformedRecord, match="no user turn"):
        user_prompts({"messages": [{"role": "assistant", "content": "hello"}]})
    with pytest.raises(MalformedRecord, match="empty message"):
        user_prompts({"messages": [{"role": "user", "content": " "}]})


def test_prompts_without_room_are_counted_not_decoded(real_model):
    model, tokenizer, info = real_model
    decoder = make_decoder(model, tokenizer, info, "baseline", max_seq_len=64)
    prompts = [("long", [{"role": "user", "content": "word " * 200}]),
               ("two", [{"role": "user", "content": "Hi"}, {"role": "user", "content": "word " * 40}])]
    result = self_distill(decoder, tokenizer, prompts, SelfDistillConfig(max_new_tokens=4))
    assert result.skipped == {NO_ROOM: 1} and result.turns_dropped == {NO_ROOM: 1}
    assert [c.id for c in result.conversations] == ["two"] and len(result.conversations[0].reply_token_ids) == 1
    assert [m["role"] for m in result.conversations[0].messages] == ["user", "assistant"]


def test_impossible_conversation_flags_are_rejected():
    for argv in (["--dataset_type", "finetune", "--teacher", "forced"],
                 ["--dataset_type", "conversations", "--max_new_tokens", "2048"],
                 ["--dataset_type", "conversations", "--temperature", "-1"],
                 ["--dataset_type", "conversations", "--top_p", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            generate.main(["--output_path", "x", *argv])
        assert exit_info.value.code == 2


# ----------------------------------------------------------------------------- the forced teacher, tiny model
N, TOP_K = 3, 6


def _greedy_continuation(model, ids: list[int], steps: int) -> list[int]:
    ids = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids


def test_forced_targets_equal_the_greedy_teacher_on_greedy_text():
    model = tiny_model()
    prompt = [5, 9, 1, 17, 3, 11, 20]
    text = _greedy_continuation(model, prompt, 14)
    cuts = list(range(len(prompt), len(text) - N))
    greedy = teacher_topk(model, [text[:c] for c in cuts], N, TOP_K)
    forced = forced_teacher_topk(model, [text], [cuts], N, TOP_K)
    assert torch.equal(forced.token_ids, greedy.token_ids)
    assert torch.equal(forced.topk_ids, greedy.topk_ids)
    torch.testing.assert_close(forced.topk_logprobs, greedy.topk_logprobs, atol=1e-5, rtol=0)


def test_forced_targets_equal_a_direct_computation_on_any_text():
    model = tiny_model()
    generator = torch.Generator().manual_seed(0)
    texts = [torch.randint(0, 24, (n,), generator=generator).tolist() for n in (19, 11, 30)]
    cuts = [[1, 8, 16], [4], [2, 20, 27]]
    out = forced_teacher_topk(model, texts, cuts, N, TOP_K, pad_token_id=0)
    row = 0
    for text, text_cuts in zip(texts, cuts):
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([text])).logits[0].float(), dim=-1)
        for c in text_cuts:
            assert out.token_ids[row].tolist() == logprobs[c - 1: c + N].argmax(-1).tolist()
            values, indices = logprobs[c: c + N].topk(TOP_K, dim=-1)
            assert torch.equal(out.topk_ids[row], indices.to(torch.int32))
            torch.testing.assert_close(out.topk_logprobs[row], values, atol=1e-5, rtol=0)
            row += 1
    with pytest.raises(ValueError, match="needs cuts in"):
        forced_teacher_topk(model, [texts[1]], [[9]], N, TOP_K)


def test_rows_of_one_conversation_share_a_sequence_unless_they_are_not_prefixes():
    x = list(range(100, 130))
    ids = ["a", "a", "a", "b", "b"]
    rows = [(x[:10], x[10:14]), (x[:20], x[20:24]), (x[:5] + [7] * 5, x[10:14]), (x[:6], x[6:10]), (x[:8], x[8:12])]
    groups = shared_sequences(ids, [r[0] for r in rows], [r[1] for r in rows], N)
    assert [(g.rows, g.cuts) for g in groups] == [([0, 1], [10, 20]), ([2], [10]), ([3, 4], [6, 8])]
    assert groups[0].sequence == x[:23] and groups[2].sequence == x[:11]
    assert groups[1].sequence == x[:5] + [7] * 5 + x[10:13]


# ----------------------------------------------------------------------------- evaluation prompts
@pytest.fixture(scope="module")
def eval_filter():
    return EvalPromptFilter()


def test_prompt_index_agrees_with_a_plain_search(eval_filter):
    """Exact and substring matches, found by hashing, are what `==` and `in` find (prompts planted anywhere)."""
    rng = random.Random(0)
    prompts = list(eval_filter.index.labels)
    texts = rng.sample([t for r in load_conversations().records[:3000] for t in user_texts(r)], 300)
    planted = []
    for text in texts:
        if rng.random() < 0.4:
            prompt, at = rng.choice(prompts), rng.randrange(len(text) + 1)
            text = text[:at] + (prompt if rng.random() < 0.8 else prompt.replace(" ", "\n  ")) + text[at:]
        planted.append(text)
    planted += [prompts[0], "  " + prompts[1] + "\n", "What is the meaning of life?", "x What is the meaning of life?"]
    found = eval_filter.index.find(planted)
    for text, labels in zip(planted, found):
        flat = normalise(text)
        expected = {eval_filter.index.labels[p] for p in prompts if p == flat or (len(p) >= 40 and p in flat)}
        assert labels == expected
    assert found[-2] and not found[-1]  # a short prompt counts only as a whole message
    assert sum(bool(f) for f in found) > 100


def test_evaluation_prompts_in_sharegpt_are_found_and_kept_out_of_data_gen(eval_filter, tmp_path):
    prompts, benchmarks = evaluation_prompts()
    assert benchmarks == ["mt_bench", "alpaca_eval", "humaneval", "gsm8k"] and len(prompts) > 2300
    records = load_conversations().records
    flags = eval_filter.contaminated(records)
    hits = [r for r, f in zip(records, flags) if f]
    labels = set().union(*PromptIndex(prompts).find([t for r in hits for t in user_texts(r)]))
    # The embedded ShareGPT file holds 20 Alpaca Eval instructions (in 22 user turns) and nothing of the others.
    assert len(hits) == 22 and len(labels) == 20 and all(label.startswith("alpaca_eval:") for label in labels)
    clean = [r for r, f in zip(records, flags) if not f]

    # data_gen leaves them out and counts them.
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in hits + clean[:4]))
    truncated = make(tmp_path / "ft", "--dataset_type", "finetune", "--data_path", str(path),
                     "--model_max_length", "160")
    info = PPDDatasetInfo.of(truncated)
    assert info.summary["skipped"].get(SKIP_REASON) == len(hits)
    assert info.eval_prompts_excluded == benchmarks
    assert not set(truncated["id"]) & {r["id"] for r in hits}
