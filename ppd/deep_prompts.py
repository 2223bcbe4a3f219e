"""Deep prompt tokens: a learned offset added to each prompt token's hidden state after every decoder layer.

Plain prompt tokens are N * V input embeddings; whatever a prompt token's hidden state becomes further up,
the frozen layers make of it. A deep adapter also learns ``offsets`` [layers, N * V, hidden]: after decoder
layer l, row r of the prompt table has ``offsets[l, r]`` added to its hidden state (the idea of deep prompt
tuning, applied to PPD's appended prompt tokens). Real tokens are never touched, so the base model's own
rows, and therefore lossless decoding, are unchanged.

The offsets enter through forward hooks on the model's decoder layers (no copy of the model's code). A hook
reads which rows of the current forward are prompt rows from a :class:`LayerOffsets` object's ``rows``
([B, Q] long: prompt-table row + 1, 0 for a real token), set before the forward and cleared after it (training
with gradient checkpointing keeps it until the backward has recomputed the forward). A decoding step sets it
inside the compiled or captured step, so the offsets are part of the graph.
"""

from __future__ import annotations

import torch
from torch import nn


def decoder_layers(model) -> nn.ModuleList:
    """The decoder layers of a transformers causal LM (or of its base model): the module list under the base
    model that holds ``num_hidden_layers`` modules."""
    body = getattr(model, "base_model", model)
    count = body.config.get_text_config().num_hidden_layers
    found = [m for m in body.modules() if isinstance(m, nn.ModuleList) and len(m) == count]
    if not found:
        raise ValueError(f"{type(model).__name__} has no list of {count} decoder layers: deep prompt tokens "
                         "cannot reach its hidden states")
    return found[0]


class LayerOffsets:
    """Hooks that add ``tokens.offsets[l][rows - 1]`` to decoder layer l's output wherever ``rows > 0``
    (``tokens``: deep :class:`~ppd.prompt_tokens.PromptTokens`, read at each forward, wherever they were moved)."""

    def __init__(self, model, tokens):
        layers = decoder_layers(model)
        if tokens.offsets is None or tokens.offsets.shape[0] != len(layers):
            have = "no offsets" if tokens.offsets is None else f"offsets for {tokens.offsets.shape[0]} layers"
            raise ValueError(f"the prompt tokens carry {have}; the model has {len(layers)} decoder layers")
        self.tokens = tokens
        self.rows: torch.Tensor | None = None
        self.handles = [layer.register_forward_hook(self._hook(i)) for i, layer in enumerate(layers)]

    def _hook(self, index: int):
        def add(module, args, output):
            if self.rows is None:
                return output
            hidden = output[0] if isinstance(output, tuple) else output
            if self.rows.shape != hidden.shape[:2]:
                told, seen = list(self.rows.shape), list(hidden.shape[:2])
                raise RuntimeError(f"deep prompt tokens were told about the prompt rows of a {told} forward during "
                                   f"a {seen} one: set LayerOffsets.rows before each forward (None where it has "
                                   "no prompt rows)")
            table = self.tokens.offsets[index].to(hidden.dtype)
            table = torch.cat([table.new_zeros(1, table.shape[1]), table])  # row 0: a real token, no offset
            hidden = hidden + table[self.rows]
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden
        return add

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def attach_offsets(model, tokens) -> LayerOffsets | None:
    """Hook ``tokens``' offsets into ``model``'s layers (None for plain prompt tokens), first removing the hooks
    of prompt tokens attached earlier: a model serves one set of prompt tokens at a time, and stale hooks would
    add their offsets to forwards that are not theirs."""
    earlier = getattr(model, "_ppd_layer_offsets", None)
    if earlier is not None and earlier.tokens is tokens and earlier.handles:
        return earlier  # the same prompt tokens (a decoder and a replay of its adapter): one set of hooks
    if earlier is not None:
        earlier.remove()
    hooks = LayerOffsets(model, tokens) if tokens.config.deep else None
    object.__setattr__(model, "_ppd_layer_offsets", hooks)  # a plain attribute, not a submodule
    return hooks


def prompt_row_index(is_prompt: torch.Tensor, table_row: torch.Tensor) -> torch.Tensor:
    """The ``rows`` of :class:`LayerOffsets`: ``table_row + 1`` where ``is_prompt``, else 0."""
    return torch.where(is_prompt, table_row + 1, 0)
