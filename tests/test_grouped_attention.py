"""The dense step's SDPA over unrepeated key heads (``ppd.decoding.grouped_attention``): it is what the step
runs where the model groups its query heads, it gives transformers' own SDPA result, and it steps aside
where it does not apply."""

import pytest
import torch

from ppd import Decoder
from ppd.decoding import grouped_attention
from tests.conftest import random_prompt_tokens, random_tree_set, tiny_model
from tests.test_tree_forward import tree_step_rows


class _Layer:  # what transformers' SDPA function reads from an attention layer
    is_causal = True
    training = False
    num_key_value_groups = 3


def _tensors(mask_dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 5, 16, generator=g)
    k, v = torch.randn(2, 2, 24, 16, generator=g), torch.randn(2, 2, 24, 16, generator=g)
    allowed = torch.rand(2, 1, 5, 24, generator=g) > 0.3
    allowed[..., 0] = True  # every row sees something
    mask = allowed if mask_dtype == torch.bool else torch.zeros(allowed.shape).masked_fill(~allowed, -1e30)
    return q, k, v, mask


@pytest.mark.parametrize("mode", ["auto", "folded", "matmul", "split"])
@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bool])
@pytest.mark.parametrize("per_head", [False, True])
def test_equals_transformers_sdpa(mode, mask_dtype, per_head):
    """Every layout (``split`` on a CPU without Triton's interpreter: SDPA's), a mask shared by every head or one
    per query head."""
    q, k, v, mask = _tensors(mask_dtype)
    if per_head:
        mask = torch.cat([mask, mask.flip(-1)] * 3, dim=1)  # [B, 6, T, W]: heads see different keys
        mask[..., 0] = True if mask_dtype == torch.bool else 0.0
    own = grouped_attention._own_sdpa()
    function = {"auto": grouped_attention.grouped_sdpa, "folded": grouped_attention.folded_sdpa,
                "matmul": grouped_attention.matmul_sdpa, "split": grouped_attention.split_sdpa}[mode]
    got, _ = function(_Layer(), q, k, v, mask, scaling=0.25)
    want, _ = own(_Layer(), q, k, v, mask, scaling=0.25)
    assert got.shape == (2, 5, 6, 16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_hands_other_cases_to_transformers(monkeypatch):
    """No mask (transformers then decides causality) and soft-capping go to transformers' own function."""
    q, k, v, mask = _tensors()
    calls = []
    monkeypatch.setattr(grouped_attention, "_own_sdpa", lambda: lambda *a, **kw: calls.append(kw) or ("own", None))
    assert grouped_attention.grouped_sdpa(_Layer(), q, k, v, None)[0] == "own"
    assert grouped_attention.grouped_sdpa(_Layer(), q, k, v, mask, softcap=30.0)[0] == "own"
    assert grouped_attention.grouped_sdpa(_Layer(), q, k[:, :1].expand(-1, 6, -1, -1), v[:, :1].expand(-1, 6, -1, -1),
                                          mask)[0] == "own"
    assert len(calls) == 3 and calls[1]["softcap"] == 30.0


@pytest.mark.parametrize("arch,mode", [("llama", "auto"), ("qwen2", "auto"), ("mistral", "auto"), ("llama", "gqa"),
                                       ("llama", "folded"), ("qwen2", "matmul")])
def test_dense_step_runs_it_and_matches_repeated_heads(arch, mode, monkeypatch):
    """A tree step of a model with grouped query heads calls the function once per layer, and its logits
    are those of the same step through transformers' SDPA (``PPD_GROUPED_SDPA=off``)."""
    monkeypatch.setenv("PPD_GROUPED_SDPA", mode)
    model = tiny_model(arch, seed=3)
    decoder = Decoder(model, random_prompt_tokens(model, n=3, v=2, seed=3), random_tree_set(3, size=10))
    prompt = [(5 * i + 1) % model.config.vocab_size for i in range(11)]
    calls = []
    original = grouped_attention.grouped_sdpa

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(grouped_attention, "grouped_sdpa", counted)
    grouped = [logits.clone() for logits, row, *_ in tree_step_rows(decoder, prompt) if row == 0]
    steps = len(grouped)
    assert len(calls) == steps * model.config.num_hidden_layers
    assert model.config._attn_implementation == "sdpa"  # the model's own comes back after each step
    monkeypatch.setenv("PPD_GROUPED_SDPA", "off")
    repeated = [logits.clone() for logits, row, *_ in tree_step_rows(decoder, prompt) if row == 0]
    assert len(calls) == steps * model.config.num_hidden_layers  # not called with it off
    for a, b in zip(grouped, repeated):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_applies_only_to_grouped_sdpa_models(monkeypatch):
    llama, gemma2 = tiny_model("llama"), tiny_model("gemma2")
    assert grouped_attention.applies(llama.config, 2)
    assert not grouped_attention.applies(llama.config, 1)  # every query head has its own key head
    assert not grouped_attention.applies(gemma2.config, 2)  # eager attention (soft-capping): left alone
    monkeypatch.setenv("PPD_GROUPED_SDPA", "off")
    assert not grouped_attention.applies(llama.config, 2)
    monkeypatch.setenv("PPD_GROUPED_SDPA", "yes")
    with pytest.raises(ValueError, match="PPD_GROUPED_SDPA must be one of auto, off, gqa, folded, matmul, split"):
        grouped_attention.applies(llama.config, 2)


def test_auto_runs_tree_steps_through_the_split_kernel_on_a_gpu_only(monkeypatch):
    """``auto`` is the split kernel on a CUDA device where Triton is installed (with the tree's own mask where no
    layer has a sliding window) and SDPA with ``enable_gqa`` on a CPU or without Triton; a named layout is kept."""
    from ppd.decoding import split_attention

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("PPD_GROUPED_SDPA", raising=False)
    monkeypatch.delenv("PPD_SPLIT_MASK", raising=False)
    monkeypatch.setattr(split_attention, "HAS_TRITON", True)
    assert grouped_attention.layout(gpu) == "split" and grouped_attention.layout(cpu) == "gqa"
    assert grouped_attention.compact_tree_mask([None, None], gpu)
    assert not grouped_attention.compact_tree_mask([None, 4096], gpu)  # a sliding window: the width's mask
    assert not grouped_attention.compact_tree_mask([None], cpu)
    monkeypatch.setattr(split_attention, "HAS_TRITON", False)
    assert grouped_attention.layout(gpu) == "gqa" and not grouped_attention.compact_tree_mask([None], gpu)
    monkeypatch.setattr(split_attention, "HAS_TRITON", True)
    for named in ("gqa", "folded", "matmul", "split", "off"):
        monkeypatch.setenv("PPD_GROUPED_SDPA", named)
        assert grouped_attention.layout(gpu) == grouped_attention.layout(cpu) == named
    monkeypatch.setenv("PPD_GROUPED_SDPA", "gqa")
    assert not grouped_attention.compact_tree_mask([None], gpu)
