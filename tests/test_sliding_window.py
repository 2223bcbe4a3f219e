"""Sliding-window attention, read from the config: each layer gets the mask of its own attention kind, in
the prefill (shared with training), in the tree step and in the baseline, on sequences several windows long.
The reference is transformers itself: the model's own forward and ``generate``, which build their sliding
masks from the same config."""

import random
from types import SimpleNamespace

import pytest
import torch

from ppd import DecodeConfig, Decoder
from ppd.attention import LayerAttention
from ppd.prefill import build_prefill
from tests.conftest import random_prompt_tokens, random_tree_set, tiny_model
from tests.test_decoder import hf_greedy
from tests.test_tree_forward import tree_step_rows

WINDOW = 6
ARCHS = ["mistral", "qwen2", "gemma2", "gemma3"]


def own_logits(model, tokens: list[int]) -> torch.Tensor:
    """The model's own forward over ``tokens``: transformers builds every layer's mask itself."""
    return model(input_ids=torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_the_config_decides_which_layers_slide(arch):
    layers = LayerAttention.of(tiny_model(arch, window=WINDOW).config)
    expected = {"mistral": ("sliding_attention",) * 2, "qwen2": ("full_attention", "sliding_attention"),
                "gemma2": ("sliding_attention", "full_attention"),
                "gemma3": ("sliding_attention", "full_attention")}[arch]
    assert layers.layer_types == expected and layers.window == WINDOW
    assert LayerAttention.of(tiny_model("llama").config).kinds == {"full_attention": None}


def test_layers_that_cannot_be_honoured_are_refused():
    chunked = SimpleNamespace(layer_types=["full_attention", "chunked_attention"], sliding_window=None,
                              num_hidden_layers=2)
    with pytest.raises(ValueError, match="attention type chunked_attention"):
        LayerAttention.of(chunked)
    bidirectional = SimpleNamespace(layer_types=["full_attention"], sliding_window=None, num_hidden_layers=1,
                                    use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="bidirectional"):
        LayerAttention.of(bidirectional)
    no_window = SimpleNamespace(layer_types=["sliding_attention"], sliding_window=None, num_hidden_layers=1)
    with pytest.raises(ValueError, match="sliding_window is None"):
        LayerAttention.of(no_window)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_real_rows_equal_the_models_own_forward(arch):
    """The prefill that training and decoding share: its real rows are the model's own logits, past the
    window too (prompt tokens appended after each row, rows of different lengths)."""
    model = tiny_model(arch, window=WINDOW, seed=3)
    pt = random_prompt_tokens(model, n=3, v=2, seed=3)
    batch = [[(5 * i + b) % model.config.vocab_size for i in range(n)] for b, n in enumerate([31, 17])]
    with torch.no_grad():
        inputs = build_prefill(model, batch, pt.embeddings, 3, 2)
        logits = model(inputs_embeds=inputs.embeds, attention_mask=inputs.mask, position_ids=inputs.positions).logits
        for b, tokens in enumerate(batch):
            torch.testing.assert_close(logits[b, : len(tokens)], own_logits(model, tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_forward_equals_per_path_forward_past_the_window(arch):
    """Every node row of a tree step equals the model's own forward over its root-to-node path, and every
    attached prompt row equals the prefill of that path, with a prompt five windows long."""
    model = tiny_model(arch, window=WINDOW, seed=7)
    pt = random_prompt_tokens(model, n=3, v=2, seed=7)
    decoder = Decoder(model, pt, random_tree_set(7, size=10))
    assert_tree_rows_equal_own_forward(decoder, [(7 * i + 1) % model.config.vocab_size for i in range(5 * WINDOW)])


def assert_tree_rows_equal_own_forward(decoder, prompt: list[int]) -> None:
    """Every node row of each tree step after ``prompt`` equals the model's own forward over its
    root-to-node path, and its prompt rows the prefill of that path (two copies per prompt token)."""
    model, pt = decoder.model, decoder.prompt_tokens
    with torch.no_grad():
        for logits, row, tokens, n, prompt_rows in tree_step_rows(decoder, prompt):
            torch.testing.assert_close(logits[row], own_logits(model, tokens)[-1], rtol=1e-4, atol=1e-4)
            inputs = build_prefill(model, [tokens], pt.embeddings[: n * 2], n, 2)
            ref = model(inputs_embeds=inputs.embeds, attention_mask=inputs.mask,
                        position_ids=inputs.positions).logits[0]
            torch.testing.assert_close(logits[prompt_rows], ref[len(tokens): len(tokens) + 2 * n],
                                       rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_ppd_equals_baseline_and_generate_several_windows_long(arch):
    model = tiny_model(arch, window=WINDOW, seed=11)
    vocab = model.config.vocab_size
    rng = random.Random(arch)
    accepted = 0
    for trial in range(6):
        decoder = Decoder(model, random_prompt_tokens(model, 3, rng.choice([1, 2]), seed=trial),
                          random_tree_set(seed=200 + trial, size=rng.randint(8, 16)))
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(2, 4 * WINDOW))] for _ in range(2)]
        n = 4 * WINDOW
        config = dict(max_new_tokens=n, stop_on_eos=False)
        batched = decoder.generate(prompts, DecodeConfig(method="ppd", **config))
        for prompt, ppd in zip(prompts, batched):
            base = decoder.generate(prompt, DecodeConfig(method="baseline", **config))
            assert ppd.token_ids == base.token_ids == hf_greedy(model, prompt, n), (trial, prompt)
            accepted += n - 1 - ppd.steps
    assert accepted > 0, "no guess was ever accepted: the test would not exercise the tree"
