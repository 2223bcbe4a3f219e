"""A decoder's prefill as plain causal attention (``ppd/decoding/causal_prefill.py``) against the masked one."""

import pytest
import torch

from ppd import DecodeConfig, Decoder
from ppd.decoding import causal_prefill
from ppd.decoding.loop import prefill, reset_rows
from ppd.decoding.step import StepKind
from ppd.prefill import build_prefill
from tests.conftest import random_prompt_tokens, random_tree_set, tiny_model
from tests.test_decoder import assert_same_cache_rows, hf_greedy

BATCH = [[5, 9, 2, 7, 7, 1, 4, 4, 11, 3, 6], [3, 8, 1], [12, 2, 2, 9, 20, 17]]


def prefilled(decoder, batch, use_ppd: bool):
    """The state ``decoder`` leaves after prefilling ``batch`` (its cache, lengths, first tokens and guesses)."""
    state = decoder.states.acquire(len(batch))
    reset_rows(decoder, state, [len(x) for x in batch], DecodeConfig(max_new_tokens=8))
    with torch.no_grad():
        prefill(decoder, batch, state, use_ppd, StepKind(tree=False))
    decoder.states.release(state)
    return state


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_neox"])
@pytest.mark.parametrize("use_ppd", [True, False])
def test_the_causal_prefill_leaves_the_masked_ones_state(monkeypatch, arch, use_ppd):
    """Rows of different lengths, deep prompt tokens with maps: the cache in each row's own slots, and the first
    token and guesses read from the prefill's logits, are the masked prefill's."""
    model = tiny_model(arch, seed=5)
    tokens = random_prompt_tokens(model, n=3, v=1, seed=5, deep=True, rank=2)
    assert causal_prefill.applies(model.config, 3, 1, "ensemble")
    states = []
    for switch in ("off", "on"):
        monkeypatch.setenv(causal_prefill.ENV, switch)
        decoder = Decoder(model, tokens, random_tree_set(5, size=6), packed_weights=False)
        states.append(prefilled(decoder, BATCH, use_ppd))
    masked, causal = states
    assert_same_cache_rows(causal, masked, BATCH, 3 if use_ppd else 0)
    for name in ("lengths", "root", "key") + (("guesses",) if use_ppd else ()):
        assert torch.equal(getattr(causal, name), getattr(masked, name)), name


def test_ppd_through_the_causal_prefill_equals_generate():
    model = tiny_model("qwen2", seed=6)
    decoder = Decoder(model, random_prompt_tokens(model, n=3, v=1, seed=6, deep=True, rank=2), random_tree_set(6))
    outs = decoder.generate(BATCH, DecodeConfig(max_new_tokens=12, stop_on_eos=False))
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 12) for p in BATCH]


def test_the_causal_prefill_builds_no_mask_and_applies_only_where_the_layout_is_causal(monkeypatch):
    model = tiny_model("llama", seed=7)
    tokens = random_prompt_tokens(model, n=3, v=1, seed=7)
    inputs = build_prefill(model, BATCH, tokens().detach(), 3, causal=True)
    assert inputs.mask.shape == (3, 1, 14, 14) and inputs.mask.stride() == (0, 0, 0, 0)  # a view of one zero
    masked = build_prefill(model, BATCH, tokens().detach(), 3)
    assert torch.equal(inputs.positions, masked.positions)

    assert causal_prefill.applies(model.config, 0, 1, "ensemble")  # the baseline's prefill
    assert causal_prefill.applies(model.config, 3, 2, "decoder")  # every copy of every token in order
    assert not causal_prefill.applies(model.config, 3, 2, "ensemble")  # copies see only their own
    assert not causal_prefill.applies(model.config, 3, 1, "encoder")  # a prompt token sees its copies
    assert not causal_prefill.applies(tiny_model("mistral", window=4).config, 3, 1, "ensemble")  # sliding layers
    eager = tiny_model("llama", seed=7)
    eager.config._attn_implementation = "eager"
    assert not causal_prefill.applies(eager.config, 3, 1, "ensemble")
    monkeypatch.setenv(causal_prefill.ENV, "off")
    assert not causal_prefill.applies(model.config, 3, 1, "ensemble")
    monkeypatch.setenv(causal_prefill.ENV, "sometimes")
    with pytest.raises(ValueError, match="PPD_CAUSAL_PREFILL must be on or off"):
        causal_prefill.applies(model.config, 3, 1, "ensemble")
