"""The distillation teacher: the base model's own greedy continuation and its top-k distributions.

Two teachers give the same columns for a cut at position ``c`` of a conversation ``x`` (input ``x[:c]``):

* greedy (:func:`teacher_topk`): from each input the model runs ``num_prompt_tokens + 1`` greedy steps
  with a KV cache, a whole batch of inputs at once (left-padded). Step 1 predicts the root token, which the
  frozen LM head already gets right; steps 2..N+1 are the distributions prompt token 1..N learns to
  match, each conditioned on the teacher's own greedy tokens before it.
* forced (:func:`forced_teacher_topk`): the conversation's own text is the context. Token ``j`` is the
  argmax at position ``c - 1 + j`` and distribution ``i`` the one at position ``c + i``, i.e. of
  ``x[c + i + 1]`` given ``x[:c + i + 1]``. One forward over a conversation serves all its cuts. On text
  that is the model's own greedy continuation (self-distilled conversations) it equals the greedy teacher.

Only the top-k entries of each distribution are kept (log-probabilities in float32, normalised over the
full vocabulary), not the full vocabulary.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch

from .decoding.kv_cache import cache_keyword, returned_cache
from .decoding.step import LanguageModel

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


def left_padded(sequences: list[list[int]], pad_token_id: int, device) -> tuple[torch.Tensor, ...]:
    """``input_ids``, ``attention_mask`` and ``position_ids`` [B, longest] of left-padded ``sequences``; real
    tokens keep the positions they would have unpadded."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("the teacher needs non-empty sequences")
    batch, longest = len(sequences), max(len(s) for s in sequences)
    input_ids = torch.full((batch, longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, longest), dtype=torch.long)
    for row, ids in enumerate(sequences):
        input_ids[row, longest - len(ids):] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, longest - len(ids):] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    return input_ids, attention_mask, (attention_mask.cumsum(-1) - 1).clamp(min=0)


def _topk(logprobs: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, indices = logprobs.topk(top_k, dim=-1)
    return indices.to(torch.int32), values


@torch.inference_mode()
def teacher_topk(model, sequences: list[list[int]], num_prompt_tokens: int, top_k: int,
                 pad_token_id: int = 0) -> TeacherOutput:
    """Greedy-decode ``num_prompt_tokens + 1`` tokens after each sequence and keep top-k of steps 2..N+1."""
    input_ids, attention_mask, position_ids = left_padded(sequences, pad_token_id,
                                                           model.get_input_embeddings().weight.device)
    batch = len(sequences)
    extra = _logits_kwargs(model)

    tokens, top_ids, top_logprobs = [], [], []
    cache = None
    keyword = cache_keyword(model)
    step_ids, step_positions = input_ids, position_ids
    for step in range(num_prompt_tokens + 1):
        out = model(input_ids=step_ids, attention_mask=attention_mask, position_ids=step_positions,
                    use_cache=True, **{keyword: cache}, **extra)
        cache = returned_cache(out)
        logprobs = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
        next_token = logprobs.argmax(dim=-1)
        tokens.append(next_token)
        if step > 0:
            indices, values = _topk(logprobs, top_k)
            top_ids.append(indices)
            top_logprobs.append(values)
        step_ids = next_token[:, None]
        step_positions = step_positions[:, -1:] + 1
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, 1)], dim=1)
    return TeacherOutput(
        token_ids=torch.stack(tokens, dim=1).cpu(),
        topk_ids=torch.stack(top_ids, dim=1).cpu(),
        topk_logprobs=torch.stack(top_logprobs, dim=1).cpu(),
    )


@torch.inference_mode()
def forced_teacher_topk(model, sequences: list[list[int]], cuts: list[list[int]], num_prompt_tokens: int,
                        top_k: int, pad_token_id: int = 0) -> TeacherOutput:
    """Teacher-forced targets of every cut ``c`` in ``cuts[b]`` of ``sequences[b]``, one forward per batch.

    Rows of the output follow the cuts in order (all cuts of sequence 0, then of sequence 1, ...). A cut
    needs the tokens up to ``c + num_prompt_tokens - 1``: ``1 <= c`` and ``c + num_prompt_tokens <=
    len(sequence)``. The LM head runs only at the ``num_prompt_tokens + 1`` positions of each cut.
    """
    n = num_prompt_tokens
    if len(cuts) != len(sequences):
        raise ValueError(f"{len(sequences)} sequences but cuts for {len(cuts)}")
    for ids, row_cuts in zip(sequences, cuts):
        bad = [c for c in row_cuts if not 1 <= c <= len(ids) - n]
        if not row_cuts or bad:
            raise ValueError(f"a sequence of {len(ids)} tokens needs cuts in [1, {len(ids) - n}] for "
                             f"{n} prompt tokens, got {row_cuts}")
    lm = LanguageModel.of(model)
    input_ids, attention_mask, position_ids = left_padded(sequences, pad_token_id,
                                                           model.get_input_embeddings().weight.device)
    hidden = lm.body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     use_cache=False).last_hidden_state  # [B, L, hidden]
    longest = input_ids.shape[1]
    rows, columns = [], []
    for b, (ids, row_cuts) in enumerate(zip(sequences, cuts)):
        pad = longest - len(ids)
        for c in row_cuts:  # position p predicts token p + 1: positions c - 1 .. c + n - 1
            rows.extend([b] * (n + 1))
            columns.extend(range(pad + c - 1, pad + c + n))
    picked = hidden[torch.tensor(rows, device=hidden.device), torch.tensor(columns, device=hidden.device)]
    logprobs = torch.log_softmax(lm.logits(picked).float(), dim=-1)
    logprobs = logprobs.view(len(rows) // (n + 1), n + 1, -1)  # [cuts, N + 1, vocab]
    indices, values = _topk(logprobs[:, 1:], top_k)
    return TeacherOutput(token_ids=logprobs.argmax(dim=-1).cpu(), topk_ids=indices.cpu(), topk_logprobs=values.cpu())


@dataclass
class SharedSequence:
    """Rows of one conversation whose texts are prefixes of one token sequence, and their cuts in it."""

    sequence: list[int]  # long enough for every cut's N + 1 positions
    rows: list[int]  # indices of the rows, in order
    cuts: list[int]  # len(input_ids) of each row


def shared_sequences(ids: list[str], input_ids: list[list[int]], labels: list[list[int]],
                     num_prompt_tokens: int) -> list[SharedSequence]:
    """Group consecutive rows of one ``id`` so that one forward serves all their cuts.

    A row joins its group when ``input_ids + labels`` is a prefix of the group's longest such sequence
    (cuts drawn in one conversation are); any other row is a group of its own.
    """
    groups: list[SharedSequence] = []
    start = 0
    while start < len(ids):
        stop = start + 1
        while stop < len(ids) and ids[stop] == ids[start]:
            stop += 1
        texts = {i: input_ids[i] + labels[i] for i in range(start, stop)}
        longest = max(texts.values(), key=len)
        shared = [i for i in texts if longest[: len(texts[i])] == texts[i]]
        alone = [i for i in texts if i not in shared]
        cuts = [len(input_ids[i]) for i in shared]
        groups.append(SharedSequence(longest[: max(cuts) + num_prompt_tokens], shared, cuts))
        groups.extend(SharedSequence(texts[i][: len(input_ids[i]) + num_prompt_tokens], [i], [len(input_ids[i])])
                      for i in alone)
        start = stop
    return groups


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
