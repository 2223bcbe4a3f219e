"""Attention masks and position ids for prompt tokens, prefill and tree steps.

Everything here is a pure function of shapes and lengths. Masks are built as booleans (True = may attend)
and turned into the additive float masks that transformers accepts as a ready 4D ``attention_mask``
(0 where allowed, the dtype's most negative value elsewhere).

Row layout of a prompt-token block: row ``k * V + j`` is copy ``j`` of prompt token ``k`` (both 0-based).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import AttentionType
from .uploads import upload

FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' names for a layer's attention


@dataclass(frozen=True)
class LayerAttention:
    """Which attention each layer runs, read from the model's config the way transformers reads it: the
    config's ``layer_types`` where it has them, else a ``sliding_window`` on every layer (as Mistral's model
    applies it) or full attention everywhere. A sliding layer at position p sees keys at positions
    ``(p - window, p]``; every mask below takes its layer kind's window and the model receives one mask per
    kind (:meth:`pack`)."""

    layer_types: tuple[str, ...]
    window: int | None

    @classmethod
    def of(cls, config) -> "LayerAttention":
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        window = getattr(config, "sliding_window", None)
        types = getattr(config, "layer_types", None)
        if types is None:
            types = [SLIDING if window is not None else FULL] * config.num_hidden_layers
        unknown = sorted(set(types) - {FULL, SLIDING})
        if unknown:
            raise ValueError(f"this model has layers of attention type {', '.join(unknown)}; ppd's tree masks "
                             f"support only {FULL} and {SLIDING}")
        if getattr(config, "use_bidirectional_attention", False) or getattr(config, "is_causal", True) is False:
            raise ValueError("this model's attention is bidirectional; ppd decodes causal language models only")
        if SLIDING in types and not (isinstance(window, int) and window >= 1):
            raise ValueError(f"the config has sliding-attention layers but its sliding_window is {window!r}")
        return cls(tuple(types), window if SLIDING in types else None)

    @property
    def kinds(self) -> dict[str, int | None]:
        """Each attention kind the model uses, with its window (None: the whole prefix)."""
        return {kind: (self.window if kind == SLIDING else None) for kind in dict.fromkeys(self.layer_types)}

    def pack(self, masks: dict[str, torch.Tensor]) -> torch.Tensor | dict[str, torch.Tensor]:
        """What the model's ``attention_mask`` takes: the mask itself where every layer runs the same kind,
        else transformers' per-kind mapping, which models with mixed layers read as it is."""
        return next(iter(masks.values())) if len(masks) == 1 else masks


def prompt_block_mask(num_tokens: int, num_ensemble: int, attention_type: AttentionType | str,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """Which prompt-token rows see which, for the first ``num_tokens`` prompt tokens: bool [n*V, n*V]."""
    attention_type = AttentionType(attention_type)
    rows = torch.arange(num_tokens * num_ensemble, device=device)
    token, copy = rows // num_ensemble, rows % num_ensemble
    if attention_type is AttentionType.ENSEMBLE:
        return (copy[:, None] == copy[None, :]) & (token[None, :] <= token[:, None])
    if attention_type is AttentionType.DECODER:
        return rows[None, :] <= rows[:, None]
    return token[:, None] == token[None, :]  # encoder: all copies of its own prompt token


def to_additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean mask -> float mask for ``attention_mask`` (0 allowed, most negative value masked)."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def prefill_layout(
    lengths: list[int], num_prompt_tokens: int, num_ensemble: int, attention_type: AttentionType | str,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask and positions for ``[x_b, prompt rows, padding]`` in each batch row b: the packed layout with
    one cut at the end of every row (:func:`packed_layout`). Returns ``allowed`` bool [B, Q, Q] and
    ``position_ids`` long [B, Q], ``Q = max(L) + N * V``."""
    return packed_layout(lengths, [[n] for n in lengths], num_prompt_tokens, num_ensemble, attention_type, device)


def packed_width(lengths: list[int], cut_counts: list[int], rows_per_cut: int, width_multiple: int = 1) -> int:
    """Slots of a packed forward (:func:`packed_layout`): the widest row's real tokens and its blocks of prompt
    rows, ``rows_per_cut`` a cut, rounded up to a multiple of ``width_multiple``."""
    widest = max(n + k * rows_per_cut for n, k in zip(lengths, cut_counts))
    return -(-widest // width_multiple) * width_multiple


def packed_layout(
    lengths: list[int], cuts: list[list[int]], num_prompt_tokens: int, num_ensemble: int,
    attention_type: AttentionType | str, device: torch.device | str = "cpu", width_multiple: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask and positions for ``[x_b, block_1, ..., block_K, padding]``: many cuts of one sequence in one forward.

    Row b holds its ``lengths[b]`` real tokens at slots ``[0, L_b)``; then, for its j-th cut ``c = cuts[b][j]``
    (``1 <= c <= L_b``), a block of ``N * V`` prompt rows at ``[L_b + j*N*V, L_b + (j+1)*N*V)``, prompt token k
    of the block at position ``c + k``; then padding up to ``Q = max_b(L_b + K_b * N * V)``, rounded up to a
    multiple of ``width_multiple`` (fewer distinct shapes for kernels that plan per shape). Real tokens
    attend causally; a block's rows see the real tokens before their cut, ``x_b[:c]``, and each other as
    ``attention_type`` says, never another block; padding sees only itself. So every block computes exactly
    what the prompt tokens compute appended after ``x_b[:c]`` alone (the frozen real tokens never see a block).

    Returns ``allowed`` bool [B, Q, Q] and ``position_ids`` long [B, Q].
    """
    check_cuts(lengths, cuts)
    width = packed_width(lengths, [len(row) for row in cuts], num_prompt_tokens * num_ensemble, width_multiple)
    return layout_tensors(upload(lengths, device), upload(cut_table(cuts), device, torch.long),
                          upload([len(row) for row in cuts], device), width, num_prompt_tokens, num_ensemble,
                          attention_type)


def check_cuts(lengths: list[int], cuts: list[list[int]]) -> None:
    """Every cut of a row falls inside it (``1 <= c <= L``), one list of cuts per row."""
    if len(cuts) != len(lengths):
        raise ValueError(f"{len(lengths)} sequences but cuts for {len(cuts)}")
    for length, row in zip(lengths, cuts):
        if any(not 1 <= c <= length for c in row):
            raise ValueError(f"cuts {row} fall outside a sequence of {length} tokens (each must be in 1..{length})")


def cut_table(cuts: list[list[int]], columns: int | None = None) -> list[list[int]]:
    """The cuts of each row padded with zeros to ``columns`` (default: the most any row has) columns."""
    columns = max(len(row) for row in cuts) if columns is None else columns
    return [row + [0] * (columns - len(row)) for row in cuts]


def _slot_roles(lengths: torch.Tensor, cuts: torch.Tensor, counts: torch.Tensor, width: int, n_rows: int):
    """Per slot of :func:`layout_tensors`' layout, [B, Q] each: its slot number (``[1, Q]``), whether it holds a
    real token, its offset past the real tokens, which cut's block it is in, whether it is a prompt row, and that
    cut (meaningful on prompt rows)."""
    most = cuts.shape[1]
    slot = torch.arange(width, device=lengths.device)[None, :]
    length = lengths[:, None]  # [B, 1]
    is_real = slot < length  # [B, Q]
    rel = slot - length  # [B, Q]: offset past the real tokens
    block = rel.clamp(min=0) // max(n_rows, 1)  # which cut a prompt row belongs to
    is_prompt = (rel >= 0) & (block < counts[:, None]) if n_rows else torch.zeros_like(is_real)
    cut = cuts.gather(1, block.clamp(max=max(most - 1, 0)))  # [B, Q], meaningful on prompt rows
    return slot, is_real, rel, block, is_prompt, cut


def _positions(roles, n_rows: int, num_ensemble: int) -> torch.Tensor:
    """Position ids [B, Q] from :func:`_slot_roles`: a real token's slot, a prompt row's cut plus its prompt token's
    index, 0 on padding."""
    slot, is_real, rel, _, is_prompt, cut = roles
    positions = torch.where(is_real, slot, torch.zeros_like(slot).expand_as(is_real))
    if n_rows:
        positions = torch.where(is_prompt, cut + (rel.clamp(min=0) % n_rows) // num_ensemble, positions)
    return positions


def layout_tensors(lengths: torch.Tensor, cuts: torch.Tensor, counts: torch.Tensor, width: int,
                   num_prompt_tokens: int, num_ensemble: int, attention_type: AttentionType | str,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`packed_layout` from tensors alone, where they are: ``lengths`` [B], ``cuts`` [B, K] (each row's cuts
    in its first ``counts[b]`` columns) and ``width``, at least the widest row's slots. Nothing is read back, so a
    captured training step builds its layout in the graph from these few numbers."""
    device = lengths.device
    n_rows = num_prompt_tokens * num_ensemble
    roles = _slot_roles(lengths, cuts, counts, width, n_rows)
    slot, is_real, rel, block, is_prompt, cut = roles
    slot = slot[0]

    causal = slot[None, :, None] >= slot[None, None, :]  # [1, Q, Q] query >= key
    allowed = is_real[:, :, None] & is_real[:, None, :] & causal
    if n_rows:
        pair_mask = prompt_block_mask(num_prompt_tokens, num_ensemble, attention_type, device)  # made there
        r = rel.clamp(min=0) % n_rows  # [B, Q]: each slot's row within its block
        # pair_mask[r_q, r_k] for every pair: each query's row of the pair mask, then each key's column of it, by a
        # gather through an expanded (uncopied) index. Indexing with both [B, Q, 1] and [B, 1, Q] made two
        # [B, Q, Q] long tensors: 2 x 7.7 GiB for 16 prompts of 8K tokens on an H200 (results/deep_gpu/h200/v28/).
        keys = r[:, None, :].expand(-1, width, -1)
        pair = pair_mask[r].gather(2, keys) & (block[:, :, None] == block[:, None, :])  # [B, Q, Q]
        sees_prefix = is_real[:, None, :] & (slot[None, None, :] < cut[:, :, None])
        allowed |= is_prompt[:, :, None] & (sees_prefix | (is_prompt[:, None, :] & pair))
    is_pad = ~(is_real | is_prompt)
    allowed |= is_pad[:, :, None] & torch.eye(width, dtype=torch.bool, device=device)[None]
    return allowed, _positions(roles, n_rows, num_ensemble)


def layout_positions(lengths: torch.Tensor, cuts: torch.Tensor, counts: torch.Tensor, width: int,
                     num_prompt_tokens: int, num_ensemble: int) -> torch.Tensor:
    """The position ids of :func:`layout_tensors`' layout alone, without its ``[B, Q, Q]`` mask."""
    n_rows = num_prompt_tokens * num_ensemble
    return _positions(_slot_roles(lengths, cuts, counts, width, n_rows), n_rows, num_ensemble)


def causal_prompt_rows(num_prompt_tokens: int, num_ensemble: int, attention_type: AttentionType | str) -> bool:
    """Whether each prompt row sees exactly the prompt rows at or before its own slot: then a layout with one cut
    at the end of every row (a decoder's prefill, :func:`prefill_layout`) allows each real token and prompt row
    exactly the keys of plain causal attention over the slots (padding aside, which sees only itself there and
    whose outputs and cache slots nothing reads)."""
    pair = prompt_block_mask(num_prompt_tokens, num_ensemble, attention_type)
    return bool(torch.equal(pair, torch.ones_like(pair).tril()))


def prompt_rows_layout(lengths: torch.Tensor, cuts: torch.Tensor, counts: torch.Tensor, width: int,
                       num_prompt_tokens: int, num_ensemble: int, attention_type: AttentionType | str,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed layout's rows of prompt tokens alone (:func:`layout_tensors`' arguments; the two-pass training
    forward, ``ppd.two_pass``): prompt row j of batch row b is the layout's slot ``L_b + j`` (``P = K * N * V``
    rows, K the columns of ``cuts``), and its keys are the layout's first ``width`` slots, then the P prompt rows.

    Returns ``allowed`` bool [B, P, width + P], what :func:`layout_tensors` lets those slots see (a row past the
    row's cuts, padding, sees only itself), and their ``position_ids`` long [B, P]. Its size grows with the
    width, not with its square."""
    device = lengths.device
    n_rows = num_prompt_tokens * num_ensemble
    rows = cuts.shape[1] * n_rows
    row = torch.arange(rows, device=device)
    valid = row[None, :] < counts[:, None] * n_rows  # [B, P]
    block, r = row // n_rows, row % n_rows  # [P]: each row's cut (column of ``cuts``) and place in its block
    cut = cuts[:, block]  # [B, P]
    slot = torch.arange(width, device=device)
    prefix = valid[:, :, None] & (slot[None, None, :] < cut[:, :, None])  # [B, P, width]: x_b[:c]
    pair = prompt_block_mask(num_prompt_tokens, num_ensemble, attention_type, device)[r[:, None], r[None, :]]
    own = pair & (block[:, None] == block[None, :])  # [P, P]
    alone = torch.eye(rows, dtype=torch.bool, device=device)
    among = torch.where(valid[:, :, None], own[None] & valid[:, None, :], alone[None])  # [B, P, P]
    positions = torch.where(valid, cut + r[None, :] // num_ensemble, 0)
    return torch.cat([prefix, among], dim=-1), positions


# The SDPA kernels for a forward whose shape changes call to call (prefills, training batches): all but cuDNN's.
# cuDNN's attention builds an execution plan for every new shape, and such a forward's shape (rows by width) is
# new nearly every time: on one H200 a decoder's prefills of 32 MT-Bench prompts took 109-117 ms each where it
# met each shape first, and 64 ms on a second decoder that prefilled the same shapes right after it
# (results/deep_gpu/h200/v7/batch_speed_gap_b1.json). Captured steps keep cuDNN: their shapes are fixed.
def plan_free_sdpa():
    """A context in which scaled-dot-product attention picks among the kernels that need no per-shape plan."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def within_window(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """bool [..., Q, K]: which keys a sliding layer of this ``window`` lets each query see."""
    return query_positions[..., :, None] - key_positions[..., None, :] < window


def step_mask(tree_allowed: torch.Tensor, lengths: torch.Tensor, slot_ids: torch.Tensor,
              dtype: torch.dtype, offsets: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """Float mask [B, 1, T, W] for T new rows written at ``[L_b, L_b + T)`` of each row's cache.

    ``tree_allowed`` is bool [T, T] or, one tree per batch row, [B, T, T]; ``slot_ids`` long [W] are the
    cache slots attention sees (``0..W-1``). Every new row sees the committed prefix ``[0, L_b)``; among
    themselves the rows follow ``tree_allowed``; stale slots past ``L_b + T`` are hidden. The tree part is
    fixed per tree, the prefix part comes from the lengths alone. With a sliding ``window``, row q (at
    position ``L_b + offsets[b, q]``) sees only keys less than ``window`` positions behind it: the prefix
    slot s sits at position s, a tree row at its own offset.
    """
    batch, num_rows, width = lengths.shape[0], tree_allowed.shape[-1], slot_ids.shape[0]
    rel = slot_ids[None, :] - lengths[:, None]  # [B, W]
    in_prefix = rel < 0
    in_tree = (rel >= 0) & (rel < num_rows)
    columns = rel.clamp(0, num_rows - 1)[:, None, :].expand(batch, num_rows, width)
    tree_allowed = tree_allowed.expand(batch, num_rows, num_rows)
    prefix = in_prefix[:, None, :]  # [B, 1, W]
    if window is not None:
        offsets = offsets.expand(batch, num_rows)
        tree_allowed = tree_allowed & within_window(offsets, offsets, window)
        prefix = prefix & within_window(offsets, rel, window)  # positions relative to L_b on both sides
    tree_part = tree_allowed.gather(2, columns)  # [B, T, W]
    allowed = prefix | (in_tree[:, None, :] & tree_part)
    return to_additive(allowed[:, None], dtype)
