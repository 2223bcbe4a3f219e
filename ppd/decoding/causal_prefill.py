"""A decoder's prefill as plain causal attention, with no ``[B, 1, Q, Q]`` mask.

A decoder's prefill lays each row out as its real tokens, then its block of prompt rows, then padding
(``attention.prefill_layout``). Where each prompt row sees the prompt rows at or before its own slot (one copy of
the prompt tokens, or the ``decoder`` attention type: ``attention.causal_prompt_rows``), every real token and prompt
row is allowed exactly the keys of causal attention over the slots: the prefix before it. Only padding differs (it
sees only itself in the layout), and nothing reads a padding slot's output or its cache slot. So the prefill can
run SDPA's causal kernel with no mask at all, instead of a dense float mask that is ``B x Q x Q`` elements (2 GB
for 16 prompts of 8K tokens in bf16, read by every layer) and a memory-efficient kernel that cannot skip the keys
past the diagonal.

The model is handed a zero view of the mask's shape that takes no memory (transformers passes a 4D mask through
unchanged), and its attention layers run :func:`causal_sdpa`, which calls transformers' own SDPA function without
a mask, as it does for an unpadded causal forward. Used for eager prefills (the ones too wide to replay from a CUDA
graph, and every prefill on a CPU) where the model runs ``sdpa`` and no layer has a sliding window;
``PPD_CAUSAL_PREFILL=off`` keeps the masked prefill, for comparison.
"""

from __future__ import annotations

from ..attention import LayerAttention, causal_prompt_rows
from ..config import AttentionType, env_choice
from . import attention_switch
from .grouped_attention import _own_sdpa

NAME = "ppd_causal_prefill"  # the attention implementation this module registers with transformers
ENV = "PPD_CAUSAL_PREFILL"  # on (the default) | off


def applies(model_config, num_prompt_tokens: int, num_ensemble: int, attention_type: AttentionType | str) -> bool:
    """Whether a decoder's prefill of this model, with these prompt rows, runs as plain causal attention: the
    model's own attention (and every sub-config's) is ``sdpa``, no layer has a sliding window, the prompt rows'
    block mask is causal, and ``$PPD_CAUSAL_PREFILL`` is not ``off``."""
    return (env_choice(ENV, ("on", "off"), "on") == "on"
            and all(c._attn_implementation == "sdpa" for c in attention_switch.configs_of(model_config))
            and LayerAttention.of(model_config).window is None
            and causal_prompt_rows(num_prompt_tokens, num_ensemble, attention_type))


def causal_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention-function interface: its SDPA function with no mask (so causal), whatever
    ``attention_mask`` holds (the prefill's unread zero view). The keys are the prefill's own slots, as many
    as its queries."""
    if key.shape[2] != query.shape[2]:
        raise RuntimeError(f"a causal prefill attends its own {query.shape[2]} slots, but the cache handed "
                           f"{key.shape[2]} keys")
    return _own_sdpa()(module, query, key, value, None, **kwargs)


def switched(model_config):
    """The block in which the model's attention layers run :func:`causal_sdpa`."""
    return attention_switch.switched(model_config, NAME, causal_sdpa)


__all__ = ["ENV", "NAME", "applies", "causal_sdpa", "switched"]
