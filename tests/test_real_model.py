"""The real default model: PPD greedy == the engine's autoregressive greedy == transformers' generate."""

import pytest
import torch

from ppd import DecodeConfig, Decoder, eos_ids_of
from ppd.chat import chat_input_ids
from ppd.adapter import AdapterFiles

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash map works and give a Python example.",
    "Write a detailed essay about the history of the printing press.",
]


@pytest.fixture(scope="module")
def decoder(real_model):
    model, tokenizer, info = real_model
    prompt_tokens = AdapterFiles.default_for(model, tokenizer, info).prompt_tokens
    return Decoder(model, prompt_tokens, eos_token_ids=eos_ids_of(model, tokenizer))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_ppd_is_lossless_on_the_default_model(real_model, decoder, prompt):
    model, tokenizer, _ = real_model
    ids = chat_input_ids(tokenizer, [{"role": "user", "content": prompt}])
    ppd = decoder.generate(ids, DecodeConfig(max_new_tokens=160))
    base = decoder.generate(ids, DecodeConfig(method="baseline", max_new_tokens=160))
    hf = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                        max_new_tokens=160, do_sample=False)[0, len(ids):].tolist()
    assert len(ppd.token_ids) >= 128, "the prompt should make a long answer"
    assert ppd.token_ids == base.token_ids
    assert ppd.token_ids == hf


def test_batch_of_chat_prompts_matches_single_decoding(real_model, decoder):
    _, tokenizer, _ = real_model
    batch = [chat_input_ids(tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    config = DecodeConfig(max_new_tokens=48)
    outs = decoder.generate(batch, config)
    for ids, out in zip(batch, outs):
        assert out.token_ids == decoder.generate(ids, config).token_ids
