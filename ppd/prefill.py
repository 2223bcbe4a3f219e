"""The prefill pass ``[x_b, p_1..p_N]``: its inputs, and the rows whose logits are read.

Shared by the decoder (which runs it against its KV cache) and by training (which runs it without a
cache and back-propagates into the prompt-token table). Row b holds its real tokens at slots
``[0, L_b)``, then the ``N * V`` prompt rows, then padding (see ``attention.prefill_layout``). Training may
pack many cuts of one sequence into a row: one block of prompt rows per cut, each seeing only the tokens
before its cut (``attention.packed_layout``), so one forward trains every cut of a conversation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .attention import (LayerAttention, check_cuts, cut_table, layout_positions, layout_tensors, packed_width,
                        to_additive, within_window)
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


@dataclass
class PrefillPlan:
    """Everything of a prefill forward that the token ids and cuts decide, as host tensors (:func:`plan_prefill`):
    made before any device work, uploaded without waiting (:meth:`upload`) or copied into a captured step's
    buffers, and turned into the forward's inputs on the device by :func:`prefill_inputs`."""

    ids: torch.Tensor  # long [B, Q]: each row's tokens, zeros after them
    lengths: torch.Tensor  # long [B]
    cuts: torch.Tensor  # long [B, K]: row b's cuts in its first ``counts[b]`` columns, zeros after
    counts: torch.Tensor  # long [B]
    keep: torch.Tensor  # long [S]: the slots whose logits are computed
    where: torch.Tensor  # long [C, 1 + N*V]: per cut, index into ``keep`` of its last input token, then its prompt rows
    cut_rows: torch.Tensor  # long [C]

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    def upload(self, device: torch.device | str) -> "PrefillPlan":
        return PrefillPlan(*(upload(getattr(self, f.name), device) for f in dataclasses.fields(self)))


def plan_prefill(batch: list[list[int]], num_prompt_tokens: int, num_ensemble: int = 1,
                 cuts: list[list[int]] | None = None, width_multiple: int = 1, read_prompt_rows: bool = True
                 ) -> PrefillPlan:
    """The :class:`PrefillPlan` of ``batch`` (lists of token ids) with a block of ``N * V`` prompt rows per cut
    (``cuts``, default one at the end of each row; see ``attention.packed_layout``), the width rounded up to a
    multiple of ``width_multiple``. The logits kept per cut: its last input token and, if ``read_prompt_rows``,
    its prompt rows."""
    lengths = [len(x) for x in batch]
    if min(lengths) < 1:
        raise ValueError("every prompt needs at least one token")
    cuts = [[n] for n in lengths] if cuts is None else [list(row) for row in cuts]
    check_cuts(lengths, cuts)
    n_rows = num_prompt_tokens * num_ensemble
    width = packed_width(lengths, [len(row) for row in cuts], n_rows, width_multiple)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    for b, x in enumerate(batch):
        ids[b, : len(x)] = torch.as_tensor(x, dtype=torch.long)
    read = n_rows if read_prompt_rows else 0
    wanted, cut_rows = [], []
    for b, (n, row) in enumerate(zip(lengths, cuts)):
        for j, c in enumerate(row):
            wanted.append([c - 1] + [n + j * n_rows + i for i in range(read)])
            cut_rows.append(b)
    keep = sorted({slot for row in wanted for slot in row})
    index = {slot: i for i, slot in enumerate(keep)}
    most = max(len(row) for row in cuts)
    table = torch.tensor(cut_table(cuts, most), dtype=torch.long).view(len(cuts), most)
    return PrefillPlan(ids, torch.tensor(lengths), table, torch.tensor([len(row) for row in cuts]), torch.tensor(keep),
                       torch.tensor([[index[slot] for slot in row] for row in wanted]), torch.tensor(cut_rows))


def prefill_inputs(model, plan: PrefillPlan, prompt_table: torch.Tensor | None, num_prompt_tokens: int,
                   num_ensemble: int = 1, attention_type: AttentionType | str = AttentionType.ENSEMBLE,
                   causal: bool = False) -> PrefillInputs:
    """The forward's inputs from a plan on the model's device, by device work alone (nothing is read back, so a
    captured training step runs this in its graph), with the ``prompt_table`` rows ([N * V, hidden], any dtype;
    gradients flow into it) scattered into each cut's block (None: the plan's prompt slots hold embeddings of id 0).
    ``causal``: the forward runs plain causal attention (``ppd.decoding.causal_prefill``), so no mask is built; the
    ``mask`` is a zero view of the mask's shape that takes no memory, for the model to pass along unread."""
    if causal:
        positions = layout_positions(plan.lengths, plan.cuts, plan.counts, plan.width, num_prompt_tokens,
                                     num_ensemble)
    else:
        allowed, positions = layout_tensors(plan.lengths, plan.cuts, plan.counts, plan.width, num_prompt_tokens,
                                            num_ensemble, attention_type)
    embeds = model.get_input_embeddings()(plan.ids)
    n_rows = num_prompt_tokens * num_ensemble
    prompt_rows = None
    if prompt_table is not None and n_rows:
        rel = torch.arange(plan.width, device=plan.ids.device)[None, :] - plan.lengths[:, None]  # [B, Q]
        is_prompt = (rel >= 0) & (rel < plan.counts[:, None] * n_rows)
        prompt_rows = prompt_row_index(is_prompt, rel.clamp(min=0) % n_rows)
        embeds = torch.where(is_prompt[..., None], prompt_embeddings(prompt_rows, prompt_table, embeds.dtype), embeds)
    layers = LayerAttention.of(model.config)
    if causal:
        rows, width = plan.ids.shape
        unread = embeds.new_zeros(()).expand(rows, 1, width, width)
        masks = {kind: unread for kind in layers.kinds}
    else:
        masks = {kind: to_additive((allowed if window is None else
                                    allowed & within_window(positions, positions, window))[:, None], embeds.dtype)
                 for kind, window in layers.kinds.items()}
    return PrefillInputs(embeds, layers.pack(masks), positions, plan.lengths, plan.keep, plan.where, plan.cut_rows,
                         prompt_rows)


def prompt_embeddings(prompt_rows: torch.Tensor, prompt_table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ``prompt_table`` row of every slot of ``prompt_rows`` (``deep_prompts.prompt_row_index``: table row + 1,
    0 elsewhere), zeros where it is 0, in ``dtype`` on ``prompt_rows``' device. A lookup whose row 0, every real
    token's, adds up no gradient (see ``deep_prompts``' hooks)."""
    table = prompt_table.to(device=prompt_rows.device, dtype=dtype)
    return torch.nn.functional.embedding(prompt_rows, torch.cat([table.new_zeros(1, table.shape[1]), table]),
                                         padding_idx=0)


def build_prefill(model, batch: list[list[int]], prompt_table: torch.Tensor | None, num_prompt_tokens: int,
                  num_ensemble: int = 1, attention_type: AttentionType | str = AttentionType.ENSEMBLE,
                  cuts: list[list[int]] | None = None, width_multiple: int = 1, causal: bool = False) -> PrefillInputs:
    """Inputs of one prefill forward over ``batch`` (lists of token ids) with the ``prompt_table`` rows
    ([N * V, hidden], any dtype; gradients flow into it) appended after each row's tokens, or, with
    ``cuts``, one block of them per cut ``c`` of a row, reading that row's first ``c`` tokens. The width is
    rounded up to a multiple of ``width_multiple`` with padding. ``causal``: see :func:`prefill_inputs`. (The plan is
    made on the host and uploaded without waiting for the device.)"""
    plan = plan_prefill(batch, num_prompt_tokens, num_ensemble, cuts, width_multiple, prompt_table is not None)
    device = model.get_input_embeddings().weight.device
    return prefill_inputs(model, plan.upload(device), prompt_table, num_prompt_tokens, num_ensemble, attention_type,
                          causal)


def average_copies(prompt_logits: torch.Tensor, num_prompt_tokens: int, num_ensemble: int) -> torch.Tensor:
    """[B, N * V, vocab] -> [B, N, vocab] in float32: the V copies of each prompt token averaged."""
    b, _, vocab = prompt_logits.shape
    return prompt_logits.reshape(b, num_prompt_tokens, num_ensemble, vocab).float().mean(2)
