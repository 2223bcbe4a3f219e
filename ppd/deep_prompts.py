"""Deep prompt tokens: a learned offset added to each prompt token's hidden state after every decoder layer.

Plain prompt tokens are N * V input embeddings; whatever a prompt token's hidden state becomes further up,
the frozen layers make of it. A deep adapter also learns ``offsets`` [layers, N * V, hidden]: after decoder
layer l, row r of the prompt table has ``offsets[l, r]`` added to its hidden state (the idea of deep prompt
tuning, applied to PPD's appended prompt tokens). Real tokens are never touched, so the base model's own
rows, and therefore lossless decoding, are unchanged.

The offsets enter through forward hooks on the model's decoder layers (no copy of the model's code), installed
once per model (a training model whose layers are compiled adds them inside each compiled layer instead,
:func:`add_to_output`, and the hooks stand aside while gradients are on). A hook reads which rows of the current
forward are prompt rows from a :class:`LayerOffsets` object's ``rows`` ([B, Q] long: prompt-table row + 1, 0 for
a real token) and the offsets from its ``layers`` (the table cut per layer), both set before the forward and
cleared after it (training with gradient checkpointing keeps them until the backward has recomputed the forward).
A decoding step sets them inside the compiled or captured step from its own inputs, so the offsets are part of
the graph and a new decoder with other prompt tokens compiles nothing again.

With ``map_rank`` r > 0 each prompt-table row also has a low-rank map of its hidden state, per layer: after
layer l, row r's hidden state h gains ``(h @ down[l])[block r] @ up[l][block r]`` (``down`` [layers, hidden,
N * V * r], ``up`` [layers, N * V * r, hidden], block r the r columns of that row). The offsets move every
prompt row the same way whatever it read; the maps let the change depend on what the row has gathered from
the real tokens so far. A real token's block selector is all zeros, so its hidden state gains an exact zero.

A decoder may also carry the maps *merged* (:func:`merge_maps`, chosen by ``$PPD_DEEP_MAPS``): each table row's
``down`` block times its ``up`` block, one [hidden, hidden] matrix per row, side by side in ``merged`` [layers,
hidden, N * V * hidden]. A layer then makes one matrix product over every row of the forward and each prompt row
picks its own block of the result; a real token picks nothing, an exact zero as before. That is hidden / (2 r) times
the low-rank products' arithmetic but one library product a layer instead of two and the selection between them,
which is what a tree step on a GPU pays for (a few hundred rows; each kernel costs a few microseconds however little
it does). Prefills, whose rows are the prompt's tokens (thousands in a long or batched one), keep the products.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from .config import env_choice
from .prompt_tokens import MAP_NAMES, OFFSETS_NAME


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


@dataclass
class DeepWeights:
    """What the hooks add, in the dtype of the forward (row 0 of ``offsets`` and of ``select``: a real token)."""

    offsets: torch.Tensor  # [layers, 1 + N * V, hidden]
    down: torch.Tensor | None = None  # [layers, hidden, N * V * r]: low-rank maps (None: offsets only)
    up: torch.Tensor | None = None  # [layers, N * V * r, hidden]
    select: torch.Tensor | None = None  # [1 + N * V, N * V * r]: ones on each row's own r columns
    merged: torch.Tensor | None = None  # [layers, hidden, N * V * hidden]: the maps merged, for tree steps


class LayerOffsets:
    """Hooks that add ``table`` (:class:`DeepWeights`, from :func:`deep_weights`) to decoder layer l's output at
    the prompt rows while ``rows`` is set. Installed once per model (:func:`layer_offsets`) and inert until told:
    a compiled step guards on the hooks, so they never change; the weights and rows are what each forward
    brings."""

    def __init__(self, model):
        self.rows: torch.Tensor | None = None
        self.selected: torch.Tensor | None = None
        self.layers: list[tuple] | None = None  # per layer: its offsets, maps and merged maps (views of the table)
        # Set by ``PromptTokenModel.compile_base``: with gradients on, the compiled layers add the offsets
        # themselves (:func:`add_to_output`), inside their graph, and the hooks stand aside.
        self.in_compiled_layers = False
        self.handles = [layer.register_forward_hook(self._hook(i)) for i, layer in enumerate(decoder_layers(model))]
        self.num_layers = len(self.handles)

    def _hook(self, index: int):
        def add(module, args, output):
            if self.rows is None or (self.in_compiled_layers and torch.is_grad_enabled()):
                return output
            hidden = output[0] if isinstance(output, tuple) else output
            if self.rows.shape != hidden.shape[:2]:
                told, seen = list(self.rows.shape), list(hidden.shape[:2])
                raise RuntimeError(f"deep prompt tokens were told about the prompt rows of a {told} forward during "
                                   f"a {seen} one: set LayerOffsets.rows before each forward (None where it has "
                                   "no prompt rows)")
            return add_to_output(output, self.layer_inputs(index))
        return add

    def layer_inputs(self, index: int) -> tuple:
        """What layer ``index`` adds, as tensors (:func:`add_to_output`'s ``inputs``): the rows, the layer's
        offsets, then either its low-rank maps with each row's block selector or its merged maps, as :meth:`set`
        chose (the others None; all four None for a table of offsets only)."""
        offsets, down, up, merged = self.layers[index]
        return self.rows, offsets, down, up, self.selected, merged

    def set(self, rows: torch.Tensor | None, table: DeepWeights | None, merged: bool = False) -> None:
        """What the next forward adds: ``table`` at ``rows`` (None, None: nothing), its maps through its merged
        matrices where ``merged`` and it has them, else through the low-rank products."""
        self.rows = rows
        if table is None:
            self.selected = self.layers = None
            return
        merged = merged and table.merged is not None
        # Each row's block selector for the maps, looked up once for every layer of the forward.
        self.selected = None if rows is None or table.down is None or merged else table.select[rows]
        # Each layer's slice of the tables, cut once a forward by unbinding them: the backward then stacks every
        # layer's gradient in one operation, where indexing each layer's slice made a zero tensor the size of the
        # whole table for every layer and table and added them up (90 table-sized writes and additions a
        # training step for the default model, whatever its batch).
        maps = (None, None, table.merged) if merged else (table.down, table.up, None)
        self.layers = list(zip(*([None] * self.num_layers if t is None else t.unbind(0)
                                 for t in (table.offsets, *maps))))


def add_to_output(output, inputs: tuple):
    """A decoder layer's ``output`` (its hidden states, or a tuple that starts with them) with the deep prompt
    tokens' change added at the prompt rows; ``inputs`` from :meth:`LayerOffsets.layer_inputs`."""
    rows, offsets, down, up, selected, merged = inputs
    hidden = output[0] if isinstance(output, tuple) else output
    dtype = hidden.dtype
    # A lookup whose gradient skips row 0 (every real token's): an indexing gather's backward adds the gradients
    # of all B x Q rows into the few table rows one duplicate at a time, which took 80 % of a training step's
    # device time (results/train/profile/).
    moved = hidden + nn.functional.embedding(rows, offsets.to(dtype), padding_idx=0)
    if merged is not None:
        width = hidden.shape[-1]
        mapped = (hidden @ merged.to(dtype)).unflatten(-1, (-1, width))  # [B, Q, N * V, hidden]: every row's map
        own = (rows - 1).clamp(min=0)[..., None, None].expand(*rows.shape, 1, width)
        moved = moved + torch.where(rows[..., None] > 0, mapped.gather(-2, own).squeeze(-2), 0)
    elif down is not None:
        moved = moved + ((hidden @ down.to(dtype)) * selected.to(dtype)) @ up.to(dtype)
    return (moved, *output[1:]) if isinstance(output, tuple) else moved


def layer_offsets(model) -> LayerOffsets:
    """The model's :class:`LayerOffsets`, installed on first use and kept (a plain attribute, not a submodule)."""
    hooks = getattr(model, "_ppd_layer_offsets", None)
    if hooks is None:
        hooks = LayerOffsets(model)
        object.__setattr__(model, "_ppd_layer_offsets", hooks)
    return hooks


def hooks_for(model, tokens) -> LayerOffsets | None:
    """The hooks that apply deep ``tokens`` to ``model`` (None for plain prompt tokens), checked against its depth."""
    if not tokens.config.deep:
        return None
    hooks = layer_offsets(model)
    if tokens.offsets is None or tokens.offsets.shape[0] != hooks.num_layers:
        have = "no offsets" if tokens.offsets is None else f"offsets for {tokens.offsets.shape[0]} layers"
        raise ValueError(f"the prompt tokens carry {have}; the model has {hooks.num_layers} decoder layers")
    return hooks


def deep_weights(tokens, dtype: torch.dtype | None = None, detach: bool = False,
                 tensors: dict[str, torch.Tensor] | None = None) -> DeepWeights:
    """The hooks' :class:`DeepWeights` for deep ``tokens``, in ``dtype``: differentiable (training reads its
    parameters through this) unless ``detach`` (the decoder's). ``tensors``: stand-ins for some of the tokens' own
    tensors, by their on-disk names (``PromptTokens.tensors``)."""
    def cast(t: torch.Tensor) -> torch.Tensor:
        t = t.detach() if detach else t
        return t if dtype is None else t.to(dtype)

    found = {**tokens.tensors(), **(tensors or {})}
    offsets = cast(found[OFFSETS_NAME])
    padded = torch.cat([offsets.new_zeros(offsets.shape[0], 1, offsets.shape[2]), offsets], dim=1)
    rank = tokens.config.map_rank
    if not rank:
        return DeepWeights(padded)
    own = torch.eye(tokens.config.num_rows, device=offsets.device, dtype=padded.dtype).repeat_interleave(rank, dim=1)
    select = torch.cat([own.new_zeros(1, own.shape[1]), own])
    return DeepWeights(padded, *(cast(found[name]) for name in MAP_NAMES), select)


MAPS_ENV = "PPD_DEEP_MAPS"  # low_rank | merged | auto: how a decoder's tree steps apply the maps (auto: see below)
# Merged maps are read whole in every layer of every tree step: ``auto`` merges only where a layer's merged matrices
# take at most this many bytes, about what an H200 reads in the 2 us that one kernel launch fewer saves. The default
# model's take 2 MB (hidden 576, 3 prompt-table rows, bf16); a model of hidden 2,048 would take 25 MB a layer, read
# in 5 us, more than the kernels saved, and its step is bound by reading weights rather than by launching kernels.
MERGED_LAYER_BYTES = 8 * 2**20


def merges_maps(device: torch.device, table: DeepWeights) -> bool:
    """Whether a decoder on ``device`` carries ``table``'s maps merged for its tree steps (:func:`merge_maps`), by
    ``$PPD_DEEP_MAPS``; ``auto`` merges them on CUDA devices where a layer's merged matrices take at most
    :data:`MERGED_LAYER_BYTES`. On one H200 (the default model, bf16, the 130-row tree at batch 1, MT-Bench) merged
    maps made a step 2.13 ms against 2.24-2.25 ms with the low-rank products (results/deep_gpu/h200/v12/). On a CPU,
    where a step is bound by its arithmetic rather than by kernel launches, their 18x more multiplications (hidden /
    (2 r) for the shipped tokens) cost: 58.2-60.5 against 56.8-57.4 ms a bf16 step on two Zen 4 cores
    (results/cpu/epyc_merged_maps/)."""
    found = env_choice(MAPS_ENV, ("low_rank", "merged", "auto"), "auto")
    if table.down is None or found == "low_rank":
        return False
    hidden = table.down.shape[1]
    layer_bytes = hidden * hidden * _table_rows(table) * table.down.element_size()
    return found == "merged" or (device.type == "cuda" and layer_bytes <= MERGED_LAYER_BYTES)


def _table_rows(table: DeepWeights) -> int:
    """How many prompt-table rows (N * V) ``table``'s maps have a block for."""
    return table.select.shape[0] - 1


def merge_maps(table: DeepWeights) -> DeepWeights:
    """``table`` with its low-rank maps merged: ``merged[l][:, block t]`` = ``down[l][:, cols t] @ up[l][rows t]``
    for each prompt-table row t, multiplied in float32 a layer at a time and cast back (float32 for one layer
    only: a forced merge of a large model's maps would otherwise hold all of them in float32 at once). A table
    without maps is returned as it is."""
    if table.down is None:
        return table
    layers, hidden, columns = table.down.shape
    count = _table_rows(table)
    merged = table.down.new_empty(layers, hidden, count * hidden)
    for layer in range(layers):
        down = table.down[layer].float().view(hidden, count, columns // count)
        up = table.up[layer].float().view(count, columns // count, hidden)
        merged[layer] = torch.einsum("htr,trk->htk", down, up).reshape(hidden, count * hidden)
    return replace(table, merged=merged)


def prompt_row_index(is_prompt: torch.Tensor, table_row: torch.Tensor) -> torch.Tensor:
    """The ``rows`` of :class:`LayerOffsets`: ``table_row + 1`` where ``is_prompt``, else 0."""
    return torch.where(is_prompt, table_row + 1, 0)
