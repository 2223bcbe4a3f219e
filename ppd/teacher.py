"""The distillation teacher: the base model's own greedy continuation and its top-k distributions.

From each truncated input the model runs ``num_prompt_tokens + 1`` greedy steps with a KV cache, a whole
batch of inputs at once (left-padded). Step 1 predicts the root token, which the frozen LM head already
gets right; steps 2..N+1 are the distributions prompt token 1..N learns to match, each conditioned on the
teacher's own greedy tokens before it. Only their top-k entries are kept (log-probabilities in float32),
not the full vocabulary.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass
class TeacherOutput:
    token_ids: torch.Tensor  # [B, N + 1] the teacher's greedy tokens t+1..t+N+1
    topk_ids: torch.Tensor  # [B, N, k] int32, the k most likely tokens for t+2..t+N+1, most likely first
    topk_logprobs: torch.Tensor  # [B, N, k] float32, their log-probabilities (full-vocabulary softmax)


def _logits_kwargs(model) -> dict:
    # Only the last position's logits are needed; without this a long batch would materialise [B, L, vocab].
    parameters = inspect.signature(model.forward).parameters
    if "logits_to_keep" in parameters:
        return {"logits_to_keep": 1}
    if "num_logits_to_keep" in parameters:
        return {"num_logits_to_keep": 1}
    return {}


@torch.inference_mode()
def teacher_topk(model, sequences: list[list[int]], num_prompt_tokens: int, top_k: int,
                 pad_token_id: int = 0) -> TeacherOutput:
    """Greedy-decode ``num_prompt_tokens + 1`` tokens after each sequence and keep top-k of steps 2..N+1."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("teacher_topk needs non-empty sequences")
    device = model.get_input_embeddings().weight.device
    batch, longest = len(sequences), max(len(s) for s in sequences)
    input_ids = torch.full((batch, longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, longest), dtype=torch.long)
    for row, ids in enumerate(sequences):
        input_ids[row, longest - len(ids):] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, longest - len(ids):] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    # Real tokens keep the positions they would have unpadded.
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    extra = _logits_kwargs(model)

    tokens, top_ids, top_logprobs = [], [], []
    cache = None
    step_ids, step_positions = input_ids, position_ids
    for step in range(num_prompt_tokens + 1):
        out = model(input_ids=step_ids, attention_mask=attention_mask, position_ids=step_positions,
                    past_key_values=cache, use_cache=True, **extra)
        cache = out.past_key_values
        logprobs = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
        next_token = logprobs.argmax(dim=-1)
        tokens.append(next_token)
        if step > 0:
            values, indices = logprobs.topk(top_k, dim=-1)
            top_ids.append(indices.to(torch.int32))
            top_logprobs.append(values)
        step_ids = next_token[:, None]
        step_positions = step_positions[:, -1:] + 1
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, 1)], dim=1)
    return TeacherOutput(
        token_ids=torch.stack(tokens, dim=1).cpu(),
        topk_ids=torch.stack(top_ids, dim=1).cpu(),
        topk_logprobs=torch.stack(top_logprobs, dim=1).cpu(),
    )


def length_batches(lengths: list[int], batch_tokens: int, max_batch_size: int) -> list[list[int]]:
    """Group indices into batches of similar length whose padded size (rows x longest) fits ``batch_tokens``.

    Sorting by length keeps padding small; the grouping depends only on ``lengths``, so a shard always
    batches (and therefore rounds) the same way.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, current = [], []
    for index in order:
        longest = lengths[current[0]] if current else lengths[index]
        if current and (len(current) + 1 > max_batch_size or (len(current) + 1) * longest > batch_tokens):
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches
