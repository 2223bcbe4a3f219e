"""The prefill pass ``[x_b, p_1..p_N]``: its inputs, and the rows whose logits are read.

Shared by the decoder (which runs it against its KV cache) and by training (which runs it without a
cache and back-propagates into the prompt-token table). Row b holds its real tokens at slots
``[0, L_b)``, then the ``N * V`` prompt rows, then padding (see ``attention.prefill_layout``). Training may
pack many cuts of one sequence into a row: one block of prompt rows per cut, each seeing only the tokens
before its cut (``attention.packed_layout``), so one forward trains every cut of a conversation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import LayerAttention, packed_layout, to_additive, within_window
from .config import AttentionType
from .deep_prompts import prompt_row_index
from .uploads import upload


@dataclass
class PrefillInputs:
    embeds: torch.Tensor  # [B, Q, hidden] in the model's dtype, prompt rows scattered in
    mask: torch.Tensor | dict[str, torch.Tensor]  # additive float [B, 1, Q, Q], one per attention kind
    positions: torch.Tensor  # long [B, Q]
    lengths: torch.Tensor  # long [B], real tokens of each row
    keep: torch.Tensor  # long [S], the slots whose logits the model computes (``logits_to_keep``)
    where: torch.Tensor  # long [C, 1 + N*V], per cut: index into ``keep`` of its last input token, then its prompt rows
    cut_rows: torch.Tensor  # long [C], the batch row of each cut (one cut per row, ``arange(B)``, unless packed)
    # long [B, Q]: prompt-table row + 1 at each prompt row, 0 elsewhere (``ppd.deep_prompts``); None without them
    prompt_rows: torch.Tensor | None = None

    @property
    def width(self) -> int:
        return self.embeds.shape[1]

    def rows(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits of each cut's last input token and prompt rows, [C, 1 + N*V, vocab], from logits [B, S, vocab]."""
        return logits[self.cut_rows[:, None], self.where]


def build_prefill(model, batch: list[list[int]], prompt_table: torch.Tensor | None, num_prompt_tokens: int,
                  num_ensemble: int = 1, attention_type: AttentionType | str = AttentionType.ENSEMBLE,
                  cuts: list[list[int]] | None = None, width_multiple: int = 1) -> PrefillInputs:
    """Inputs of one prefill forward over ``batch`` (lists of token ids) with the ``prompt_table`` rows
    ([N * V, hidden], any dtype; gradients flow into it) appended after each row's tokens, or, with
    ``cuts``, one block of them per cut ``c`` of a row, reading that row's first ``c`` tokens. The width is
    rounded up to a multiple of ``width_multiple`` with padding."""
    embedding = model.get_input_embeddings()
    device = embedding.weight.device
    lengths = [len(x) for x in batch]
    if min(lengths) < 1:
        raise ValueError("every prompt needs at least one token")
    cuts = [[n] for n in lengths] if cuts is None else [list(row) for row in cuts]
    allowed, positions = packed_layout(lengths, cuts, num_prompt_tokens, num_ensemble, attention_type, device,
                                       width_multiple)
    width = allowed.shape[1]
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    for b, x in enumerate(batch):
        ids[b, : len(x)] = torch.as_tensor(x, dtype=torch.long)
    embeds = embedding(upload(ids, device))
    n_rows = num_prompt_tokens * num_ensemble if prompt_table is not None else 0
    # The logits read per cut: its last input token and its block of prompt rows (known on the host, so no
    # device round trip). Only those slots' logits are computed.
    wanted, cut_rows = [], []
    for b, (n, row) in enumerate(zip(lengths, cuts)):
        for j, c in enumerate(row):
            wanted.append((b, [c - 1] + [n + j * n_rows + i for i in range(n_rows)]))
            cut_rows.append(b)
    prompt_rows = None
    if n_rows:
        rel = torch.arange(width)[None, :] - torch.tensor(lengths)[:, None]  # [B, Q]
        is_prompt = (rel >= 0) & (rel < torch.tensor([len(row) * n_rows for row in cuts])[:, None])
        table = prompt_table.to(device=device, dtype=embeds.dtype)
        prompt_rows = upload(prompt_row_index(is_prompt, rel.clamp(min=0) % n_rows), device)
        # Row 0 of the lookup is every real token's: no gradient to add up there (see deep_prompts' hooks).
        looked_up = torch.nn.functional.embedding(prompt_rows, torch.cat([table.new_zeros(1, table.shape[1]), table]),
                                                  padding_idx=0)
        embeds = torch.where(upload(is_prompt, device)[..., None], looked_up, embeds)
    keep = sorted({slot for _, row in wanted for slot in row})
    index = {slot: i for i, slot in enumerate(keep)}
    where = upload([[index[slot] for slot in row] for _, row in wanted], device)
    layers = LayerAttention.of(model.config)
    masks = {kind: to_additive((allowed if window is None else allowed & within_window(positions, positions, window)
                                )[:, None], embeds.dtype) for kind, window in layers.kinds.items()}
    return PrefillInputs(embeds, layers.pack(masks), positions, upload(lengths, device), upload(keep, device), where,
                         upload(cut_rows, device), prompt_rows)


def average_copies(prompt_logits: torch.Tensor, num_prompt_tokens: int, num_ensemble: int) -> torch.Tensor:
    """[B, N * V, vocab] -> [B, N, vocab] in float32: the V copies of each prompt token averaged."""
    b, _, vocab = prompt_logits.shape
    return prompt_logits.reshape(b, num_prompt_tokens, num_ensemble, vocab).float().mean(2)
