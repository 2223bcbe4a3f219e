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

FlexAttention's main kernel, which takes over from 128 folded query rows (a 64-row tree), runs one program
per block of 128 query rows, key head and batch row over the whole prefix: 6 programs for the default model
at batch 1, on a GPU of 132 multiprocessors. Where so few programs would run, :func:`kv_chunks` splits the
cache into pieces that are heads of their own (a view of the cache: the slots of one key head are
contiguous), and the pieces' outputs are merged by their log-sum-exp, as flash-decoding does.

The model's attention layers pick their function by ``config._attn_implementation``, so a step runs inside
:func:`active`, which names this module's function (registered with transformers' ``AttentionInterface``
as :data:`NAME`) for the duration of the call and then restores the model's own choice. Prefill and
everything else keep the model's own attention.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import AuxOutput, AuxRequest, BlockMask, flex_attention

from ..attention import within_window
from ..config import env_choice
from . import attention_switch

NAME = "ppd_tree_flex"  # the attention implementation this module registers with transformers
BLOCK = 128  # FlexAttention's sparse block size, in query rows and in key slots
MIN_CHUNK = 512  # the fewest key slots one piece of a split cache holds
# Split only a step whose main-kernel programs would occupy fewer than 1/SPLIT_BELOW of the multiprocessors.
# On an H100 at 8K context, a 64-row tree step of the default model (192 folded rows): batch 1 (6 programs)
# 4.67 ms split in 17 pieces against 6.90 ms whole (two-run timing); batch 16 (96 programs) 28.8 ms split
# in 2 against 8.2 ms whole (results/long_context/h100; why the split is slower there is not known).
SPLIT_BELOW = 8


def _ceil_div(a, b):
    return -(-a // b)


def kv_chunks(batch: int, key_heads: int, query_rows: int, width: int, device: torch.device) -> int:
    """How many pieces a step's attention splits the cache into (see the module docstring): 1 where
    FlexAttention runs its decoding kernel (fewer than :data:`BLOCK` folded query rows), which splits the
    keys itself, and where its main kernel has a program for more than one multiprocessor in
    :data:`SPLIT_BELOW`; else enough pieces of at least :data:`MIN_CHUNK` slots, a divisor of the width's
    blocks, for one program per multiprocessor. ``PPD_FLEX_SPLIT`` = ``auto`` (this), ``off`` (never split) or
    ``always`` (split also where the decoding kernel would run, which then runs the main kernel)."""
    mode = env_choice("PPD_FLEX_SPLIT", ("auto", "off", "always"), "auto")
    if mode == "off" or device.type != "cuda":
        return 1
    programs = batch * key_heads * _ceil_div(query_rows, BLOCK)
    processors = _multiprocessors(device)
    if mode == "auto" and (query_rows < BLOCK or programs * SPLIT_BELOW > processors):
        return 1
    wanted = _ceil_div(processors, programs)
    blocks = width // BLOCK
    choices = [s for s in range(1, blocks + 1) if blocks % s == 0 and blocks // s * BLOCK >= MIN_CHUNK] or [1]
    return next((s for s in choices if s >= wanted), choices[-1])


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def tree_block_mask(tree_allowed: torch.Tensor, lengths: torch.Tensor, offsets: torch.Tensor, width: int,
                    window: int | None = None, group: int = 1, chunks: int = 1, key_heads: int = 1) -> BlockMask:
    """The :class:`BlockMask` of ``T`` tree rows written at ``[L_b, L_b + T)`` of each row's cache, attending
    over ``width`` slots: every row sees the committed prefix ``[0, L_b)``, the tree rows see each other as
    ``tree_allowed`` (bool [T, T] or [B, T, T]) says, nothing sees past ``L_b + T``. With a sliding
    ``window``, row q at position ``L_b + offsets[b, q]`` sees only keys less than ``window`` positions
    behind it. The same visibility as :func:`ppd.attention.step_mask`, without a ``[T, W]`` tensor.

    ``group`` > 1 lays out the query rows of ``group`` query heads that share a key head one after another:
    query row ``t * group + j`` is tree row t of the group's head j (:func:`tree_attention` folds the heads so,
    which lets FlexAttention run its split-key decoding kernel for any ratio of query to key heads; it runs
    it only for power-of-two ratios when it groups the heads itself).

    ``chunks`` > 1 splits the width into that many equal pieces, each its own attention head: head
    ``k * chunks + s`` is key head k over slots ``[s * width / chunks, (s + 1) * width / chunks)``, its key
    slots counted from the piece's start (``key_heads`` key heads; ``width`` a multiple of ``chunks``
    blocks)."""
    batch, rows = lengths.shape[0], tree_allowed.shape[-1]
    device = lengths.device
    if chunks > 1 and width % (chunks * BLOCK):
        raise ValueError(f"a width of {width} slots does not split into {chunks} pieces of whole {BLOCK}-slot blocks")
    allowed = tree_allowed.expand(batch, rows, rows)
    offsets = offsets.expand(batch, rows)
    if window is not None:
        allowed = allowed & within_window(offsets, offsets, window)
    kv_blocks, q_blocks = _ceil_div(width, BLOCK), _ceil_div(rows * group, BLOCK)
    piece_blocks = kv_blocks // chunks
    piece = piece_blocks * BLOCK if chunks > 1 else width  # key slots a head sees
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
    starts = torch.arange(chunks, device=device)[None] * piece_blocks  # [1, S]: each piece's first block

    def within(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks [lo, hi) of each row ([B]) within each piece: the first, counted from the piece's start, and
        how many ([B, S] each)."""
        first = torch.maximum(lo[:, None], starts)
        return first - starts, (torch.minimum(hi[:, None], starts + piece_blocks) - first).clamp(min=0)

    full_first, full_count = within(f0, f1)
    # Partial blocks: the window's edge [p0, f0) (none without a window), then the tree's [f1, top).
    lead_first, lead_count = within(p0, f0)
    tail_first, tail_count = within(f1, top)
    slot = torch.arange(piece_blocks, device=device)[None, None]
    partial = torch.where(slot < lead_count[..., None], lead_first[..., None] + slot,
                          tail_first[..., None] + slot - lead_count[..., None])
    full = full_first[..., None] + slot

    def per_head(table: torch.Tensor) -> torch.Tensor:  # [B, S, ...] -> [B, heads, ...]: head k * S + s
        if chunks == 1:
            return table
        return table[:, None].expand(-1, key_heads, *table.shape[1:]).reshape(batch, key_heads * chunks,
                                                                               *table.shape[2:])

    def per_q_block(table: torch.Tensor) -> torch.Tensor:  # [B, S, n] -> [B, heads, q blocks, n], int32
        table = table.clamp(0, piece_blocks - 1).to(torch.int32)
        return per_head(table)[:, :, None, :].expand(-1, -1, q_blocks, -1)

    def counts(count: torch.Tensor) -> torch.Tensor:  # [B, S] -> [B, heads, q blocks]
        return per_head(count.to(torch.int32))[:, :, None].expand(-1, -1, q_blocks)

    last_row = rows - 1

    def mask_mod(b, h, q, kv):
        if chunks > 1:
            kv = kv + (h % chunks) * piece  # the key's slot in the whole cache
        rel = kv - lengths[b]  # the key's position relative to L_b: negative in the prefix
        q = (q // group).clamp(max=last_row)  # the tree row; a padded query row reads a real row's visibility
        sees = rel < 0
        if window is not None:
            sees = sees & (offsets[b, q] - rel < window)
        in_tree = (rel >= 0) & (rel < rows)
        return sees | (in_tree & allowed[b, q, rel.clamp(0, last_row)])

    return BlockMask.from_kv_blocks(counts(lead_count + tail_count), per_q_block(partial), counts(full_count),
                                    per_q_block(full), BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(rows * group, piece), compute_q_blocks=False)


def visible(block_mask: BlockMask) -> torch.Tensor:
    """bool [B, H, Q, KV]: which keys each query row of ``block_mask`` sees in each of its heads (H = 1 for a
    mask shared by every head), as the kernel reads it: a key in a listed full block, or in a listed partial
    block where the mask function allows it."""
    q_len, kv_len = block_mask.seq_lengths
    device = block_mask.kv_indices.device
    batch, heads, q_blocks = block_mask.kv_indices.shape[:3]
    kv_blocks = _ceil_div(kv_len, BLOCK)

    def listed(count: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:  # -> bool [B, H, q blocks, kv blocks]
        used = torch.arange(indices.shape[-1], device=device) < count[..., None]
        out = torch.zeros(batch, heads, q_blocks, kv_blocks + 1, dtype=torch.bool, device=device)
        return out.scatter_(3, torch.where(used, indices.long(), kv_blocks), True)[..., :kv_blocks]

    b = torch.arange(batch, device=device)[:, None, None, None]
    h = torch.arange(heads, device=device)[None, :, None, None]
    q = torch.arange(q_len, device=device)[None, None, :, None]
    kv = torch.arange(kv_len, device=device)[None, None, None, :]
    qb, kb = q // BLOCK, kv // BLOCK
    partial = listed(block_mask.kv_num_blocks, block_mask.kv_indices)[b, h, qb, kb]
    full = listed(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)[b, h, qb, kb]
    return full | (partial & block_mask.mask_mod(b, h, q, kv))


def reference_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod=None,
                        block_mask: BlockMask | None = None, scale: float | None = None,
                        enable_gqa: bool = False, return_aux: AuxRequest | None = None):
    """What FlexAttention computes, written out: every score, in float32, over the keys :func:`visible`
    lets each row see (and, asked for, each row's log-sum-exp of its scores). A CPU runs this outside a
    compiled step (FlexAttention's own eager form does the same far more slowly); its block tables and mask
    function are the kernel's."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1).float(), value.repeat_interleave(group, 1).float()
    scores = query.float() @ key.transpose(-1, -2) * (scale if scale is not None else query.shape[-1] ** -0.5)
    if score_mod is not None:
        scores = score_mod(scores, None, None, None, None)
    scores = scores.masked_fill(~visible(block_mask), float("-inf"))
    lse = scores.logsumexp(-1)
    out = torch.nan_to_num(scores.softmax(-1)) @ value  # a row that sees nothing gives zeros, as the kernel's
    out = out.to(query.dtype)
    return (out, AuxOutput(lse=lse)) if return_aux is not None and return_aux.lse else out


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
    key_heads, width = key.shape[1], key.shape[2]
    group = heads // key_heads
    if heads != group * key_heads or attention_mask.seq_lengths[0] != rows * group:
        raise ValueError(f"{heads} query heads over {key_heads} key heads, {rows} rows: the block mask was made "
                         f"for {attention_mask.seq_lengths[0]} query rows")
    chunks = width // attention_mask.seq_lengths[1]
    if chunks * attention_mask.seq_lengths[1] != width or (
            chunks > 1 and attention_mask.kv_num_blocks.shape[1] != key_heads * chunks):
        raise ValueError(f"the block mask covers {attention_mask.seq_lengths[1]} key slots of "
                         f"{attention_mask.kv_num_blocks.shape[1]} heads; the layer has {width} slots of "
                         f"{key_heads} key heads")
    # Each key head's query heads folded into its rows (row t * group + j: row t of head j), so that the
    # kernel sees one query head per key head.
    folded = query.view(batch, key_heads, group, rows, dim).transpose(2, 3).reshape(batch, key_heads, rows * group, dim)
    attend = functools.partial(_flex(query.device), score_mod=_softcapped(softcap) if softcap else None,
                               block_mask=attention_mask, scale=scaling)
    if chunks == 1:
        out = attend(folded, key, value)
    else:
        out = _split_attention(attend, folded, key, value, chunks)
    out = out.view(batch, key_heads, rows, group, -1).permute(0, 2, 1, 3, 4)  # [B, T, key heads, group, Dv]
    return out.reshape(batch, rows, heads, -1).contiguous(), None


def _split_attention(attend, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunks: int) -> torch.Tensor:
    """``attend`` over the cache split into ``chunks`` pieces, each piece a head of its own (a view of the
    cache, nothing copied: slots of one key head are contiguous), merged by each piece's log-sum-exp.
    query [B, Hkv, Q, D] (heads folded), key and value [B, Hkv, W, D] -> [B, Hkv, Q, Dv]."""
    batch, key_heads, q_len, _ = query.shape
    if not (key.is_contiguous() and value.is_contiguous()):
        raise ValueError("a split tree step needs the cache's keys and values laid out contiguously")
    pieces = key_heads * chunks
    key = key.view(batch, pieces, key.shape[2] // chunks, key.shape[3])
    value = value.view(batch, pieces, value.shape[2] // chunks, value.shape[3])
    query = query[:, :, None].expand(-1, -1, chunks, -1, -1).reshape(batch, pieces, q_len, query.shape[-1])
    out, aux = attend(query, key, value, return_aux=AuxRequest(lse=True))
    lse = aux.lse.view(batch, key_heads, chunks, q_len)  # -inf where a piece holds nothing a row sees
    weight = (lse - lse.amax(2, keepdim=True)).exp()  # every row sees its own slot: some piece is finite
    merged = (out.view(batch, key_heads, chunks, q_len, -1).float() * weight[..., None]).sum(2)
    return (merged / weight.sum(2)[..., None]).to(out.dtype)


def active(model_config):
    """Within this block, the model's attention layers run :func:`tree_attention`; the model's own
    implementation (per config and sub-config) comes back afterwards, whatever happens inside."""
    return attention_switch.switched(model_config, NAME, tree_attention)


__all__ = ["BLOCK", "MIN_CHUNK", "NAME", "SPLIT_BELOW", "active", "kv_chunks", "reference_attention",
           "tree_attention", "tree_block_mask", "visible"]
