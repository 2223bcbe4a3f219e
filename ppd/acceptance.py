"""Choosing tokens from logits and deciding which tree candidates to accept; all on the device.

Greedy (temperature 0): a candidate is accepted when it equals the argmax of its parent's logits, which
makes the output identical to greedy autoregressive decoding.

Temperature > 0, lossless (the default, :func:`walk_tree`): the guesses are deterministic drafts (ranks of
the prompt tokens' top-k), so exact verification needs no draft probabilities. At the last accepted node
the model's next token x is drawn from its own (filtered) distribution p; if a child of the node carries x
the walk moves there, else x is emitted and the step ends. This is the speculative-sampling rule for
deterministic drafts: trying children c_1, c_2, ... in turn, c_i is accepted with probability
p(c_i) / (1 - p(c_1) - ... - p(c_{i-1})) and a rejection removes c_i from the target before the next try;
after every rejection x comes from p restricted to the other tokens. Drawing x once and looking it up
among the children has exactly that law, in one draw instead of one per child. Every emitted token is
therefore an exact sample of the model given the tokens before it.

The random numbers come from a counter-based generator (:func:`uniform`): a hash of the row's seed, the
index of the token being drawn in the row's output, and the vocabulary index. It needs no generator
object, so a captured step samples exactly as the eager one does. Because the noise is tied to the
output position rather than to the step, lossless PPD draws every token with the very numbers the
autoregressive baseline draws it with: with the same seed both write the same text (up to float rounding,
as for greedy), whichever tree verified it.

Typical acceptance (``Acceptance.TYPICAL``, Medusa's): a candidate is accepted when its probability under
the parent exceeds ``min(posterior_threshold, posterior_alpha * exp(-entropy))``; like the reference
implementation's, it accepts more guesses but does not sample from the model's distribution.

Settings that change per request (temperature, top-k, top-p, thresholds) are tensors, so one captured
step serves them all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """An integer hash of 32-bit values held in int64; every product stays below 2**63 (no overflow)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def uniform(seed: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """Uniform numbers in (0, 1), float32 ``[*index.shape, n]``: draw ``index[b, ...]`` of row b's stream
    ``seed[b]`` (``seed`` [B], ``index`` [B] or [B, M])."""
    seed = seed.reshape(seed.shape + (1,) * (index.dim() - 1))
    row = _mix32(_mix32(seed & _M32) ^ (index & _M32))
    # The vocabulary index enters by xor only: compiled kernels hold it in 32 bits, where a product with a
    # large constant would not fit (Triton refuses such a constant).
    vocab = torch.arange(n, device=seed.device)
    bits = _mix32(row[..., None] ^ vocab) >> 8  # 24 random bits
    return (bits.float() + 0.5) * (1.0 / (1 << 24))


def _per_row(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-row setting [B] (or one value) shaped to broadcast over ``like`` [B, ..., vocab]."""
    return value.reshape((-1,) + (1,) * (like.dim() - 1))


def filtered_log_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None = None,
                       top_p: torch.Tensor | None = None) -> torch.Tensor:
    """float32 log-probabilities of softmax(logits / temperature) after the top-k filter (keep the ``top_k``
    most likely; 0 keeps all), then the top-p filter (keep the smallest set of the most likely tokens whose
    mass reaches ``top_p``, renormalised after top-k), in the order transformers applies them; -inf outside.
    ``logits`` [B, ..., vocab]; the settings hold one value or one per row. The most likely token is
    always kept."""
    scaled = logits.float() / _per_row(temperature, logits)
    if top_k is None and top_p is None:
        return torch.log_softmax(scaled, dim=-1)
    ordered, order = scaled.sort(dim=-1, descending=True)
    keep = torch.ones_like(ordered, dtype=torch.bool)
    if top_k is not None:
        k = _per_row(top_k, logits)
        rank = torch.arange(logits.shape[-1], device=logits.device)
        keep = (rank < k) | (k <= 0)
        ordered = ordered.masked_fill(~keep, float("-inf"))
    if top_p is not None:
        p = _per_row(top_p, logits)
        probs = torch.softmax(ordered, dim=-1)
        before = probs.cumsum(-1) - probs  # mass strictly before each token
        keep = keep & ((before < p) | (p >= 1.0))  # p = 1 keeps every token, whatever the rounding of the sum
    ordered = torch.log_softmax(ordered.masked_fill(~keep, float("-inf")), dim=-1)
    return torch.full_like(ordered, float("-inf")).scatter(-1, order, ordered)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                  top_p: torch.Tensor | None, seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits`` [B, vocab] from :func:`filtered_log_probs`, by the Gumbel-max rule
    with the numbers of draw ``index[b]`` of row b's stream ``seed[b]``."""
    gumbel = -torch.log(-torch.log(uniform(seed, index, logits.shape[-1])))
    return (filtered_log_probs(logits, temperature, top_k, top_p) + gumbel).argmax(-1)


def walk_tree(node_logits: torch.Tensor, node_tokens: torch.Tensor, parent_row: torch.Tensor,
              is_candidate: torch.Tensor, depth: int, draw: Callable[[torch.Tensor, int], torch.Tensor]
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless verification of each row's tree (see the module's docstring).

    ``node_logits`` [B, 1 + C, vocab] and ``node_tokens`` [B, 1 + C] are the root's and candidates' rows,
    ``parent_row`` [B, C] each candidate's parent, ``is_candidate`` [B, C] which candidates are real (not
    padding), ``depth`` the deepest path. ``draw(logits [B, vocab], d)`` is the model's token after each
    row's node at depth ``d``. Returns the walked tree rows [B, depth + 1] (root first; past the accepted
    ones the last is repeated), the accepted candidates [B] and the token drawn after the last one [B]
    (the next root).
    """
    batch = torch.arange(node_logits.shape[0], device=node_logits.device)
    candidates = node_tokens[:, 1:]
    current = torch.zeros_like(batch)
    accepted = torch.zeros_like(batch)
    walking = torch.ones_like(batch, dtype=torch.bool)
    token = torch.zeros_like(batch)
    path = [current]
    for d in range(depth + 1):
        drawn = draw(node_logits[batch, current], d)
        token = torch.where(walking, drawn, token)
        if d == depth:
            break
        child = is_candidate & (parent_row == current[:, None]) & (candidates == drawn[:, None])
        walking = walking & child.any(1)
        # The children of a node carry distinct tokens (distinct ranks of one top-k), but a lookup chain's node may
        # repeat a guess beside it: the first that matches is taken. Either stands for the same text, so the law of
        # what is emitted is the same whichever is walked.
        current = torch.where(walking, child.long().argmax(1) + 1, current)
        accepted = accepted + walking.long()
        path.append(current)
    return torch.stack(path, dim=1), accepted, token


def accept_candidates(node_logits: torch.Tensor, node_tokens: torch.Tensor, parent_row: torch.Tensor,
                      greedy: bool, temperature: torch.Tensor | None = None,
                      posterior_threshold: torch.Tensor | None = None,
                      posterior_alpha: torch.Tensor | None = None) -> torch.Tensor:
    """Which candidates pass verification against their parent, greedy or by typical acceptance: bool [B, C].

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
