"""Training losses of the prompt tokens: distillation from stored top-k targets, and cross-entropy.

Prompt token i (0-based) predicts the token i + 2 places after the input's end. Both losses weight it
by ``decay ** i`` (reference: 0.8) and divide the sum by N, so the first guesses, which every tree
uses, count most.

Distillation keeps only the teacher's top k. The KL is taken between the teacher and student
distributions coarsened to k + 1 outcomes, the teacher's top-k tokens and one "everything else"
bucket: the teacher's tail mass is ``1 - sum(top-k)`` and the student's is what its softmax gives all
other tokens. This is the exact KL of those coarsened distributions (a lower bound of the full-vocabulary
KL), it never asks the student to put mass the teacher did not have, and it pushes the student's tail
towards the teacher's instead of ignoring it.
"""

from __future__ import annotations

import torch

TAIL_EPS = 1e-5


def position_weights(num_prompt_tokens: int, decay: float, device=None) -> torch.Tensor:
    """[N] weights ``decay ** i / N``."""
    return decay ** torch.arange(num_prompt_tokens, dtype=torch.float32, device=device) / num_prompt_tokens


def topk_kl(student_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per example and prompt token, [B, N], over top-k + a tail bucket.

    ``student_logits`` [B, N, vocab]; ``topk_ids`` [B, N, k] and ``topk_logprobs`` [B, N, k] (teacher,
    normalised over the full vocabulary).
    """
    logz = torch.logsumexp(student_logits.float(), dim=-1, keepdim=True)
    student_top = student_logits.float().gather(-1, topk_ids.long()) - logz  # [B, N, k] log q
    teacher_top = topk_logprobs.float()
    kl_top = (teacher_top.exp() * (teacher_top - student_top)).sum(-1)
    # Tail bucket: log of the mass outside the top k, for both. The student's comes from its own logits
    # with the top-k masked out (exact, no 1 - sum cancellation).
    masked = student_logits.float().scatter(-1, topk_ids.long(), float("-inf"))
    # (clamped: with k = vocabulary the student's tail is empty, log 0 = -inf)
    student_tail = (torch.logsumexp(masked, dim=-1) - logz.squeeze(-1)).clamp(min=-1e4)
    teacher_tail_mass = 1.0 - teacher_top.exp().sum(-1)
    # Below TAIL_EPS the tail is float32 rounding of a top-k that holds all the mass: no bucket.
    kl_tail = torch.where(teacher_tail_mass > TAIL_EPS,
                          teacher_tail_mass * (teacher_tail_mass.clamp(min=1e-30).log() - student_tail),
                          torch.zeros_like(teacher_tail_mass))
    return kl_top + kl_tail


def distillation_loss(student_logits, topk_ids, topk_logprobs, decay: float = 0.8, reduce: bool = True) -> torch.Tensor:
    """Scalar: batch mean of ``sum_i decay**i * KL_i / N`` (``reduce=False``: that sum per example, [B])."""
    kl = topk_kl(student_logits, topk_ids, topk_logprobs)
    losses = (kl * position_weights(kl.shape[1], decay, kl.device)).sum(-1)
    return losses.mean() if reduce else losses


def cross_entropy_loss(student_logits: torch.Tensor, targets: torch.Tensor, decay: float = 0.8,
                       reduce: bool = True) -> torch.Tensor:
    """Scalar: batch mean of ``sum_i decay**i * CE(student_i, target_i) / N``; ``targets`` long [B, N]
    (``reduce=False``: that sum per example, [B])."""
    logprobs = torch.log_softmax(student_logits.float(), dim=-1)
    nll = -logprobs.gather(-1, targets.long()[..., None]).squeeze(-1)  # [B, N]
    losses = (nll * position_weights(nll.shape[1], decay, nll.device)).sum(-1)
    return losses.mean() if reduce else losses
