"""Every architecture ppd supports, as a tiny random model built from its own config: the tree forward equals
the model's own forward over each root-to-node path, and PPD greedy equals transformers' greedy ``generate``,
with tied and untied heads, on sequences several sliding windows long, and with a Gemma-3-sized vocabulary.
What each architecture does differently (sliding or alternating attention, final-logit soft-capping, scaled
embeddings, partial rotary embeddings, another module layout) comes from the model and its config alone.
Where ppd cannot decode a model exactly, it says why before decoding anything."""

import random

import pytest
import torch

from ppd import DecodeConfig, Decoder
from ppd.attention import LayerAttention
from ppd.decoding.step import LanguageModel
from ppd.decoding.support import LogitTransform, UnsupportedModelError
from ppd.prefill import build_prefill
from tests.conftest import TINY_VOCAB, random_prompt_tokens, random_tree_set, tiny_model
from tests.test_decoder import hf_greedy
from tests.test_tree_forward import tree_step_rows

WINDOW = 5
ARCHS = ["llama", "qwen2", "mistral", "gemma2", "gemma3", "phi3", "gpt_neox"]
SLIDING = {"qwen2", "mistral", "gemma2", "gemma3", "phi3"}  # the archs whose configs take a sliding window
HUGE_VOCAB = 262_144  # Gemma 3's


def arch_model(arch: str, tied: bool = False, vocab: int = TINY_VOCAB, seed: int = 0):
    return tiny_model(arch, vocab=vocab, seed=seed, window=WINDOW if arch in SLIDING else None,
                      tie_word_embeddings=tied)


def path_logits(model, tokens: list[int], prompt_rows: torch.Tensor) -> torch.Tensor:
    """The model's own forward over ``tokens`` then the embeddings ``prompt_rows`` [n, hidden], one after the
    other: transformers builds every mask (causal, sliding) and the positions itself. Under the ensemble
    attention this is what one copy of the prompt tokens computes appended after ``tokens``."""
    embeds = model.get_input_embeddings()(torch.tensor([tokens]))
    embeds = torch.cat([embeds, prompt_rows.to(embeds.dtype)[None]], dim=1)
    return model(inputs_embeds=embeds).logits[0]


def assert_rows_equal_paths(model, pt, logits, row, tokens, n, prompt_rows):
    """``logits[row]`` is the model's own last logits over ``tokens``; copy j of the n attached prompt rows
    (``prompt_rows``, row ``k * V + j`` for prompt token k) is copy j's prompt tokens appended after them."""
    V = pt.num_ensemble
    table = pt.embeddings.detach()
    for j in range(V):
        ref = path_logits(model, tokens, table[j: n * V: V])
        if j == 0:
            torch.testing.assert_close(logits[row], ref[len(tokens) - 1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(logits[prompt_rows[j::V]], ref[len(tokens):], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", ARCHS)
def test_tree_forward_equals_per_path_forward(arch, tied):
    """Every row of every key's tree step, against the model's own forward over the row's path (the prompt
    three windows long), each copy of its attached prompt tokens appended."""
    seed = ARCHS.index(arch) + 10 * tied
    model = arch_model(arch, tied, seed=seed)
    # The premises: the window is on where the architecture has one; a tied head shares the embeddings' weight.
    assert LayerAttention.of(model.config).window == (WINDOW if arch in SLIDING else None)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    pt = random_prompt_tokens(model, n=3, v=2, seed=seed)
    decoder = Decoder(model, pt, random_tree_set(seed, size=8))
    prompt = [(7 * i + seed) % model.config.vocab_size for i in range(3 * WINDOW)]
    with torch.no_grad():
        for logits, row, tokens, n, prompt_rows in tree_step_rows(decoder, prompt):
            assert_rows_equal_paths(model, pt, logits, row, tokens, n, prompt_rows)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", ARCHS)
def test_ppd_equals_generate(arch, tied):
    """Batches of two prompts, PPD greedy against ``generate`` on each, prompts and answers several windows
    long; a new batch (other prompt tokens and trees) until one accepted a guess, at most three."""
    seed = ARCHS.index(arch) + 10 * tied
    model = arch_model(arch, tied, seed=seed)
    vocab = model.config.vocab_size
    rng = random.Random(f"{arch}{tied}")
    n = 3 * WINDOW
    accepted = 0
    for trial in range(3):
        decoder = Decoder(model, random_prompt_tokens(model, 3, 2, seed=10 * seed + trial),
                          random_tree_set(seed=300 + 10 * seed + trial, top_k=10, size=14))
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(2, 3 * WINDOW))] for _ in range(2)]
        batched = decoder.generate(prompts, DecodeConfig(max_new_tokens=n, stop_on_eos=False))
        for prompt, ppd in zip(prompts, batched):
            assert ppd.token_ids == hf_greedy(model, prompt, n), (trial, prompt)
            accepted += n - 1 - ppd.steps
        if accepted:
            break
    assert accepted > 0, "no guess was ever accepted: the test would not exercise the tree"


@pytest.mark.parametrize("arch,tied", [("gemma3", True), ("llama", False)])
def test_a_262k_vocabulary(arch, tied):
    """Gemma 3's vocabulary of 262,144 tokens (hidden size 32): guesses and candidates past 2**16, the tree
    forward and PPD greedy against ``generate``."""
    model = arch_model(arch, tied, vocab=HUGE_VOCAB, seed=5)
    assert model.get_output_embeddings().weight.shape[0] == HUGE_VOCAB
    pt = random_prompt_tokens(model, n=2, v=1, seed=5)
    decoder = Decoder(model, pt, random_tree_set(5, n_prompt=2, size=6))
    prompt = [(104_729 * i + 7) % HUGE_VOCAB for i in range(2 * WINDOW)]
    largest = 0
    with torch.no_grad():
        for logits, row, tokens, n, prompt_rows in tree_step_rows(decoder, prompt):
            assert_rows_equal_paths(model, pt, logits, row, tokens, n, prompt_rows)
            largest = max(largest, max(tokens[len(prompt):]))
    assert largest >= 1 << 16, "no candidate past 2**16: the test would not exercise large token ids"
    out = decoder.generate(prompt, DecodeConfig(max_new_tokens=2 * WINDOW, stop_on_eos=False))
    assert out.token_ids == hf_greedy(model, prompt, 2 * WINDOW)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_scales_real_tokens_once_and_prompt_tokens_never(arch):
    """Gemma multiplies token embeddings by sqrt(hidden) (in its embedding module). Training's prefill and
    decoding pass real tokens through that module and prompt tokens as they are trained: the prefill's real
    rows equal the model's own forward over the token ids, its prompt rows equal the prompt tokens appended
    after them as embeddings (as the tree step computes them, test above), and the decoder equals generate."""
    model = arch_model(arch, seed=9)
    embedding = model.get_input_embeddings()
    ids = torch.tensor([[3, 4, 5]])
    scale = model.config.hidden_size ** 0.5
    torch.testing.assert_close(embedding(ids), embedding.weight[ids] * scale)  # the premise: Gemma scales
    pt = random_prompt_tokens(model, n=3, v=2, seed=9)
    batch = [[(5 * i + b) % TINY_VOCAB for i in range(n)] for b, n in enumerate([4 * WINDOW, 2 * WINDOW + 1])]
    with torch.no_grad():
        inputs = build_prefill(model, batch, pt.embeddings, 3, 2)
        logits = model(inputs_embeds=inputs.embeds, attention_mask=inputs.mask, position_ids=inputs.positions).logits
        for b, tokens in enumerate(batch):
            n = len(tokens)
            torch.testing.assert_close(inputs.embeds[b, :n], embedding(torch.tensor([tokens]))[0])
            torch.testing.assert_close(inputs.embeds[b, n: n + 6], pt.embeddings.detach())
            own = model(input_ids=torch.tensor([tokens])).logits[0]
            torch.testing.assert_close(logits[b, :n], own, rtol=1e-4, atol=1e-4)
            assert_rows_equal_paths(model, pt, logits[b], n - 1, tokens, 3, list(range(n, n + 6)))
    decoder = Decoder(model, pt, random_tree_set(9, size=10))
    for tokens in batch:
        out = decoder.generate(tokens, DecodeConfig(max_new_tokens=3 * WINDOW, stop_on_eos=False))
        assert out.token_ids == hf_greedy(model, tokens, 3 * WINDOW)


def tiny_of(model_type: str, **fields):
    """A causal LM of ``model_type`` with random weights, from its config's defaults and ``fields``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **fields)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model.eval().requires_grad_(False)


LLAMA_SIZES = dict(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)


@pytest.mark.parametrize("model_type,fields,expected", [
    ("cohere", dict(logit_scale=0.0625), LogitTransform(multiply=0.0625)),  # Cohere multiplies by it
    ("granite", dict(logits_scaling=4.0), LogitTransform(divide=4.0)),  # Granite divides by it
    ("gemma2", dict(final_logit_softcapping=3.0, head_dim=8), LogitTransform(softcap=3.0)),
])
def test_a_head_that_scales_its_logits_is_followed(model_type, fields, expected):
    """Where the config names a constant the model scales its logits by, tree rows get the model's own logits
    (not just its argmax: sampling and typical acceptance read the distribution), and greedy equals generate."""
    model = tiny_of(model_type, **LLAMA_SIZES, **fields)
    lm = LanguageModel.of(model)
    assert lm.transform == expected
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        hidden = lm.body(input_ids=ids).last_hidden_state
        torch.testing.assert_close(lm.logits(hidden), model(input_ids=ids).logits, rtol=0, atol=0)
    decoder = Decoder(model, random_prompt_tokens(model, seed=1), random_tree_set(1, size=10))
    prompt = [5, 3, 8, 1, 2, 9]
    assert decoder.generate(prompt, DecodeConfig(max_new_tokens=12, stop_on_eos=False)).token_ids == \
        hf_greedy(model, prompt, 12)


def test_a_multimodal_gemma3_decodes_text_like_generate():
    """Gemma 3 from 4B up loads as ``Gemma3ForConditionalGeneration``: a vision tower, and a config whose
    layers and context window live in its text config."""
    from transformers import AutoModelForCausalLM, Gemma3Config

    text = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, sliding_window=WINDOW,
                layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=28,
                  patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=37,
                          eoi_token_index=38, image_token_index=39)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().requires_grad_(False)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    assert not hasattr(model.config, "num_hidden_layers")  # the premise
    decoder = Decoder(model, random_prompt_tokens(model, 3, 2, seed=2), random_tree_set(2, size=10))
    assert decoder.max_positions == 256 and decoder.lm.layers.window == WINDOW
    for prompt in ([(3 * i + 1) % 36 for i in range(3 * WINDOW)], [7, 8]):
        out = decoder.generate(prompt, DecodeConfig(max_new_tokens=3 * WINDOW, stop_on_eos=False))
        assert out.token_ids == hf_greedy(model, prompt, 3 * WINDOW)


def known(model_type: str) -> bool:
    """Whether the installed transformers has ``model_type`` (newer architectures are skipped on older ones)."""
    from transformers import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING


MLA = dict(LLAMA_SIZES, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
           qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           first_k_dense_replace=1)
GEMMA4 = dict(LLAMA_SIZES, head_dim=8, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
              hidden_size_per_layer_input=0)


@pytest.mark.parametrize("model_type,fields", [
    ("deepseek_v2", MLA),  # multi-head latent attention: keys of 16 per head, values of 8
    ("gemma4_text", GEMMA4),  # wider heads in its full-attention layers than in its sliding ones
], ids=["deepseek_v2", "gemma4"])
def test_keys_values_and_layers_of_different_widths(model_type, fields):
    """The cache takes each layer's keys and values as they come; PPD greedy equals generate."""
    if not known(model_type):
        pytest.skip(f"this transformers has no {model_type}")
    model = tiny_of(model_type, **fields)
    decoder = Decoder(model, random_prompt_tokens(model, 3, 2, seed=6), random_tree_set(6, size=10))
    for prompt in ([(3 * i + 2) % TINY_VOCAB for i in range(3 * WINDOW)], [4, 9, 1]):
        out = decoder.generate(prompt, DecodeConfig(max_new_tokens=3 * WINDOW, stop_on_eos=False))
        assert out.token_ids == hf_greedy(model, prompt, 3 * WINDOW)
    kv = decoder.states.allocated[0].kv
    widths = [(k.shape[-1], v.shape[-1]) for k, v in zip(kv.keys, kv.values)]
    assert widths[0][0] != widths[0][1] or len(set(widths)) > 1  # keys wider than values, or layers of two widths


def encoder_decoder():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(vocab_size=TINY_VOCAB, d_model=32, d_ff=64, num_layers=1, num_heads=4,
                                               d_kv=8)).eval()


BERT_SIZES = dict(vocab_size=TINY_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64)
# transformers 5.17 marks recurrent models stateful (``_is_stateful``), which ppd refuses by name; 5.25 no longer
# does: there Mamba's config names its layers linear_attention, which the tree masks refuse, and
# RWKV (its state a forward argument of its own) fails the probe forward.
RECURRENT_OR_LINEAR = "keeps a recurrent state|layers of attention type linear_attention"
RECURRENT_OR_PROBED = "keeps a recurrent state|does not compute through ppd's inputs what it computes on its own"
REFUSED = {
    "t5 (encoder-decoder)": (encoder_decoder, "is an encoder-decoder model"),
    "rwkv (recurrent)": (lambda: tiny_of("rwkv", vocab_size=TINY_VOCAB, hidden_size=32, num_hidden_layers=2,
                                         attention_hidden_size=32, intermediate_size=64), RECURRENT_OR_PROBED),
    "mamba (recurrent)": (lambda: tiny_of("mamba", vocab_size=TINY_VOCAB, hidden_size=32, num_hidden_layers=2,
                                          state_size=4), RECURRENT_OR_LINEAR),
    "llama4 (chunked attention)": (lambda: tiny_of("llama4_text", **{**LLAMA_SIZES, "num_hidden_layers": 4},
                                                   intermediate_size_mlp=64, head_dim=8, num_local_experts=2,
                                                   attention_chunk_size=4), "attention type chunked_attention"),
    "bloom (ALiBi from a 2D mask)": (lambda: tiny_of("bloom", vocab_size=TINY_VOCAB, hidden_size=32, n_layer=2,
                                                     n_head=4), "cannot run ppd's forward"),
    "mpt (ALiBi by slot index)": (lambda: tiny_of("mpt", vocab_size=TINY_VOCAB, d_model=32, n_layers=2, n_heads=4,
                                                  expansion_ratio=2, max_seq_len=64),
                                  "does not compute through ppd's inputs what it computes on its own"),
    "gpt_neo (causal mask by slot index)": (
        lambda: tiny_of("gpt_neo", vocab_size=TINY_VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                        attention_types=[[["global", "local"], 1]], window_size=4, bos_token_id=1, eos_token_id=2),
        "does not compute through ppd's inputs what it computes on its own"),
    "bert-generation (bidirectional)": (lambda: tiny_of("bert-generation", **BERT_SIZES),
                                        "does not compute through ppd's inputs what it computes on its own"),
    "bert (a head that transforms)": (lambda: tiny_of("bert", **BERT_SIZES, is_decoder=True),
                                      "logits are not its output embeddings over its last hidden state"),
    "electra (a head from another width)": (
        lambda: tiny_of("electra", **BERT_SIZES, embedding_size=16, is_decoder=True),
        "output embeddings do not apply to its base model's last hidden state"),
    "gemma4 (per-layer inputs read from token ids)": (
        lambda: tiny_of("gemma4_text", **GEMMA4 | dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=24)),
        "cannot run ppd's forward .*prompt tokens that embed no token"),
    "trocr (no logits_to_keep)": (lambda: tiny_of("trocr", vocab_size=TINY_VOCAB, d_model=32, decoder_layers=2,
                                                  decoder_attention_heads=4, decoder_ffn_dim=64),
                                  "ignores logits_to_keep"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_model_ppd_cannot_decode_exactly_is_refused_naming_the_reason(case):
    """Refused when the decoder is made, before anything decodes, as a ``ValueError`` (what the programs
    report in one line): from the config or the model's class where they say it, else by the probe forward."""
    make, reason = REFUSED[case]
    if case.startswith("gemma4") and not known("gemma4_text"):
        pytest.skip("this transformers has no gemma4_text")
    model = make()
    with pytest.raises(ValueError, match=reason):
        Decoder(model)


def test_the_probe_runs_once_per_model(monkeypatch):
    from ppd.decoding import support

    calls = []
    original = support.probe
    monkeypatch.setattr(support, "probe", lambda *args: calls.append(1) or original(*args))
    model = arch_model("llama", seed=3)
    Decoder(model), Decoder(model)
    assert len(calls) == 1
    with pytest.raises(UnsupportedModelError, match="encoder-decoder"):  # refused before any probe
        Decoder(encoder_decoder())
    assert len(calls) == 1


def test_prompt_tokens_from_text_start_as_the_text_enters_the_model():
    """``PromptTokens.from_text`` takes the embedding module's output, so on Gemma it is scaled like the
    text's own tokens (the prompt tokens themselves are never scaled again)."""
    from ppd import PromptTokenConfig, PromptTokens

    model = arch_model("gemma2", seed=4)
    tokenizer = lambda text, add_special_tokens: {"input_ids": [5, 7]}  # noqa: E731 (what from_text calls)
    tokens = PromptTokens.from_text(model, tokenizer, PromptTokenConfig(num_prompt_tokens=3, num_ensemble=1))
    expected = model.get_input_embeddings()(torch.tensor([5, 7, 5]))
    torch.testing.assert_close(tokens.embeddings.detach(), expected)
    assert not torch.allclose(expected, model.get_input_embeddings().weight[[5, 7, 5]])
