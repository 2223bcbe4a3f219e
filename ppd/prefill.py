"""The prefill pass ``[x_b, p_1..p_N]``: its inputs, and the rows whose logits are read.

Shared by the decoder (which runs it against its KV cache) and by training (which runs it without a
cache and back-propagates into the prompt-token table). Row b holds its real tokens at slots
``[0, L_b)``, then the ``N * V`` prompt rows, then padding (see ``attention.prefill_layout``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import LayerAttention, prefill_layout, to_additive, within_window
from .config import AttentionType


@dataclass
class PrefillInputs:
    embeds: torch.Tensor  # [B, Q, hidden] in the model's dtype, prompt rows scattered in
    mask: torch.Tensor | dict[str, torch.Tensor]  # additive float [B, 1, Q, Q], one per attention kind
    positions: torch.Tensor  # long [B, Q]
    lengths: torch.Tensor  # long [B], real tokens of each row
    keep: torch.Tensor  # long [S], the slots whose logits the model computes (``logits_to_keep``)
    where: torch.Tensor  # long [B, 1 + N*V], per row: index into ``keep`` of its last real token, then its prompt rows

    @property
    def width(self) -> int:
        return self.embeds.shape[1]

    def rows(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits of each row's last real token and prompt rows, [B, 1 + N*V, vocab], from logits [B, S, vocab]."""
        batch = torch.arange(logits.shape[0], device=logits.device)[:, None]
        return logits[batch, self.where]


def build_prefill(model, batch: list[list[int]], prompt_table: torch.Tensor | None, num_prompt_tokens: int,
                  num_ensemble: int = 1, attention_type: AttentionType | str = AttentionType.ENSEMBLE) -> PrefillInputs:
    """Inputs of one prefill forward over ``batch`` (lists of token ids) with the ``prompt_table`` rows
    ([N * V, hidden], any dtype; gradients flow into it) appended after each row's tokens."""
    embedding = model.get_input_embeddings()
    device = embedding.weight.device
    lengths = [len(x) for x in batch]
    if min(lengths) < 1:
        raise ValueError("every prompt needs at least one token")
    allowed, positions = prefill_layout(lengths, num_prompt_tokens, num_ensemble, attention_type, device)
    width = allowed.shape[1]
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    for b, x in enumerate(batch):
        ids[b, : len(x)] = torch.as_tensor(x, dtype=torch.long)
    embeds = embedding(ids.to(device))
    length_t = torch.tensor(lengths, device=device)
    n_rows = num_prompt_tokens * num_ensemble if prompt_table is not None else 0
    if n_rows:
        slots = length_t[:, None] + torch.arange(n_rows, device=device)[None, :]  # [B, nV]
        table = prompt_table.to(device=device, dtype=embeds.dtype)
        embeds = embeds.scatter(1, slots[..., None].expand(-1, -1, embeds.shape[-1]),
                                table[None].expand(len(batch), -1, -1))
    # Logits only where they are read: each row's last real token and its prompt rows (known on the host,
    # so no device round trip).
    wanted = [[n - 1 + i for i in range(1 + n_rows)] for n in lengths]
    keep = sorted({slot for row in wanted for slot in row})
    index = {slot: i for i, slot in enumerate(keep)}
    where = torch.tensor([[index[slot] for slot in row] for row in wanted], device=device)
    layers = LayerAttention.of(model.config)
    masks = {kind: to_additive((allowed if window is None else allowed & within_window(positions, positions, window)
                                )[:, None], embeds.dtype) for kind, window in layers.kinds.items()}
    return PrefillInputs(embeds, layers.pack(masks), positions, length_t, torch.tensor(keep, device=device), where)


def average_copies(prompt_logits: torch.Tensor, num_prompt_tokens: int, num_ensemble: int) -> torch.Tensor:
    """[B, N * V, vocab] -> [B, N, vocab] in float32: the V copies of each prompt token averaged."""
    b, _, vocab = prompt_logits.shape
    return prompt_logits.reshape(b, num_prompt_tokens, num_ensemble, vocab).float().mean(2)
