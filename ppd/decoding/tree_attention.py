"""Tree attention whose cost does not grow with the cache: FlexAttention over a block mask built from lengths.

The dense step (``ppd.attention.step_mask``) hands the model a float mask ``[B, 1, T, W]`` over the whole
attention width W, which every layer reads and which grows with the context. Here the model's attention layers instead run PyTorch's FlexAttention with
a :class:`~torch.nn.attention.flex_attention.BlockMask` made from each row's cache length:

- the committed prefix ``[0, L_b)`` that every tree row sees is described by *full* key blocks, which the
  kernel reads without evaluating any mask;
- only the few blocks that hold the tree itself (and, for a sliding-window layer, the blocks at the
  window's edge) are *partial*: there the kernel asks :func:`tree_block_mask`'s ``mask_mod``, which reads
  the tree's own ``[B, T, T]`` visibility;
- blocks past ``L_b + T`` are not listed at all, so a step over a wide cache reads only what it needs.

The tables are computed arithmetically from the lengths: a row of full and a row of partial block indices
per batch row, ``[B, W / 128]`` each (one int per 128 cache slots, as a paged cache's block table; the
kernels want rows as long as the key blocks, of which at most ``2 (ceil(T / 128) + 1)`` are partial), and
the tree's ``[B, T, T]`` visibility: O(T^2 B + W B / 128) in all, where a dense mask is O(T W B). The
result is the dense step's, exactly up to float summation order: the same keys, the same positions (a
prefix slot s sits at position s), the same windows.

The query heads that share a key head are folded into the query rows (row ``t * group + j``), so the kernel
sees one query head per key head and reads each key once for all of them. FlexAttention would group the
heads itself only for power-of-two ratios; for others (the default model has 9 query heads over 3 key heads)
it falls back to a kernel that runs one program per query head over the whole prefix, which was measured
3.6x slower per step at 8K context on an H100 (``results/long_context``).

The model's attention layers pick their function by ``config._attn_implementation``, so a step runs inside
:func:`active`, which names this module's function (registered with transformers' ``AttentionInterface``
as :data:`NAME`) for the duration of the call and then restores the model's own choice. Prefill and
everything else keep the model's own attention.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ..attention import within_window

NAME = "ppd_tree_flex"  # the attention implementation this module registers with transformers
BLOCK = 128  # FlexAttention's sparse block size, in query rows and in key slots


def _ceil_div(a, b):
    return -(-a // b)


def tree_block_mask(tree_allowed: torch.Tensor, lengths: torch.Tensor, offsets: torch.Tensor, width: int,
                    window: int | None = None, group: int = 1) -> BlockMask:
    """The :class:`BlockMask` of ``T`` tree rows written at ``[L_b, L_b + T)`` of each row's cache, attending
    over ``width`` slots: every row sees the committed prefix ``[0, L_b)``, the tree rows see each other as
    ``tree_allowed`` (bool [T, T] or [B, T, T]) says, nothing sees past ``L_b + T``. With a sliding
    ``window``, row q at position ``L_b + offsets[b, q]`` sees only keys less than ``window`` positions
    behind it. The same visibility as :func:`ppd.attention.step_mask`, without a ``[T, W]`` tensor.

    ``group`` > 1 lays out the query rows of ``group`` query heads that share a key head one after another:
    query row ``t * group + j`` is tree row t of the group's head j (:func:`tree_attention` folds the heads so,
    which lets FlexAttention run its split-key decoding kernel for any ratio of query to key heads; it runs
    it only for power-of-two ratios when it groups the heads itself)."""
    batch, rows = lengths.shape[0], tree_allowed.shape[-1]
    device = lengths.device
    allowed = tree_allowed.expand(batch, rows, rows)
    offsets = offsets.expand(batch, rows)
    if window is not None:
        allowed = allowed & within_window(offsets, offsets, window)
    kv_blocks, q_blocks = _ceil_div(width, BLOCK), _ceil_div(rows * group, BLOCK)
    # A copy: the step advances the state's lengths in place after its forward, and the mask function
    # (a subgraph of the compiled step) must read the lengths as they were.
    lengths = lengths.clone()
    # Blocks [p0, top) hold every key some row may see; [f0, f1) only keys that every row sees.
    top = _ceil_div(lengths + rows, BLOCK)
    f1 = lengths // BLOCK
    if window is None:
        p0 = f0 = torch.zeros_like(lengths)
    else:
        p0 = (lengths - window + 1).clamp(min=0) // BLOCK  # the root (offset 0) sees furthest back
        f0 = torch.minimum(_ceil_div((lengths + offsets.amax(1) - window + 1).clamp(min=0), BLOCK), f1)
    lead, tail = f0 - p0, top - f1
    # Partial blocks: the window's edge [p0, f0) (none without a window), then the tree's [f1, top).
    slot = torch.arange(kv_blocks, device=device)[None]
    partial = torch.where(slot < lead[:, None], p0[:, None] + slot, f1[:, None] + slot - lead[:, None])
    full = f0[:, None] + slot

    def per_q_block(table: torch.Tensor) -> torch.Tensor:  # [B, n] -> [B, 1, q blocks, n], int32
        return table.clamp(0, kv_blocks - 1).to(torch.int32)[:, None, None, :].expand(-1, 1, q_blocks, -1)

    def counts(count: torch.Tensor) -> torch.Tensor:  # [B] -> [B, 1, q blocks]
        return count.to(torch.int32)[:, None, None].expand(-1, 1, q_blocks)

    last_row = rows - 1

    def mask_mod(b, h, q, kv):
        rel = kv - lengths[b]  # the key's position relative to L_b: negative in the prefix
        q = (q // group).clamp(max=last_row)  # the tree row; a padded query row reads a real row's visibility
        sees = rel < 0
        if window is not None:
            sees = sees & (offsets[b, q] - rel < window)
        in_tree = (rel >= 0) & (rel < rows)
        return sees | (in_tree & allowed[b, q, rel.clamp(0, last_row)])

    return BlockMask.from_kv_blocks(counts(lead + tail), per_q_block(partial), counts(f1 - f0), per_q_block(full),
                                    BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(rows * group, width),
                                    compute_q_blocks=False)


def visible(block_mask: BlockMask) -> torch.Tensor:
    """bool [B, Q, KV]: which keys each query row of ``block_mask`` sees, as the kernel reads it: a key in a
    listed full block, or in a listed partial block where the mask function allows it."""
    q_len, kv_len = block_mask.seq_lengths
    device = block_mask.kv_indices.device
    batch, q_blocks, kv_blocks = block_mask.kv_indices.shape[0], block_mask.kv_indices.shape[2], _ceil_div(kv_len, BLOCK)

    def listed(count: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:  # -> bool [B, q blocks, kv blocks]
        used = torch.arange(indices.shape[-1], device=device) < count[:, 0, :, None]
        out = torch.zeros(batch, q_blocks, kv_blocks + 1, dtype=torch.bool, device=device)
        return out.scatter_(2, torch.where(used, indices[:, 0].long(), kv_blocks), True)[..., :kv_blocks]

    b = torch.arange(batch, device=device)[:, None, None]
    q = torch.arange(q_len, device=device)[None, :, None]
    kv = torch.arange(kv_len, device=device)[None, None, :]
    qb, kb = q // BLOCK, kv // BLOCK
    partial = listed(block_mask.kv_num_blocks, block_mask.kv_indices)[b, qb, kb]
    full = listed(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)[b, qb, kb]
    return full | (partial & block_mask.mask_mod(b, torch.zeros_like(b), q, kv))


def reference_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod=None,
                        block_mask: BlockMask | None = None, scale: float | None = None,
                        enable_gqa: bool = False) -> torch.Tensor:
    """What FlexAttention computes, written out: every score, in float32, over the keys :func:`visible`
    lets each row see. A CPU runs this outside a compiled step (FlexAttention's own eager form does the
    same far more slowly); its block tables and mask function are the kernel's."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1).float(), value.repeat_interleave(group, 1).float()
    scores = query.float() @ key.transpose(-1, -2) * (scale if scale is not None else query.shape[-1] ** -0.5)
    if score_mod is not None:
        scores = score_mod(scores, None, None, None, None)
    scores = scores.masked_fill(~visible(block_mask)[:, None], float("-inf"))
    return (scores.softmax(-1) @ value).to(query.dtype)


_compiled_flex = None


def _flex(device: torch.device):
    """FlexAttention as it should run here: traced into the surrounding compiled step; compiled on its own
    on a GPU outside one (its eager form materialises every score); written out on a CPU outside a compiled
    step (tests, small runs: :func:`reference_attention`)."""
    global _compiled_flex
    if torch.compiler.is_compiling():
        return flex_attention
    if device.type == "cpu":
        return reference_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


def _softcapped(softcap: float):
    """A score modification that soft-caps attention scores at ``softcap`` (Gemma 2's attention)."""
    def score_mod(score, b, h, q, kv):
        return softcap * torch.tanh(score / softcap)
    return score_mod


def tree_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                   scaling: float | None = None, dropout: float = 0.0, softcap: float | None = None,
                   s_aux: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface over a :func:`tree_block_mask` made for this model's
    ``group`` (query heads per key head): query [B, Hq, T, D], key and value [B, Hkv, W, D] (never repeated);
    returns [B, T, Hq, D]."""
    if not isinstance(attention_mask, BlockMask):
        raise TypeError(f"{NAME} attention runs ppd's tree steps only, with the BlockMask ppd builds; "
                        f"got a {type(attention_mask).__name__} mask")
    if s_aux is not None:
        raise NotImplementedError("attention sinks (s_aux) are not supported by ppd's FlexAttention tree step")
    if dropout:
        raise NotImplementedError("attention dropout in a decoding step")
    batch, heads, rows, dim = query.shape
    key_heads = key.shape[1]
    group = heads // key_heads
    if heads != group * key_heads or attention_mask.seq_lengths[0] != rows * group:
        raise ValueError(f"{heads} query heads over {key_heads} key heads, {rows} rows: the block mask was made "
                         f"for {attention_mask.seq_lengths[0]} query rows")
    # Each key head's query heads folded into its rows (row t * group + j: row t of head j), so that the
    # kernel sees one query head per key head.
    folded = query.view(batch, key_heads, group, rows, dim).transpose(2, 3).reshape(batch, key_heads, rows * group, dim)
    out = _flex(query.device)(folded, key, value, score_mod=_softcapped(softcap) if softcap else None,
                              block_mask=attention_mask, scale=scaling)
    out = out.view(batch, key_heads, rows, group, -1).permute(0, 2, 1, 3, 4)  # [B, T, key heads, group, Dv]
    return out.reshape(batch, rows, heads, -1).contiguous(), None


def register() -> None:
    """Make :data:`NAME` an attention implementation transformers' layers can look up (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, tree_attention)


def _configs(config) -> list:
    """The config and every sub-config under it (a multimodal model's text config among them)."""
    found = [config]
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "_attn_implementation_internal"):
            found += _configs(sub)
    return found


@contextlib.contextmanager
def active(model_config):
    """Within this block, the model's attention layers run :func:`tree_attention`; the model's own
    implementation (per config and sub-config) comes back afterwards, whatever happens inside."""
    register()
    configs = _configs(model_config)
    saved = [c._attn_implementation_internal for c in configs]
    try:
        for c in configs:
            c._attn_implementation_internal = NAME
        yield
    finally:
        for c, name in zip(configs, saved):
            c._attn_implementation_internal = name


__all__ = ["BLOCK", "NAME", "active", "reference_attention", "register", "tree_attention", "tree_block_mask",
           "visible"]
