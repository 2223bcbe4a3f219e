"""Choosing tokens from logits and deciding which tree candidates to accept; all on the device.

Greedy (temperature 0): a candidate is accepted when it equals the argmax of its parent's logits, which
makes the output identical to greedy autoregressive decoding. Temperature > 0: Medusa-style typical
acceptance (a candidate is accepted when its probability under the parent exceeds
``min(posterior_threshold, posterior_alpha * exp(-entropy))``); like the reference, this does not
preserve the model's sampling distribution.

Sampling draws its random numbers from a counter-based generator (:func:`uniform`): a hash of the row's
seed, a per-row draw counter and the vocabulary index. It needs no generator object, so a captured step
samples exactly as the eager one does, and the same seed gives the same text whatever runs the step.
Settings that change per request (temperature, top-p, thresholds) are tensors, so one captured step
serves them all.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """An integer hash of 32-bit values held in int64; every product stays below 2**63 (no overflow)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def uniform(seed: torch.Tensor, draws: torch.Tensor, n: int) -> torch.Tensor:
    """Uniform numbers in (0, 1), float32 [B, n], for draw ``draws[b]`` of row b's stream ``seed[b]``."""
    row = _mix32(_mix32(seed & _M32) ^ (draws & _M32))
    # The vocabulary index enters by xor only: compiled kernels hold it in 32 bits, where a product with a
    # large constant would not fit (Triton refuses such a constant).
    index = torch.arange(n, device=seed.device)
    bits = _mix32(row[:, None] ^ index[None, :]) >> 8  # 24 random bits
    return (bits.float() + 0.5) * (1.0 / (1 << 24))


def filter_top_p(probs: torch.Tensor, top_p: torch.Tensor | float) -> torch.Tensor:
    """Zero the tail outside the smallest set of tokens whose mass reaches ``top_p``; renormalise."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly before each token
    if isinstance(top_p, torch.Tensor):
        top_p = top_p.reshape(-1, 1)  # one value, or one per row
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum(-1, keepdim=True)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor | None,
                  seed: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits`` [B, vocab] from softmax(logits / temperature), top-p filtered when
    ``top_p`` is given, by the Gumbel-max rule with numbers from :func:`uniform`. ``temperature`` and
    ``top_p`` hold one value or one per row."""
    scaled = logits.float() / temperature.reshape(-1, 1)
    if top_p is not None:
        probs = filter_top_p(torch.softmax(scaled, dim=-1), top_p)
        scaled = torch.log(probs)  # -inf outside the nucleus
    gumbel = -torch.log(-torch.log(uniform(seed, draws, logits.shape[-1])))
    return (scaled + gumbel).argmax(-1)


def accept_candidates(node_logits: torch.Tensor, node_tokens: torch.Tensor, parent_row: torch.Tensor,
                      greedy: bool, temperature: torch.Tensor | None = None,
                      posterior_threshold: torch.Tensor | None = None,
                      posterior_alpha: torch.Tensor | None = None) -> torch.Tensor:
    """Which candidates pass verification against their parent: bool [B, C].

    ``node_logits`` [B, 1 + C, vocab] are the logits of the root and candidate rows, ``node_tokens``
    [B, 1 + C] their tokens, ``parent_row`` [B, C] the row of each candidate's parent. The sampling
    settings hold one value or one per row.
    """
    candidates = node_tokens[:, 1:]
    if greedy:
        return candidates == node_logits.argmax(-1).gather(1, parent_row)
    probs = torch.softmax(node_logits.float() / temperature.reshape(-1, 1, 1), dim=-1)
    entropy = -(probs * torch.log(probs.clamp_min(1e-10))).sum(-1)  # [B, 1 + C]
    threshold = torch.minimum(posterior_threshold.reshape(-1, 1).expand_as(entropy),
                              posterior_alpha.reshape(-1, 1) * torch.exp(-entropy))
    parent_probs = probs.gather(1, parent_row[..., None].expand(-1, -1, probs.shape[-1]))  # [B, C, vocab]
    candidate_prob = parent_probs.gather(-1, candidates[..., None])[..., 0]
    return candidate_prob > threshold.gather(1, parent_row)


def longest_accepted_path(accepted: torch.Tensor, retrieve_indices: torch.Tensor,
                          retrieve_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Best root-to-leaf path per batch row and how many of its candidates are accepted.

    ``accepted``: bool [B, C] per candidate (row r of the tree is candidate r - 1); ``retrieve_indices``
    and ``retrieve_valid``: [B, P, depth + 1], each row's own tree. Returns ``best`` [B] (index of the path;
    ties go to the first) and ``accept_length`` [B] (candidates, root excluded).
    """
    nodes = torch.cat([accepted.new_ones(accepted.shape[0], 1), accepted], dim=1)  # the root is always accepted
    along = nodes.gather(1, retrieve_indices.flatten(1)).view(retrieve_indices.shape) & retrieve_valid
    lengths = along[:, :, 1:].long().cumprod(-1).sum(-1)  # [B, P]
    accept_length = lengths.max(-1).values
    # torch.max does not promise the first index on ties: take it explicitly.
    best = (lengths == accept_length[:, None]).long().argmax(-1)
    return best, accept_length
