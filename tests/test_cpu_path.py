"""The CPU decoding path: packed weights, one head pass per tree step, the dtype chosen for the CPU."""

import pytest
import torch
from torch import nn

from ppd import DecodeConfig, Decoder, eos_ids_of
from ppd.chat import chat_input_ids
from ppd.adapter import AdapterFiles
from ppd.decoding.packed_linear import PackedLinear, ensure_packed, pack_linears, packing_available
from ppd.models import cpu_has_native_bf16, resolve_dtype

from .conftest import random_prompt_tokens, random_tree_set, tiny_model

needs_mkl = pytest.mark.skipif(not packing_available(torch.zeros(1)), reason="this torch has no MKL packed GEMM")


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@needs_mkl
def test_packed_linear_matches_linear_and_leaves_other_row_counts_exact():
    torch.manual_seed(0)
    linear = nn.Linear(96, 200)
    packed = PackedLinear(linear)
    packed.pack(6)
    with torch.no_grad():
        for shape in [(6, 96), (2, 3, 96), (1, 6, 96)]:
            x = torch.randn(*shape)
            torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
        for shape in [(1, 96), (5, 96), (1, 7, 96), (300, 96)]:
            x = torch.randn(*shape)
            assert torch.equal(packed(x), linear(x)), "an unpacked row count must run the plain product"
    # With gradients on (training), the plain product runs: MKL's packed product has no backward.
    x = torch.randn(6, 96, requires_grad=True)
    packed(x).sum().backward()
    assert x.grad is not None and linear.weight.grad is not None
    assert "packed_rows=[6]" in repr(packed)


@needs_mkl
def test_a_model_keeps_a_bounded_number_of_packed_row_counts_the_most_recently_used():
    model = tiny_model("llama", seed=2)
    layers = pack_linears(model)
    for rows in (3, 5, 7):
        ensure_packed(layers, rows, limit=3)
    ensure_packed(layers, 3, limit=3)  # used again: now 5 is the oldest
    ensure_packed(layers, 9, limit=3)
    assert all(sorted(layer.packs) == [3, 7, 9] for layer in layers)
    ensure_packed(layers, 11, limit=3)
    assert all(sorted(layer.packs) == [3, 9, 11] for layer in layers)
    assert all(sorted(layer.last_used) == [3, 9, 11] for layer in layers[-1:])
    # An unpacked count runs the plain product, bit for bit; a packed one agrees within rounding.
    x = torch.randn(7, layers[0].in_features)
    with torch.no_grad():
        assert torch.equal(layers[0](x), nn.functional.linear(x, layers[0].weight, layers[0].bias))
        torch.testing.assert_close(layers[0](x[:3]), nn.functional.linear(x[:3], layers[0].weight, layers[0].bias))


@needs_mkl
def test_packing_keeps_parameters_names_and_ties():
    model = tiny_model("llama", seed=1)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layers = pack_linears(model)
    assert len(layers) == sum(1 for m in model.modules() if isinstance(m, PackedLinear)) > 0
    assert pack_linears(model) == layers, "a second call wraps nothing again"
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_packing_is_skipped_where_unavailable():
    model = tiny_model("llama", seed=1).to(torch.bfloat16)
    assert pack_linears(model) == []
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    with pytest.raises(ValueError, match="float32 model on a CPU"):
        Decoder(model, random_prompt_tokens(model), packed_weights=True)
    if packing_available(torch.zeros(1)):  # wrapped and packed in float32, then moved to bfloat16
        model = tiny_model("llama", seed=1)
        ensure_packed(pack_linears(model), 5)
        model.to(torch.bfloat16)
        assert pack_linears(model) == []
        assert all(not m.packs for m in model.modules() if isinstance(m, PackedLinear))
        assert not Decoder(model, random_prompt_tokens(model)).packed


@needs_mkl
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_packed_ppd_greedy_equals_generate(arch):
    model = tiny_model(arch, seed=3)
    prompt_tokens = random_prompt_tokens(model, seed=3)
    trees = random_tree_set(7, top_k=6, size=14)
    decoder = Decoder(model, prompt_tokens, trees)
    assert decoder.packed and decoder.lm.one_head_pass
    plain = Decoder(tiny_model(arch, seed=3), random_prompt_tokens(tiny_model(arch, seed=3), seed=3), trees,
                    packed_weights=False)
    assert not plain.packed
    long_prompt = [(5 * i + 3) % 24 for i in range(37)]
    for prompt in ([5, 9, 2, 7, 7, 1], long_prompt):
        out = decoder.generate(prompt, DecodeConfig(max_new_tokens=40, stop_on_eos=False))
        assert out.steps < 40, "the prompt tokens should have been right sometimes"
        assert out.token_ids == _hf_greedy(model, prompt, 40)
        assert out.token_ids == plain.generate(prompt, DecodeConfig(max_new_tokens=40, stop_on_eos=False)).token_ids
    batch = decoder.generate([[5, 9, 2], long_prompt], DecodeConfig(max_new_tokens=24, stop_on_eos=False))
    assert [o.token_ids for o in batch] == [_hf_greedy(model, p, 24) for p in ([5, 9, 2], long_prompt)]
    # Each tree step's row count got its pack; the one-row prefill and baseline run unpacked.
    rows = {trees_rows * b for trees_rows in [decoder.tables.num_rows] for b in (1, 2)}
    assert rows <= set(decoder.packed[0].packs)
    assert 1 not in decoder.packed[0].packs


def test_auto_dtype_follows_the_cpu(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("PPD_CPU_BF16", "auto")
    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert resolve_dtype(None, cpu) is expected
    assert resolve_dtype("auto", cpu) is expected
    assert resolve_dtype("float32", cpu) is torch.float32
    for setting, dtype in (("0", torch.float32), ("1", torch.bfloat16)):  # the override, either way
        monkeypatch.setenv("PPD_CPU_BF16", setting)
        assert resolve_dtype(None, cpu) is dtype
        assert resolve_dtype("float32", cpu) is torch.float32
    monkeypatch.setenv("PPD_CPU_BF16", "yes")
    with pytest.raises(ValueError, match="PPD_CPU_BF16 must be auto, 0 or 1"):
        resolve_dtype(None, cpu)


def test_real_model_bf16_agrees_with_fp32_on_the_first_tokens(real_model):
    """bf16 on a CPU (native where the CPU has the instructions, converted inside the kernels elsewhere) decodes
    the real model's answers, and its first tokens are those of float32."""
    import copy

    model, tokenizer, info = real_model
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    tokens = AdapterFiles.default_for(model, tokenizer, info).prompt_tokens
    tokens_bf16 = AdapterFiles.default_for(bf16, tokenizer, info).prompt_tokens
    fp32_decoder = Decoder(model, tokens, eos_token_ids=eos_ids_of(model, tokenizer))
    bf16_decoder = Decoder(bf16, tokens_bf16, eos_token_ids=eos_ids_of(bf16, tokenizer))
    assert not bf16_decoder.packed and bf16_decoder.lm.one_head_pass
    prompts = ["Explain in three sentences why the sky is blue.", "What is the capital of France?"]
    for prompt in prompts:
        ids = chat_input_ids(tokenizer, [{"role": "user", "content": prompt}])
        config = DecodeConfig(max_new_tokens=12)
        fp32 = fp32_decoder.generate(ids, config).token_ids
        ppd = bf16_decoder.generate(ids, config)
        base = bf16_decoder.generate(ids, DecodeConfig(method="baseline", max_new_tokens=12)).token_ids
        assert len(ppd.token_ids) >= 6 and ppd.steps < len(ppd.token_ids)
        assert ppd.token_ids[:6] == fp32[:6] == base[:6]


@needs_mkl
def test_compiled_cpu_step_equals_eager_step():
    """``auto`` on a CPU compiles the step (packed weights inside it, one head pass): the compiled ppd and baseline
    write the eager engine's tokens, which are transformers' greedy tokens."""
    model = tiny_model("llama", seed=5)
    decoder = Decoder(model, random_prompt_tokens(model, seed=5), random_tree_set(11, top_k=6, size=10))
    prompts = [[(7 * i + 3) % 24 for i in range(n)] for n in (5, 30)]
    for method in ("ppd", "baseline"):
        eager = decoder.generate(prompts, DecodeConfig(method=method, max_new_tokens=32, stop_on_eos=False,
                                                       capture="eager"))
        compiled = decoder.generate(prompts, DecodeConfig(method=method, max_new_tokens=32, stop_on_eos=False,
                                                          capture="compile"))
        assert [o.token_ids for o in compiled] == [o.token_ids for o in eager]
        assert [o.token_ids for o in eager] == [_hf_greedy(model, p, 32) for p in prompts]


def test_auto_capture_follows_the_environment(monkeypatch):
    from ppd.decoding.graphs import resolve_mode

    monkeypatch.delenv("PPD_CAPTURE", raising=False)
    assert resolve_mode("auto", torch.device("cpu")).value == "compile"
    assert resolve_mode("auto", torch.device("cuda")).value == "compiled_graph"
    monkeypatch.setenv("PPD_CAPTURE", "eager")
    assert resolve_mode("auto", torch.device("cpu")).value == "eager"
    monkeypatch.setenv("PPD_CAPTURE", "fast")
    with pytest.raises(ValueError, match="PPD_CAPTURE='fast' is not a capture mode"):
        resolve_mode("auto", torch.device("cpu"))
