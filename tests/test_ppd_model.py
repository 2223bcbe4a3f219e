"""``PPDModel.generate`` takes and returns what transformers' ``generate`` does: the same tensors for greedy
batches with left padding and EOS, streamers, stopping criteria and stop strings; what it cannot honour is
refused by name."""

import threading

import pytest
import torch
from transformers import StoppingCriteria, TextIteratorStreamer, TextStreamer

from ppd import Decoder, PPDModel
from ppd.chat import chat_input_ids
from tests.conftest import random_prompt_tokens, random_tree_set, tiny_model


def tiny_ppd(seed: int = 11) -> PPDModel:
    model = tiny_model("llama", seed=seed)
    model.generation_config.pad_token_id = 0
    decoder = Decoder(model, random_prompt_tokens(model, 3, 1, seed=seed), random_tree_set(seed=seed, size=12))
    return PPDModel(model, None, decoder)


class StopAt(StoppingCriteria):
    """Stops a row once its last token is ``token`` (as a user-written criterion would)."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_left_padded_batch_with_eos_equals_transformers_generate():
    ppd = tiny_ppd()
    ids = torch.tensor([[0, 0, 0, 5, 6, 7], [1, 2, 3, 4, 5, 6], [0, 9, 3, 3, 8, 1]])
    mask = (torch.arange(6)[None] >= torch.tensor([[3], [0], [1]])).long()
    free = ppd.model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    # An EOS the first row emits early: that row stops and is padded, the others go on.
    eos = int(free[0, 6 + 4])
    expected = ppd.model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    got = ppd.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    assert torch.equal(got, expected)
    assert ppd.last_outputs[0].finish_reason == "eos" and len(ppd.last_outputs[0].token_ids) <= 5
    # A GenerationConfig object, and max_length instead of max_new_tokens, as transformers reads them.
    config = ppd.model.generation_config.__class__(max_length=20, do_sample=False, pad_token_id=0)
    assert torch.equal(ppd.generate(ids, generation_config=config, attention_mask=mask),
                       ppd.model.generate(ids, generation_config=config, attention_mask=mask))
    # Without a mask, the pad token marks the padding (it is not an EOS id here).
    assert torch.equal(ppd.generate(ids, max_new_tokens=12, eos_token_id=eos),
                       ppd.model.generate(ids, max_new_tokens=12, eos_token_id=eos, do_sample=False))


def test_stopping_criteria_cut_rows_where_transformers_does():
    ppd = tiny_ppd(seed=4)
    ids = torch.tensor([[3, 1, 4, 1, 5], [2, 7, 1, 8, 2]])
    free = ppd.model.generate(ids, max_new_tokens=25, do_sample=False)
    stop = int(free[1, 5 + 1])
    expected = ppd.model.generate(ids, max_new_tokens=25, do_sample=False, stopping_criteria=[StopAt(stop)])
    got = ppd.generate(ids, max_new_tokens=25, stopping_criteria=[StopAt(stop)])
    assert torch.equal(got, expected) and got.shape[1] < free.shape[1]
    assert "stopping_criteria" in {o.finish_reason for o in ppd.last_outputs}


def test_what_ppd_cannot_honour_is_refused_by_name():
    ppd = tiny_ppd()
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="num_beams=2"):
        ppd.generate(ids, num_beams=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="repetition_penalty=1.2"):
        ppd.generate(ids, repetition_penalty=1.2, max_new_tokens=4)
    with pytest.raises(TypeError, match="not_a_setting"):
        ppd.generate(ids, not_a_setting=3, max_new_tokens=4)
    with pytest.raises(ValueError, match="not left-padded"):
        ppd.generate(torch.tensor([[1, 2, 0]]), attention_mask=torch.tensor([[1, 1, 0]]), max_new_tokens=4)
    with pytest.raises(ValueError, match="one sequence"):
        ppd.generate(torch.tensor([[1, 2], [3, 4]]), streamer=TextStreamer(None), max_new_tokens=4)
    with pytest.raises(ValueError, match="integer tensor"):
        ppd.generate(torch.tensor([1.0, 2.0]), max_new_tokens=4)
    with pytest.raises(ValueError, match="leaves no room"):
        ppd.generate(torch.tensor([[1] * 25]), max_length=20)


def test_sampling_follows_torch_manual_seed():
    ppd = tiny_ppd()
    ids = torch.tensor([[1, 2, 3]])
    torch.manual_seed(7)
    first = ppd.generate(ids, do_sample=True, temperature=0.9, top_k=10, top_p=0.9, max_new_tokens=16)
    torch.manual_seed(7)
    again = ppd.generate(ids, do_sample=True, temperature=0.9, top_k=10, top_p=0.9, max_new_tokens=16)
    assert torch.equal(first, again) and first.shape == (1, 19)


@pytest.fixture(scope="module")
def real_ppd(real_model):
    model, tokenizer, info = real_model
    return PPDModel.from_model(model, tokenizer)


def test_real_model_generate_and_streamers_match_transformers(real_ppd, capsys):
    model, tokenizer = real_ppd.model, real_ppd.tokenizer
    assert real_ppd.adapter.startswith("shipped:")  # the shipped adapter, found by the model's name
    prompt = chat_input_ids(tokenizer, [{"role": "user", "content": "Name three primary colours."}])
    ids = torch.tensor([prompt])
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False)
    got = real_ppd.generate(ids, max_new_tokens=48, do_sample=False, streamer=TextStreamer(tokenizer, skip_prompt=True))
    assert torch.equal(got, expected)
    assert real_ppd.last_outputs[0].accept_length > 1.0
    printed = capsys.readouterr().out
    assert printed.strip() == tokenizer.decode(got[0, len(prompt):], skip_special_tokens=True).strip()
    # TextIteratorStreamer, read from another thread as its documentation shows.
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    worker = threading.Thread(target=real_ppd.generate, args=(ids,),
                              kwargs=dict(max_new_tokens=48, streamer=streamer))
    worker.start()
    text = "".join(streamer)
    worker.join()
    assert text.strip() == printed.strip()


def test_real_model_stop_strings_match_transformers(real_ppd):
    model, tokenizer = real_ppd.model, real_ppd.tokenizer
    prompt = chat_input_ids(tokenizer, [{"role": "user", "content": "Count from one to ten in words."}])
    ids = torch.tensor([prompt])
    free = tokenizer.decode(model.generate(ids, max_new_tokens=40, do_sample=False)[0, len(prompt):])
    stop = free.split()[3]  # a word from the middle of the answer
    expected = model.generate(ids, max_new_tokens=40, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    got = real_ppd.generate(ids, max_new_tokens=40, stop_strings=[stop])
    assert torch.equal(got, expected) and got.shape[1] < len(prompt) + 40
