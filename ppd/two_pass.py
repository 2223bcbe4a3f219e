"""The training forward in two passes: the real tokens once without gradients, then the prompt rows alone.

In a packed forward (``attention.packed_layout``) the real tokens never see a prompt row, and the deep prompt
tokens change prompt rows only, so nothing trainable reaches a real token: its hidden states, keys and values are
constants of the step. One forward over ``[real tokens, prompt rows]`` with gradients still records every real
token in the graph, and its backward runs over all of them, though each gradient it computes there only feeds
keys and values that need none; the real tokens are most of a step's rows (a conversation of hundreds to
thousands of tokens against 3 rows for each of its cuts).

So here the first pass runs the base model over each row's tokens without gradients, causally, keeping every
layer's keys and values (:class:`PrefixCache`); the second runs the prompt rows alone with gradients, each
attending to those keys and values as the packed layout lets it (its real tokens before its cut, its own block)
and to its block's new rows. Its logits, and so the losses and gradients, are those of the one-pass forward
(tested on three architectures with sliding windows, ensembles and deep tokens), and its backward runs over the
prompt rows alone.
"""

from __future__ import annotations

import contextlib

import torch
from transformers.cache_utils import Cache

from .attention import prompt_rows_layout, to_additive, within_window
from .decoding.attention_switch import switched
from .decoding.support import text_config
from .deep_prompts import prompt_row_index
from .prefill import PrefillPlan, average_copies, prompt_embeddings

CAUSAL = "ppd_causal_sdpa"  # the attention implementation the first pass switches to (:func:`causal_sdpa`)


class PrefixCache(Cache):
    """``past_key_values`` of both passes. While ``recording``, each layer's keys and values are kept and returned
    as they are; after it, each layer returns its kept ones followed by the new rows' (for attention only: the
    cache itself is not extended)."""

    def __init__(self, num_layers: int):
        super().__init__(layers=[])
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.recording = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        part = self.layer(layer_idx)
        found = part.update(key_states, value_states, layer_idx)
        self.keep(layer_idx, part)
        return found

    def get_seq_length(self, layer_idx: int = 0) -> int:
        kept = self.keys[layer_idx]
        return 0 if self.recording or kept is None else kept.shape[2]

    def layer(self, index: int) -> "LayerPart":
        """Layer ``index``'s part, for a layer compiled once for all layers: its ``update`` does not read the layer
        index, on which a compiled layer would otherwise be specialised (a graph per layer). What a recording part
        receives is kept by :meth:`keep`."""
        return LayerPart() if self.recording else LayerPart(self.keys[index], self.values[index])

    def keep(self, index: int, part: "LayerPart") -> None:
        if self.recording:
            self.keys[index], self.values[index] = part.keys, part.values


class LayerPart(Cache):
    """One layer's part of a :class:`PrefixCache` (:meth:`PrefixCache.layer`): without keys it records the layer's
    (first pass), with them it returns them followed by the new rows'."""

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None):
        super().__init__(layers=[])
        self.keys, self.values = keys, values

    @property
    def recording(self) -> bool:
        return self.keys is None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.keys is None:
            self.keys, self.values = key_states, value_states
            return key_states, value_states
        return torch.cat([self.keys, key_states], dim=2), torch.cat([self.values, value_states], dim=2)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.keys is None else self.keys.shape[2]


def layer_parts(index: int, kwargs: dict) -> dict[str, LayerPart]:
    """Layer ``index``'s parts of the :class:`PrefixCache` among a decoder layer's keyword arguments, by keyword."""
    return {key: value.layer(index) for key, value in kwargs.items() if isinstance(value, PrefixCache)}


def keep_parts(index: int, kwargs: dict, parts: dict[str, LayerPart]) -> None:
    """After the layer ran: what its recording parts received, kept in the caches they came from."""
    for key, part in parts.items():
        kwargs[key].keep(index, part)


def causal_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' own SDPA attention told to be causal instead of reading ``attention_mask``: the first pass's
    rows see exactly what its causal mask lets them see, and the kernel skips the blocks above the diagonal."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, None, **{**kwargs, "is_causal": True})


def first_pass_attention(lm):
    """The context of the first pass: :func:`causal_sdpa` where the model runs transformers' SDPA attention and no
    sliding window (a window needs the mask), else the model's own attention over the mask."""
    config = lm.body.config
    if text_config(config)._attn_implementation != "sdpa" or any(lm.layers.kinds.values()):
        return contextlib.nullcontext()
    return switched(config, CAUSAL, causal_sdpa)


def two_pass_logits(lm, hooks, deep, plan: PrefillPlan, table: torch.Tensor, num_prompt_tokens: int,
                    num_ensemble: int, attention_type) -> torch.Tensor:
    """The logits [C, N, vocab] (float32, copies averaged) of every cut's prompt rows, as
    ``PromptTokenModel.plan_logits`` computes them in one pass, by device work alone.

    ``lm``: the model's pieces (``decoding.step.LanguageModel``); ``hooks`` and ``deep``: the deep prompt tokens'
    :class:`~ppd.deep_prompts.LayerOffsets` and what they add (None, None for plain tokens); ``table``: the prompt
    rows [N * V, hidden] (gradients flow into it)."""
    n_rows = num_prompt_tokens * num_ensemble
    batch, width = plan.ids.shape
    device = plan.ids.device
    embed = lm.embed(plan.ids)
    dtype = embed.dtype
    kinds = lm.layers.kinds
    slot = torch.arange(width, device=device)
    real_positions = torch.where(slot[None, :] < plan.lengths[:, None], slot[None, :], 0)  # [B, Q]

    # First pass: every row's slots causally (its real tokens see what they see in the packed layout, at the same
    # positions; the slots past them hold token 0 and see only slots before them, so they stay finite and nothing
    # below reads them).
    causal = slot[:, None] >= slot[None, :]
    first = {kind: to_additive((causal if window is None else causal & within_window(slot, slot, window)
                                )[None, None], dtype) for kind, window in kinds.items()}  # [1, 1, Q, Q]: rows alike
    cache = PrefixCache(len(lm.layers.layer_types))
    if hooks is not None:
        hooks.set(None, None)
    with torch.no_grad(), first_pass_attention(lm):
        lm.body(inputs_embeds=embed, attention_mask=lm.layers.pack(first), position_ids=real_positions,
                use_cache=True, **{lm.cache_key: cache})
    cache.recording = False

    # Second pass: prompt row j of batch row b is the packed layout's slot L_b + j; its keys are the first pass's
    # slots (its real tokens before its cut) and the new rows (its own block), as the layout allows.
    second_allowed, query_positions = prompt_rows_layout(plan.lengths, plan.cuts, plan.counts, width,
                                                         num_prompt_tokens, num_ensemble, attention_type)
    rows = second_allowed.shape[1]
    row = torch.arange(rows, device=device)[None, :].expand(batch, -1)  # [B, P]
    valid = row < plan.counts[:, None] * n_rows
    key_positions = torch.cat([slot[None].expand(batch, -1), query_positions], dim=1)
    second = {kind: to_additive((second_allowed if window is None else
                                 second_allowed & within_window(query_positions, key_positions, window))[:, None],
                                dtype) for kind, window in kinds.items()}
    prompt_rows = prompt_row_index(valid, row % n_rows)
    embeds = prompt_embeddings(prompt_rows, table, dtype)  # [B, P, hidden]
    if hooks is not None:
        hooks.set(prompt_rows, deep)
    hidden = lm.body(inputs_embeds=embeds, attention_mask=lm.layers.pack(second), position_ids=query_positions,
                     use_cache=True, **{lm.cache_key: cache}).last_hidden_state

    # Each cut's block: the plan's kept slot of its first prompt row, less its row's length.
    row = plan.cut_rows
    start = plan.keep[plan.where[:, 1]] - plan.lengths[row]
    picked = hidden[row[:, None], start[:, None] + torch.arange(n_rows, device=device)[None, :]]  # [C, N*V, hidden]
    return average_copies(lm.logits(picked), num_prompt_tokens, num_ensemble)
