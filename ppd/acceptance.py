"""Choosing tokens from logits and deciding which tree candidates to accept.

Greedy (temperature 0): a candidate is accepted when it equals the argmax of its parent's logits, which
makes the output identical to greedy autoregressive decoding. Temperature > 0: Medusa-style typical
acceptance (a candidate is accepted when its probability under the parent exceeds
``min(posterior_threshold, posterior_alpha * exp(-entropy))``); like the reference, this does not
preserve the model's sampling distribution.
"""

from __future__ import annotations

import torch

from .config import DecodeConfig


def filter_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail outside the smallest set of tokens whose mass reaches ``top_p``; renormalise."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly before each token
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum(-1, keepdim=True)


def choose_tokens(logits: torch.Tensor, config: DecodeConfig, generator: torch.Generator | None) -> torch.Tensor:
    """Next token for each row of ``logits`` [..., vocab]: argmax when greedy, else a sample."""
    if config.greedy:
        return logits.argmax(-1)
    probs = filter_top_p(torch.softmax(logits.float() / config.temperature, dim=-1), config.top_p)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def accept_candidates(
    node_logits: torch.Tensor, node_tokens: torch.Tensor, parent_row: torch.Tensor, config: DecodeConfig
) -> torch.Tensor:
    """Which candidates pass verification against their parent: bool [B, C].

    ``node_logits`` [B, 1 + C, vocab] are the logits of the root and candidate rows, ``node_tokens``
    [B, 1 + C] their tokens, ``parent_row`` [C] the row of each candidate's parent.
    """
    candidates = node_tokens[:, 1:]
    if config.greedy:
        return candidates == node_logits.argmax(-1)[:, parent_row]
    probs = torch.softmax(node_logits.float() / config.temperature, dim=-1)
    entropy = -(probs * torch.log(probs.clamp_min(1e-10))).sum(-1)  # [B, 1 + C]
    threshold = torch.minimum(
        torch.full_like(entropy, config.posterior_threshold), config.posterior_alpha * torch.exp(-entropy)
    )
    candidate_prob = probs[:, parent_row].gather(-1, candidates[..., None])[..., 0]
    return candidate_prob > threshold[:, parent_row]


def longest_accepted_path(
    accepted: torch.Tensor, retrieve_indices: torch.Tensor, retrieve_valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Best root-to-leaf path per batch row and how many of its candidates are accepted.

    ``accepted``: bool [B, C] per candidate (row r of the tree is candidate r - 1). Returns ``best`` [B]
    (index into ``retrieve_indices``; ties go to the first) and ``accept_length`` [B] (candidates, root
    excluded).
    """
    nodes = torch.cat([torch.ones_like(accepted[:, :1]), accepted], dim=1)  # the root is always accepted
    along = nodes[:, retrieve_indices] & retrieve_valid  # [B, P, depth + 1]
    lengths = along[:, :, 1:].long().cumprod(-1).sum(-1)  # [B, P]
    accept_length, best = lengths.max(-1)
    # torch.max does not promise the first index on ties: take it explicitly.
    best = (lengths == accept_length[:, None]).long().argmax(-1)
    return best, accept_length
