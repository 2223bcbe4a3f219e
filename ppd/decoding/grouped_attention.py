"""The dense step's attention over the cache's own key heads: no copy of them per query head.

Where a model shares each key head among several query heads (grouped-query attention) and runs PyTorch's
SDPA, transformers' attention function repeats every key and value head once per query head before the
kernel whenever a mask is given, which a ppd step always gives (its float tree mask ``[B, 1, T, W]``): two
tensors of ``B x query heads x W x head size`` written and read again in every layer, every step. This
module's function hands SDPA the unrepeated cache with ``enable_gqa=True`` instead, which cuDNN's attention
(the kernel PyTorch picks for these masked steps on a Hopper GPU) reads as it is. Same keys, values, mask and
scale: the result is the repeated one's up to float summation order.

On one H200 (bf16, `results/deep_gpu/attention_feed.py`, 30 layers of the default model: rotary embedding,
cache write, attention over 512 slots, compiled and captured), the repeat cost per step: batch 1, one row
329 us against 251; batch 16, a 64-row tree 1,136 against 803; batch 64, one row 1,877 against 378.

Used by the dense step (``LanguageModel.stepping``) where the model's own implementation is ``sdpa`` and it
groups its query heads; ``PPD_GROUPED_SDPA=off`` keeps transformers' function (for comparison). Anything
this function does not handle itself (no mask, attention dropout, soft-capping, attention sinks, equal head
counts) goes to transformers' own SDPA function unchanged.
"""

from __future__ import annotations

import os

import torch

from . import attention_switch

NAME = "ppd_grouped_sdpa"  # the attention implementation this module registers with transformers


def enabled() -> bool:
    """Whether ``PPD_GROUPED_SDPA`` (``auto``, the default, or ``off``) lets dense steps use this function."""
    mode = os.environ.get("PPD_GROUPED_SDPA", "auto")
    if mode not in ("auto", "off"):
        raise ValueError(f"PPD_GROUPED_SDPA must be auto or off, got {mode!r}")
    return mode == "auto"


def _own_sdpa():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS["sdpa"]


def grouped_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                 dropout: float = 0.0, scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: query [B, Hq, T, D], key and value [B, Hkv, W, D] with
    Hkv dividing Hq, a float or bool mask [B, 1, T, W]; returns [B, T, Hq, Dv]."""
    if (not isinstance(attention_mask, torch.Tensor) or dropout or kwargs.get("softcap")
            or kwargs.get("s_aux") is not None or query.shape[1] == key.shape[1]):
        return _own_sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def active(model_config):
    """Within this block, the model's attention layers run :func:`grouped_sdpa`; the model's own
    implementation comes back afterwards, whatever happens inside."""
    return attention_switch.switched(model_config, NAME, grouped_sdpa)


def applies(model_config, query_group: int) -> bool:
    """Whether a dense step of this model runs :func:`grouped_sdpa`: its query heads are grouped, its own
    attention (and every sub-config's) is ``sdpa``, and ``PPD_GROUPED_SDPA`` allows it."""
    return (query_group > 1 and enabled()
            and all(c._attn_implementation == "sdpa" for c in attention_switch.configs_of(model_config)))


__all__ = ["NAME", "active", "applies", "enabled", "grouped_sdpa"]
