"""The dense step's attention over the cache's own key heads: no copy of them per query head.

Where a model shares each key head among several query heads (grouped-query attention) and runs PyTorch's
SDPA, transformers' attention function repeats every key and value head once per query head before the
kernel whenever a mask is given, which a ppd step always gives (its float tree mask ``[B, 1, T, W]``): two
tensors of ``B x query heads x W x head size`` written and read again in every layer, every step. This
module's function hands SDPA the unrepeated cache with ``enable_gqa=True`` instead, which cuDNN's attention
(the kernel PyTorch picks for these masked steps on a Hopper GPU) reads as it is. Same keys, values, mask and
scale: the result is the repeated one's up to float summation order.

On one H200 (bf16, `results/deep_gpu/attention_feed.py`, 30 layers of the default model: rotary embedding,
cache write, attention over 512 slots, compiled and captured; another job shared the GPU), per step with the
repeat and without: batch 1, one row 329 us against 251; batch 16, a 64-row tree 1,136 against 803; batch 64,
one row 1,877 against 378.

Used by the dense step (``LanguageModel.stepping``) where the model's own implementation is ``sdpa`` and it
groups its query heads; ``PPD_GROUPED_SDPA=off`` keeps transformers' function (for comparison), and
``PPD_GROUPED_SDPA=folded`` (experimental, not timed end to end yet) lays a step of several rows out as one
query head per key head instead, the group's heads one after another in its rows, with the mask repeated for
them: in the same diagnostic (its rows ordered head within row, the same work), a batch-16 step of 64 rows
took 669 us that way against 803 with ``enable_gqa`` and batch 64 with 17 rows 905 against 1,587, but batch 1
with 64 rows 458 against 415. ``PPD_GROUPED_SDPA=matmul`` (experimental) computes those folded
rows as two batched matrix products around a float32 softmax, for long caches: on the same H200 a 16-row tree
step took 2.4 ms at 1K context and 5.5 ms at 8K at batch 1 (14 ms at batch 16), where one row took 1.4-1.5 ms
at both (2.6 ms at batch 16; `results/deep_gpu/h200/v7/long_context_dense.json`), as if the attention kernel
walked the whole cache in one block per head and row tile; a matrix product spreads over the cache's width
instead. ``PPD_GROUPED_SDPA=split`` runs a tree step's attention through ppd's Triton kernel over pieces of the cache
(:mod:`ppd.decoding.split_attention`), handing it the tree's own mask and the rows' lengths where no layer has a
sliding window (``PPD_SPLIT_MASK=width``: a mask over the whole width; :func:`split_mask`); one row keeps SDPA.
``auto`` (the default) is ``split`` on a CUDA GPU with Triton and SDPA with ``enable_gqa`` elsewhere (``gqa``
asks for the latter everywhere). On one H200 (bf16, the default model and its 16- and 64-row trees, 300 tokens
of context, compiled and captured steps, two leases, `results/deep_gpu/h200/v18/`) a 16-row tree step took
1.88 ms through the kernel against 2.03 ms through cuDNN's at batch 1 and 2.49 against 2.86 ms at batch 16
(64 rows: 1.98 against 2.09, 3.13 against 3.45); at 8K the kernel is what made trees pay at all. Anything this
function does not handle itself (no mask, attention dropout, soft-capping, attention sinks, equal head counts) goes
to transformers' own SDPA function unchanged.
"""

from __future__ import annotations

import os

import torch

from ..attention import to_additive
from . import attention_switch, split_attention

NAME = "ppd_grouped_sdpa"  # the attention implementations this module registers with transformers
FOLDED_NAME = "ppd_grouped_sdpa_folded"
MATMUL_NAME = "ppd_grouped_matmul"
SPLIT_NAME = "ppd_grouped_split"
LENGTHS_KEYWORD = "ppd_lengths"  # the model keyword a split tree step passes its rows' cache lengths under

MODES = ("auto", "off", "gqa", "folded", "matmul", "split")
SPLIT_MASKS = ("width", "tree")


def mode() -> str:
    """``PPD_GROUPED_SDPA``: ``auto`` (the default), ``off``, ``gqa``, ``folded``, ``matmul`` or ``split`` (see the
    module docstring)."""
    found = os.environ.get("PPD_GROUPED_SDPA", "auto")
    if found not in MODES:
        raise ValueError(f"PPD_GROUPED_SDPA must be one of {', '.join(MODES)}, got {found!r}")
    return found


def layout(device: torch.device) -> str:
    """How a dense tree step on ``device`` computes its attention: ``PPD_GROUPED_SDPA`` where it names a layout;
    for ``auto``, ``split`` on a CUDA GPU where Triton is installed (measured faster at every batch size and
    context timed, see the module docstring) and ``gqa`` (SDPA with ``enable_gqa``) elsewhere; ``off`` for
    transformers' own function."""
    chosen = mode()
    if chosen == "auto":
        return "split" if device.type == "cuda" and split_attention.HAS_TRITON else "gqa"
    return chosen


def enabled() -> bool:
    """Whether ``PPD_GROUPED_SDPA`` lets dense steps use this function."""
    return mode() != "off"


def _own_sdpa():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS["sdpa"]


def grouped_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                 dropout: float = 0.0, scaling: float | None = None, layout: str = "gqa",
                 **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: query [B, Hq, T, D], key and value [B, Hkv, W, D] with
    Hkv dividing Hq, a float or bool mask [B, 1 or Hq, T, W]; returns [B, T, Hq, Dv]. ``layout`` says how a
    step of several rows is computed: SDPA with ``enable_gqa`` (``gqa``), SDPA with
    the query heads folded into rows of their key head (``folded``), those folded rows as two batched
    matrix products around a float32 softmax (``matmul``), or ppd's kernel that cuts the cache into pieces
    (``split``, :mod:`ppd.decoding.split_attention`; where it cannot run, a mask per query head or no GPU, the
    ``gqa`` way). One row always runs the ``gqa`` way.

    A tree step whose keyword ``ppd_lengths`` [B] is given (``tree_decoding`` under the ``split`` layout) hands
    the tree's own mask [B, 1, T, T] instead of the whole width's: only the split kernel reads that, and any other
    path refuses it."""
    lengths = kwargs.pop(LENGTHS_KEYWORD, None)
    batch, heads, rows, dim = query.shape
    # What this function computes itself (a mask tensor, no dropout, soft-capping or sinks); the rest, and equal
    # head counts outside the split kernel, go to transformers' SDPA.
    handled = (isinstance(attention_mask, torch.Tensor) and not dropout and not kwargs.get("softcap")
               and kwargs.get("s_aux") is None)
    splits = (layout == "split" and handled and rows > 1 and attention_mask.shape[1] == 1 and value.shape[-1] == dim
              and query.dtype == key.dtype == value.dtype and split_attention.runs_on(query))
    if lengths is not None and not splits:
        raise RuntimeError("a tree step's own mask (with its rows' lengths) reached an attention path other than the "
                           "split kernel, which alone reads it; set PPD_GROUPED_SDPA=gqa for this model")
    if splits:
        mask = attention_mask
        if mask.dtype == torch.bool:
            mask = to_additive(mask, query.dtype)
        out = split_attention.split_attention(query, key, value, mask, dim ** -0.5 if scaling is None else scaling,
                                              lengths=lengths)
        return out.transpose(1, 2).contiguous(), None
    if not handled or query.shape[1] == key.shape[1]:
        return _own_sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if rows == 1 or layout in ("gqa", "split"):
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    key_heads = key.shape[1]
    group = heads // key_heads
    # Row j * T + t of key head k is row t of query head k * group + j.
    folded = query.reshape(batch, key_heads, group * rows, dim)
    if layout == "folded":
        mask = attention_mask.repeat(1, 1, group, 1) if attention_mask.shape[1] == 1 else \
            attention_mask.reshape(batch, key_heads, group * rows, -1)
        out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    else:
        out = _matmul_attention(folded, key, value, attention_mask, group, dim ** -0.5 if scaling is None else scaling)
    return out.reshape(batch, heads, rows, -1).transpose(1, 2).contiguous(), None


def _matmul_attention(folded: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, group: int,
                      scale: float) -> torch.Tensor:
    """Attention of the folded rows [B, Hkv, G*T, D] over key and value [B, Hkv, W, D] as two batched matrix
    products: each key head's cache read once for all its query heads, and the products spread over the
    cache's width like any matrix product (a flash kernel with few rows runs one block per head and row tile,
    however long the cache). Scores and softmax in float32; ``mask`` [B, 1 or G*Hkv, T, W], float or bool."""
    batch, key_heads, folded_rows, dim = folded.shape
    rows, width = folded_rows // group, key.shape[2]
    queries = folded.reshape(batch * key_heads, folded_rows, dim)
    keys = key.reshape(batch * key_heads, width, dim).transpose(1, 2)
    # Scores kept in float32: rounded to half precision, a score of 20 may move by 0.1, its weight by 10%.
    if folded.is_cuda and folded.dtype in (torch.float16, torch.bfloat16):
        scores = torch.bmm(queries, keys, out_dtype=torch.float32)
    else:
        scores = torch.bmm(queries.float(), keys.float())
    scores = scores.view(batch, key_heads, group, rows, width) * scale
    if mask.dtype == torch.bool:
        mask = to_additive(mask, scores.dtype)
    mask = mask[:, :, None] if mask.shape[1] == 1 else mask.view(batch, key_heads, group, rows, width)
    weights = torch.softmax(scores + mask.to(scores.dtype), dim=-1).to(value.dtype)
    out = torch.bmm(weights.view(batch * key_heads, folded_rows, width), value.reshape(batch * key_heads, width, -1))
    return out.view(batch, key_heads, folded_rows, -1)


def split_sdpa(*args, **kwargs) -> tuple[torch.Tensor, None]:
    """:func:`grouped_sdpa` with ppd's split kernel (``PPD_GROUPED_SDPA=split``), registered under a name of its
    own."""
    return grouped_sdpa(*args, layout="split", **kwargs)


def folded_sdpa(*args, **kwargs) -> tuple[torch.Tensor, None]:
    """:func:`grouped_sdpa` with the folded layout (``PPD_GROUPED_SDPA=folded``), registered under a name of its
    own so that the choice is made once per step on the host, never inside a compiled forward."""
    return grouped_sdpa(*args, layout="folded", **kwargs)


def matmul_sdpa(*args, **kwargs) -> tuple[torch.Tensor, None]:
    """:func:`grouped_sdpa` with the folded rows as matrix products (``PPD_GROUPED_SDPA=matmul``), registered
    under a name of its own."""
    return grouped_sdpa(*args, layout="matmul", **kwargs)


def active(model_config, device: torch.device):
    """Within this block, the model's attention layers run :func:`grouped_sdpa` (or :func:`folded_sdpa`,
    :func:`matmul_sdpa` or :func:`split_sdpa`, as :func:`layout` says for ``device``); the model's own implementation
    comes back afterwards, whatever happens inside."""
    functions = {"folded": (FOLDED_NAME, folded_sdpa), "matmul": (MATMUL_NAME, matmul_sdpa),
                 "split": (SPLIT_NAME, split_sdpa)}
    return attention_switch.switched(model_config, *functions.get(layout(torch.device(device)), (NAME, grouped_sdpa)))


def split_mask() -> str:
    """``PPD_SPLIT_MASK``: what mask a tree step hands the split kernel, ``tree`` (the default: the tree's own
    ``[B, 1, T, T]`` with the rows' lengths, O(T^2 B) memory) or ``width`` (``[B, 1, T, W]`` over the cache's whole
    width). On an H200 at 8K context a 128-row tree step took 2.30 ms with the tree's own mask against 2.44 ms
    with the width's (median passes, `results/deep_gpu/h200/v15/`)."""
    found = os.environ.get("PPD_SPLIT_MASK", "tree")
    if found not in SPLIT_MASKS:
        raise ValueError(f"PPD_SPLIT_MASK must be one of {', '.join(SPLIT_MASKS)}, got {found!r}")
    return found


def compact_tree_mask(windows, device: torch.device) -> bool:
    """Whether a dense tree step of a model this module :func:`applies` to hands the split kernel its tree's own
    mask and its rows' lengths (:data:`LENGTHS_KEYWORD`) instead of a mask over the cache's whole width: its
    :func:`layout` on ``device`` is ``split``, ``PPD_SPLIT_MASK=tree`` (the default), no layer has a sliding window,
    and the kernel runs on ``device``."""
    device = torch.device(device)
    return (layout(device) == "split" and split_mask() == "tree" and all(w is None for w in windows)
            and split_attention.runs_on_device(device))


def applies(model_config, query_group: int) -> bool:
    """Whether a dense step of this model runs :func:`grouped_sdpa`: its query heads are grouped, its own
    attention (and every sub-config's) is ``sdpa``, and ``PPD_GROUPED_SDPA`` allows it."""
    return (query_group > 1 and enabled()
            and all(c._attn_implementation == "sdpa" for c in attention_switch.configs_of(model_config)))


__all__ = ["FOLDED_NAME", "LENGTHS_KEYWORD", "MATMUL_NAME", "MODES", "NAME", "SPLIT_MASKS", "SPLIT_NAME", "active",
           "applies", "compact_tree_mask", "enabled", "folded_sdpa", "grouped_sdpa", "layout", "matmul_sdpa", "mode",
           "split_mask", "split_sdpa"]
